-- KEYS: each bill's spend hash and its holds, in pairs, the job's first. ARGV: what the call
-- would hold (usd, tokens), its member and time to live, then each bill's usd cap and token
-- cap (-1: none). Returns {1} and holds it in every bill; {0, i, usd, tokens} when calls in
-- flight hold the room in bill i; {-1, i, usd, tokens} when bill i's sum alone leaves none.
-- The bill is returned as strings (Lua numbers become integers on the way out).
local need_usd, need_tokens = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_s()
local waits = 0
for k = 1, #KEYS / 2 do
  local bill = KEYS[2 * k - 1]
  drop_expired(bill, KEYS[2 * k], now)
  local fields = redis.call('HGETALL', bill)
  local usd, tokens, held_usd, held_tokens = 0, 0, 0, 0
  for i = 1, #fields, 2 do
    local name, value = fields[i], tonumber(fields[i + 1])
    if string.sub(name, 1, 4) == 'usd:' then usd = usd + value
    elseif string.sub(name, 1, 7) == 'tokens:' then tokens = tokens + value
    elseif name == 'held_usd' then held_usd = value
    elseif name == 'held_tokens' then held_tokens = value end
  end
  local usd_cap, tokens_cap = tonumber(ARGV[3 + 2 * k]), tonumber(ARGV[4 + 2 * k])
  local function passes(held_usd, held_tokens)
    return (usd_cap >= 0 and usd + held_usd + need_usd > usd_cap)
        or (tokens_cap >= 0 and tokens + held_tokens + need_tokens > tokens_cap)
  end
  if passes(0, 0) then return {-1, k, tostring(usd), tostring(tokens)} end
  if waits == 0 and passes(held_usd, held_tokens) then waits = {0, k, tostring(usd), tostring(tokens)} end
end
if waits ~= 0 then return waits end
for k = 1, #KEYS / 2 do
  redis.call('HINCRBYFLOAT', KEYS[2 * k - 1], 'held_usd', ARGV[1])
  redis.call('HINCRBY', KEYS[2 * k - 1], 'held_tokens', ARGV[2])
  redis.call('ZADD', KEYS[2 * k], now + tonumber(ARGV[4]), ARGV[3])
  redis.call('EXPIRE', KEYS[2 * k], math.ceil(tonumber(ARGV[4])) + 60)
end
return {1}
