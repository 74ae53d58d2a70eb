-- The trailing-window model's state: entries that leave the window at their time, and the pacing
-- bucket that spreads admissions over it.
-- KEYS[3]: zset entry -> time it leaves the window; KEYS[4]: hash 't:'..entry, 'r:'..entry.
local function add(state, field, amount)
  redis.call('HINCRBYFLOAT', state, field, amount)
end
local function expire(state, window, entries, now)
  local gone = redis.call('ZRANGEBYSCORE', window, '-inf', now)
  for _, entry in ipairs(gone) do
    local amounts = redis.call('HMGET', entries, 't:' .. entry, 'r:' .. entry)
    add(state, 'window_tokens', -(tonumber(amounts[1]) or 0))
    add(state, 'window_requests', -(tonumber(amounts[2]) or 0))
    redis.call('HDEL', entries, 't:' .. entry, 'r:' .. entry)
  end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', window, '-inf', now) end
  return num(state, 'window_tokens', 0), num(state, 'window_requests', 0)
end
-- Seconds until `tokens` more tokens and `requests` more requests fit: entries leave in order.
local function wait_to_fit(window, entries, now, used_tokens, used_requests, tokens, requests, tpm, rpm)
  local offset = 0
  while used_tokens + tokens > tpm or used_requests + requests > rpm do
    local batch = redis.call('ZRANGEBYSCORE', window, '-inf', '+inf', 'WITHSCORES', 'LIMIT', offset, 64)
    if #batch == 0 then return -2 end
    for i = 1, #batch, 2 do
      local amounts = redis.call('HMGET', entries, 't:' .. batch[i], 'r:' .. batch[i])
      used_tokens = used_tokens - (tonumber(amounts[1]) or 0)
      used_requests = used_requests - (tonumber(amounts[2]) or 0)
      if used_tokens + tokens <= tpm and used_requests + requests <= rpm then
        return math.max(tonumber(batch[i + 1]) - now, 0)
      end
    end
    offset = offset + 64
  end
  return 0
end
-- Pacing: a bucket of `pace_s` seconds' worth, refilled at the window's average rate, so
-- admissions spread over the window instead of filling it at once and then stalling.
local function paced(state, tpm, rpm, pace_s, now)
  local s = redis.call('HMGET', state, 'pace_tokens', 'pace_requests', 'pace_ts')
  local cap_tokens, cap_requests = tpm * pace_s / 60, math.max(rpm * pace_s / 60, 1)
  local dt = math.max(now - (tonumber(s[3]) or now), 0)
  local tokens = math.min(cap_tokens, math.max(-tpm, tonumber(s[1]) or cap_tokens) + dt * tpm / 60)
  local requests = math.min(cap_requests, (tonumber(s[2]) or cap_requests) + dt * rpm / 60)
  return tokens, requests, cap_tokens, cap_requests
end
local function store_pace(state, tokens, requests, now, tpm)  -- owing at most one call, as a bucket
  redis.call('HSET', state, 'pace_tokens', string.format('%.6f', math.max(tokens, -tpm)),
             'pace_requests', string.format('%.6f', requests), 'pace_ts', string.format('%.6f', now))
end
local function enter(state, window, entries, entry, leaves_at, tokens, requests)
  redis.call('ZADD', window, leaves_at, entry)
  redis.call('HSET', entries, 't:' .. entry, tokens, 'r:' .. entry, requests)
  add(state, 'window_tokens', tokens)
  add(state, 'window_requests', requests)
end
