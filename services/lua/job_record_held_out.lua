if fenced(KEYS[1], ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'held_out', ARGV[1])
return 1
