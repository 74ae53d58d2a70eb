-- KEYS: state, leases, window, entries. ARGV: tpm, rpm, reserved, used_tokens, used_requests,
--   lease_id, remaining_tokens, remaining_requests, reset_tokens_s, reset_requests_s ('' = unknown),
--   pause_s, prompt_estimate, prompt_counted, window_s, pace_s, ratio_min_weight, ratio_low, ratio_high
local tpm, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local used_tokens, used_requests, entry = charged(tonumber(ARGV[4]), tpm), tonumber(ARGV[5]), ARGV[6]
local window_s, pace_s = tonumber(ARGV[14]), tonumber(ARGV[15])
local now = now_s()
if pace_s > 0 then  -- what the upstream did not charge goes back to the pacing bucket too
  local tokens, requests, cap_tokens, cap_requests = paced(KEYS[1], tpm, rpm, pace_s, now)
  store_pace(KEYS[1], math.min(cap_tokens, tokens + tonumber(ARGV[3]) - used_tokens),
             math.min(cap_requests, requests + 1 - used_requests), now, tpm)
end
local in_tokens, in_requests = expire(KEYS[1], KEYS[3], KEYS[4], now)
local held = redis.call('HMGET', KEYS[4], 't:' .. entry, 'r:' .. entry)
if held[1] then  -- still in the window: it now holds what the upstream charged
  if used_tokens == 0 and used_requests == 0 then
    redis.call('ZREM', KEYS[3], entry)
    redis.call('HDEL', KEYS[4], 't:' .. entry, 'r:' .. entry)
  else
    redis.call('HSET', KEYS[4], 't:' .. entry, used_tokens, 'r:' .. entry, used_requests)
  end
  add(KEYS[1], 'window_tokens', used_tokens - tonumber(held[1]))
  add(KEYS[1], 'window_requests', used_requests - tonumber(held[2]))
  in_tokens = in_tokens + used_tokens - tonumber(held[1])
  in_requests = in_requests + used_requests - tonumber(held[2])
end
-- The upstream says less is left than this window holds: hold the difference until its reset
-- (a negative count is none left).
for _, limit in ipairs({{7, 9, tpm - in_tokens, 'tokens'}, {8, 10, rpm - in_requests, 'requests'}}) do
  local remaining, reset = ARGV[limit[1]], ARGV[limit[2]]
  if remaining ~= '' and tonumber(remaining) < limit[3] then
    local hold = window_s
    if reset ~= '' then hold = math.min(window_s, tonumber(reset)) end
    local excess = limit[3] - math.max(tonumber(remaining), 0)
    local clamp = 'clamp-' .. limit[4] .. ':' .. entry
    if limit[4] == 'tokens' then enter(KEYS[1], KEYS[3], KEYS[4], clamp, now + hold, excess, 0)
    else enter(KEYS[1], KEYS[3], KEYS[4], clamp, now + hold, 0, excess) end
    if limit[4] == 'tokens' then in_tokens = in_tokens + excess else in_requests = in_requests + excess end
  end
end
finish_settle(KEYS[1], KEYS[2], now, entry, used_tokens, used_requests, tonumber(ARGV[11]),
              tonumber(ARGV[12]), tonumber(ARGV[13]))
return tostring(tpm - in_tokens)
