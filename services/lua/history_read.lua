local dropped = tonumber(redis.call('HGET', KEYS[2], 'history_dropped') or '0')
local first = math.max(tonumber(ARGV[1]), dropped)
return {first, redis.call('LRANGE', KEYS[1], first - dropped, -1)}
