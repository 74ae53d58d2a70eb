-- What both limit models' scripts share (judge_proxy/budget.py): the learned prompt ratio, what a
-- call costs and is charged, concurrency leases, and the end of every settle.
local function num(key, field, default)
  return tonumber(redis.call('HGET', key, field)) or default
end
-- Every script's last two ARGV: the band the learned prompt ratio lies in.
local function ratio_band()
  return tonumber(ARGV[#ARGV - 1]), tonumber(ARGV[#ARGV])
end
-- The learned ratio, read at the nearer bound when stored outside the band.
local function ratio_of(state)
  local low, high = ratio_band()
  return math.min(high, math.max(low, num(state, 'prompt_ratio', 1)))
end
-- Reservation for a prompt estimate and fixed (completion) tokens, with the learned ratio.
local function cost_of(state, prompt, fixed, margin)
  return math.ceil(prompt * ratio_of(state) * (1 + margin)) + fixed
end
-- What a settle charges: what the upstream reported (bounded by the caller), at most `tpm`
-- (no call costs more), never below 0.
local function charged(used_tokens, tpm)
  return math.max(0, math.min(used_tokens, tpm))
end
-- The counts a peek shows beside the levels: prompt outliers, calls learned from, usage outliers.
local function counters(state)
  return {num(state, 'prompt_outliers', 0), num(state, 'prompt_calls', 0), num(state, 'usage_outliers', 0)}
end
local function free_lease(leases, now, max_concurrency, lease_id, ttl)
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
  if redis.call('ZCARD', leases) >= max_concurrency then return false end
  redis.call('ZADD', leases, now + ttl, lease_id)
  return true
end
-- What every settle does after the limit model's own part.
local function finish_settle(state, leases, now, lease_id, used_tokens, used_requests, pause_s,
                             prompt_estimate, prompt_counted)
  if pause_s > 0 then
    local paused_until = num(state, 'paused_until', 0)
    redis.call('HSET', state, 'paused_until', string.format('%.6f', math.max(paused_until, now + pause_s)))
  end
  redis.call('ZREM', leases, lease_id)
  redis.call('HINCRBY', state, 'used_tokens_total', used_tokens)
  redis.call('HINCRBY', state, 'used_requests_total', used_requests)
  if prompt_estimate > 0 and prompt_counted > 0 then
    local low, high = ratio_band()
    local seen = prompt_counted / prompt_estimate
    if seen < low or seen > high then
      redis.call('HINCRBY', state, 'prompt_outliers', 1)
    else
      local calls = redis.call('HINCRBY', state, 'prompt_calls', 1)
      local ratio = ratio_of(state)
      local weight = math.max(1 / calls, tonumber(ARGV[#ARGV - 2]))
      ratio = ratio + weight * (seen - ratio)
      redis.call('HSET', state, 'prompt_ratio', string.format('%.6f', ratio))
    end
  end
end
