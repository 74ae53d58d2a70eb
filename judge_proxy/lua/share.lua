-- The active jobs (asked within active_s), each bucket and the group's level refilled to now.
local function load(state, asked, now, capacity, rate, active_s)
  local horizon = '(' .. string.format('%.6f', now - active_s)
  local gone = redis.call('ZRANGEBYSCORE', asked, '-inf', horizon)
  for _, job in ipairs(gone) do redis.call('HDEL', state, 'f:' .. job, 'w:' .. job) end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', asked, '-inf', horizon) end
  local s = redis.call('HMGET', state, 'ts', 'g')
  local refill = math.max(now - (tonumber(s[1]) or now), 0) * rate
  local group = {jobs = redis.call('ZRANGE', asked, 0, -1), fill = {}, weight = {}, total = 0,
                 g = math.min(capacity, (tonumber(s[2]) or capacity) + refill)}
  for _, job in ipairs(group.jobs) do
    local fw = redis.call('HMGET', state, 'f:' .. job, 'w:' .. job)
    group.fill[job] = math.min(1, tonumber(fw[1]) + refill / capacity)
    group.weight[job] = tonumber(fw[2])
    group.total = group.total + group.weight[job]
  end
  return group
end
local function store(state, group, now)
  local fields = {'ts', string.format('%.6f', now), 'g', string.format('%.6f', group.g)}
  for _, job in ipairs(group.jobs) do
    table.insert(fields, 'f:' .. job)
    table.insert(fields, string.format('%.12f', group.fill[job]))
    table.insert(fields, 'w:' .. job)
    table.insert(fields, string.format('%.17g', group.weight[job]))
  end
  redis.call('HSET', state, unpack(fields))
end
