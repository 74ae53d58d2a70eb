if fenced(KEYS[1], ARGV[5]) then return 0 end
redis.call('HSET', KEYS[1], 'step', ARGV[1], 'version', ARGV[2], 'metrics', ARGV[3], 'updated', ARGV[4])
return 1
