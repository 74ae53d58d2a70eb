-- A lease that lapsed while nobody else took the job (its fence is still ours) is taken up
-- again: the holder was only late.
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not current and redis.call('HGET', KEYS[2], 'fence') == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
