if redis.call('EXISTS', KEYS[1]) == 1 or not redis.call('HGET', KEYS[2], 'spec') then return 0 end
local token = redis.call('HINCRBY', KEYS[2], 'fence', 1)
redis.call('SET', KEYS[1], token .. ' ' .. ARGV[1], 'PX', ARGV[2])
return token
