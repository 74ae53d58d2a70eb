-- KEYS: index. ARGV: name, model, name, model, ... The index's upstreams of these models
-- become exactly these (an upstream dropped from the config no longer speaks for its model).
local serves, listed = {}, {}
for i = 1, #ARGV, 2 do serves[ARGV[i + 1]] = true; listed[ARGV[i]] = true end
local index = redis.call('HGETALL', KEYS[1])
for i = 1, #index, 2 do
  if serves[index[i + 1]] and not listed[index[i]] then redis.call('HDEL', KEYS[1], index[i]) end
end
redis.call('HSET', KEYS[1], unpack(ARGV))
