-- KEYS: state, leases, window, entries.
-- ARGV: tpm, rpm, max_concurrency, prompt, fixed, margin, lease_id, lease_ttl_s, window_s,
--   pace_s (0 = no pacing), ratio_low, ratio_high
local tpm, rpm, max_concurrency = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost = cost_of(KEYS[1], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))
if cost > tpm then return {0, '-2', cost} end
local pace_s = tonumber(ARGV[10])
local now = now_s()
local used_tokens, used_requests = expire(KEYS[1], KEYS[3], KEYS[4], now)
local wait = math.max(num(KEYS[1], 'paused_until', 0) - now, 0)
wait = math.max(wait, wait_to_fit(KEYS[3], KEYS[4], now, used_tokens, used_requests, cost, 1, tpm, rpm))
local pace_tokens, pace_requests, cap_tokens = 0, 0, 0
if pace_s > 0 then  -- a request larger than the pacing bucket waits for a full one, then owes the rest
  pace_tokens, pace_requests, cap_tokens = paced(KEYS[1], tpm, rpm, pace_s, now)
  wait = math.max(wait, (math.min(cost, cap_tokens) - pace_tokens) * 60 / tpm, (1 - pace_requests) * 60 / rpm)
end
if wait > 0 then return {0, tostring(wait), cost} end
if not free_lease(KEYS[2], now, max_concurrency, ARGV[7], tonumber(ARGV[8])) then return {0, '-1', cost} end
enter(KEYS[1], KEYS[3], KEYS[4], ARGV[7], now + tonumber(ARGV[9]), cost, 1)
if pace_s > 0 then store_pace(KEYS[1], pace_tokens - cost, pace_requests - 1, now, tpm) end
return {1, '0', cost, tostring(tpm - used_tokens - cost), tostring(rpm - used_requests - 1), ARGV[9], ARGV[9]}
