if fenced(KEYS[1], ARGV[1]) then return -1 end
if redis.call('HDEL', KEYS[1], 'learner_stopped') == 1 then return 0 end
local step = redis.call('HGET', KEYS[1], 'step') or '0'
redis.call('HINCRBY', KEYS[1], 'restarts', 1)
redis.call('HSET', KEYS[1], 'last_exit', ARGV[2])
if redis.call('HGET', KEYS[1], 'restart_step') == step then
  return redis.call('HINCRBY', KEYS[1], 'restarts_at_step', 1)
end
redis.call('HSET', KEYS[1], 'restart_step', step, 'restarts_at_step', 1)
return 1
