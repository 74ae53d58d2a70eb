-- KEYS: state, leases. ARGV: tpm, rpm, max_concurrency, prompt, fixed, margin, lease_id, lease_ttl_s,
--   ratio_low, ratio_high
local tpm, rpm, max_concurrency = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost = cost_of(KEYS[1], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))
if cost > tpm then return {0, '-2', cost} end
local now = now_s()
local tokens, requests, paused_until = refilled(KEYS[1], tpm, rpm, now)
local wait = math.max(paused_until - now, (cost - tokens) * 60 / tpm, (1 - requests) * 60 / rpm, 0)
if wait > 0 then return {0, tostring(wait), cost} end
if not free_lease(KEYS[2], now, max_concurrency, ARGV[7], tonumber(ARGV[8])) then return {0, '-1', cost} end
store(KEYS[1], tokens - cost, requests - 1, now, tpm)
return {1, '0', cost, tostring(tokens - cost), tostring(requests - 1),
        tostring((tpm - tokens + cost) * 60 / tpm), tostring((rpm - requests + 1) * 60 / rpm)}
