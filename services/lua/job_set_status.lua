local current = redis.call('HGET', KEYS[1], 'status')
if not current or ended[current] or (ARGV[6] ~= '' and current ~= ARGV[6]) then return 0 end
if fenced(KEYS[1], ARGV[7]) then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[4])
if ARGV[1] == 'RUNNING' then
  if redis.call('HSETNX', KEYS[1], 'started', ARGV[2]) == 1 then
    redis.call('HSET', KEYS[4], redis.call('HGET', KEYS[1], 'tenant') or '', ARGV[2])
  end
  redis.call('HDEL', KEYS[1], 'paused_reason', 'paused_since')
  redis.call('SADD', KEYS[2], ARGV[4])
elseif ended[ARGV[1]] then
  redis.call('HSET', KEYS[1], 'finished', ARGV[2])
  redis.call('SREM', KEYS[2], ARGV[4])
  for i = 6, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[3]) end
redis.call('PUBLISH', KEYS[5], ARGV[1])
return 1
