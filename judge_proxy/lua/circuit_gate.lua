-- KEYS: health. ARGV: probe_lease_s. Returns the verdict, the time and the record.
local now = now_s()
local s = redis.call('HMGET', KEYS[1], 'state', 'probe_until')
local verdict = 'go'
if s[1] == 'open' or s[1] == 'half_open' then
  verdict = 'wait'
  if now >= (tonumber(s[2]) or 0) then
    verdict = 'probe'
    redis.call('HSET', KEYS[1], 'state', 'half_open', 'probe_until', string.format('%.6f', now + tonumber(ARGV[1])),
               'updated', string.format('%.6f', now))
  end
end
return {verdict, tostring(now), redis.call('HGETALL', KEYS[1])}
