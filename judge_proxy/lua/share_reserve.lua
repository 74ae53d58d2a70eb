-- KEYS: state, asked. ARGV: capacity, rate, active_s, job, weight, cost, lender_keeps
local capacity, rate, active_s = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local job, cost, keeps = ARGV[4], tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_s()
local group = load(KEYS[1], KEYS[2], now, capacity, rate, active_s)
if group.fill[job] == nil then  -- (re)joining: at the group's fill
  table.insert(group.jobs, job)
  group.fill[job] = math.max(group.g, 0) / capacity
else
  group.total = group.total - group.weight[job]
end
group.weight[job] = tonumber(ARGV[5])
group.total = group.total + group.weight[job]
redis.call('ZADD', KEYS[2], now, job)
local function cap(k) return capacity * group.weight[k] / group.total end
local own = group.fill[job] * cap(job)
-- Others' tokens above `keeps` can be lent; what lenders that are not full refill comes too.
local lendable, spare, growing = {}, 0, group.weight[job]
for _, k in ipairs(group.jobs) do
  if k ~= job then
    lendable[k] = math.max(group.fill[k] - keeps, 0) * cap(k)
    spare = spare + lendable[k]
    if group.fill[k] >= keeps and group.fill[k] < 1 then growing = growing + group.weight[k] end
  end
end
local share = group.weight[job] / group.total
local short = math.min(cost, cap(job)) - own - spare
if short > 0 then
  store(KEYS[1], group, now)
  return {0, tostring(short * group.total / (rate * growing)), tostring(share), tostring(own), '0'}
end
local borrowed = math.min(spare, math.max(cost - own, 0))
for k, tokens in pairs(lendable) do  -- each lender gives the same part of what it can lend
  if tokens > 0 then group.fill[k] = keeps + (1 - borrowed / spare) * (group.fill[k] - keeps) end
end
group.fill[job] = (own - cost + borrowed) / cap(job)
group.g = group.g - cost
store(KEYS[1], group, now)
return {1, '0', tostring(share), tostring(group.fill[job] * cap(job)), tostring(borrowed)}
