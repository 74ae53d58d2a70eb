if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
if ARGV[2] == '1' and redis.call('HGET', KEYS[2], 'fence') == ARGV[3] then
  redis.call('HSET', KEYS[2], 'learner_stopped', 1)
end
