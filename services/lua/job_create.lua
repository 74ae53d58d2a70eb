-- The quota check and the queueing are one script, so concurrent submissions cannot both
-- take the last place.
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('HSETNX', KEYS[4], ARGV[4], 0)
return 1
