-- KEYS: state, leases, window, entries. ARGV: tpm, rpm, pace_s, ratio_low, ratio_high. Drops
-- expired entries, changes nothing else.
local tpm, rpm, pace_s = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_s()
local used_tokens, used_requests = expire(KEYS[1], KEYS[3], KEYS[4], now)
local s = redis.call('HMGET', KEYS[1], 'paused_until', 'used_tokens_total', 'used_requests_total')
local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
local reset = 0
if #last > 0 then reset = math.max(tonumber(last[2]) - now, 0) end
local pace_tokens, pace_requests = '', ''
if pace_s > 0 then
  local tokens, requests = paced(KEYS[1], tpm, rpm, pace_s, now)
  pace_tokens, pace_requests = tostring(tokens), tostring(requests)
end
return {tostring(tpm - used_tokens), tostring(rpm - used_requests),
        tostring(math.max((tonumber(s[1]) or 0) - now, 0)), redis.call('ZCOUNT', KEYS[2], now, '+inf'),
        tonumber(s[2]) or 0, tonumber(s[3]) or 0, tostring(reset), tostring(reset), tostring(ratio_of(KEYS[1])),
        counters(KEYS[1]), pace_tokens, pace_requests}
