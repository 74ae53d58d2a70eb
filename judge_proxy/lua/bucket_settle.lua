-- KEYS: state, leases. ARGV: tpm, rpm, reserved, used_tokens, used_requests, lease_id,
--   remaining_tokens, remaining_requests ('' = unknown), reset_tokens_s, reset_requests_s (unused here),
--   pause_s, prompt_estimate, prompt_counted, ratio_min_weight, ratio_low, ratio_high
local tpm, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local used_tokens, used_requests = charged(tonumber(ARGV[4]), tpm), tonumber(ARGV[5])
local now = now_s()
local tokens, requests, paused_until = refilled(KEYS[1], tpm, rpm, now)
tokens = math.min(tpm, tokens + tonumber(ARGV[3]) - used_tokens)
requests = math.min(rpm, requests + 1 - used_requests)
if ARGV[7] ~= '' then tokens = math.min(tokens, tonumber(ARGV[7])) end
if ARGV[8] ~= '' then requests = math.min(requests, tonumber(ARGV[8])) end
store(KEYS[1], tokens, requests, now, tpm)
finish_settle(KEYS[1], KEYS[2], now, ARGV[6], used_tokens, used_requests, tonumber(ARGV[11]),
              tonumber(ARGV[12]), tonumber(ARGV[13]))
return tostring(tokens)
