if fenced(KEYS[1], ARGV[3]) then return 0 end
local current = redis.call('HGET', KEYS[1], 'status')
if current == 'RUNNING' then
  redis.call('HSET', KEYS[1], 'status', 'PAUSED', 'paused_since', ARGV[2])
elseif current ~= 'PAUSED' then
  return 0
end
redis.call('HSET', KEYS[1], 'paused_reason', ARGV[1])
redis.call('PUBLISH', KEYS[2], 'PAUSED')
return 1
