-- KEYS: state, leases. ARGV: tpm, rpm, pace_s (unused here), ratio_low, ratio_high. Reads only.
local tpm, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_s()
local tokens, requests, paused_until = refilled(KEYS[1], tpm, rpm, now)
local totals = redis.call('HMGET', KEYS[1], 'used_tokens_total', 'used_requests_total')
return {tostring(tokens), tostring(requests), tostring(math.max(paused_until - now, 0)),
        redis.call('ZCOUNT', KEYS[2], now, '+inf'), tonumber(totals[1]) or 0, tonumber(totals[2]) or 0,
        tostring((tpm - tokens) * 60 / tpm), tostring((rpm - requests) * 60 / rpm), tostring(ratio_of(KEYS[1])),
        counters(KEYS[1]), '', ''}
