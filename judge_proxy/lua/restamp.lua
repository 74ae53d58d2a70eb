-- KEYS: a window or the leases. ARGV: entry or lease id, seconds from now. Only an entry still
-- there moves, and only later.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
return redis.call('ZADD', KEYS[1], 'XX', 'GT', now + tonumber(ARGV[2]), ARGV[1])
