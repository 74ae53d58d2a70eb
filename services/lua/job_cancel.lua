local current = redis.call('HGET', KEYS[3], 'status')
if current == 'PENDING' then
  redis.call('HSET', KEYS[3], 'status', 'CANCELLED', 'finished', ARGV[1], 'cancel_requested', 1)
  redis.call('ZREM', KEYS[1], ARGV[3])
  for i = 3, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
  redis.call('PUBLISH', KEYS[2], 'CANCELLED')
  return 'CANCELLED'
elseif current == 'RUNNING' or current == 'PAUSED' then
  redis.call('HSET', KEYS[3], 'cancel_requested', 1)
end
return current
