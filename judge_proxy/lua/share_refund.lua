-- KEYS: state, asked. ARGV: capacity, rate, active_s, job, tokens (negative: a further charge)
local capacity, rate, active_s = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local job, tokens = ARGV[4], tonumber(ARGV[5])
local now = now_s()
local group = load(KEYS[1], KEYS[2], now, capacity, rate, active_s)
group.g = math.min(capacity, group.g + tokens)
local left = 0
if group.fill[job] ~= nil then  -- a job gone idle meanwhile keeps nothing; the group does
  local cap = capacity * group.weight[job] / group.total
  group.fill[job] = math.min(1, group.fill[job] + tokens / cap)
  left = group.fill[job] * cap
end
store(KEYS[1], group, now)
return tostring(left)
