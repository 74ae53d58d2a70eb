-- KEYS: holds zsets. ARGV: the member, its time to live. A stream still arriving keeps its hold.
local now = now_s()
for k = 1, #KEYS do redis.call('ZADD', KEYS[k], 'XX', now + tonumber(ARGV[2]), ARGV[1]) end
return 1
