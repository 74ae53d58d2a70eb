-- The token-bucket model's state: tokens and requests refilled continuously up to tpm and rpm.
local function refilled(key, tpm, rpm, now)
  local s = redis.call('HMGET', key, 'tokens', 'requests', 'ts', 'paused_until')
  local dt = math.max(now - (tonumber(s[3]) or now), 0)
  local tokens = math.min(tpm, math.max(-tpm, tonumber(s[1]) or tpm) + dt * tpm / 60)
  local requests = math.min(rpm, (tonumber(s[2]) or rpm) + dt * rpm / 60)
  return tokens, requests, tonumber(s[4]) or 0
end
local function store(key, tokens, requests, now, tpm)  -- never owing more than one call can take
  redis.call('HSET', key, 'tokens', string.format('%.6f', math.max(tokens, -tpm)),
             'requests', string.format('%.6f', requests), 'ts', string.format('%.6f', now))
end
