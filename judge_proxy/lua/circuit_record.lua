-- KEYS: health. ARGV: model, kind ('ok', 'failure', 'rate_limited'), reason,
--   probe ('1': this call held the probe), circuit_failures, rate_limit_outage_s, circuit_open_s.
-- Returns the record (empty: closed, no streak, unchanged).
local function fmt(x) return string.format('%.6f', x) end
local now = now_s()
local s = redis.call('HMGET', KEYS[1], 'state', 'failures', 'since', 'limited_since')
local state, failures = s[1] or 'closed', tonumber(s[2]) or 0
local since, limited_since = tonumber(s[3]) or 0, tonumber(s[4]) or 0
local kind, probe = ARGV[2], ARGV[4] == '1'
if kind == 'ok' then
  if state == 'closed' and since == 0 then return {} end
  redis.call('HSET', KEYS[1], 'state', 'closed', 'failures', 0, 'since', 0, 'limited_since', 0, 'reason', '',
             'probe_until', 0, 'updated', fmt(now))
  return redis.call('HGETALL', KEYS[1])
end
if since == 0 then since = now end
local reason = ARGV[3]
if kind == 'rate_limited' then
  if limited_since == 0 then limited_since = now end
  reason = string.format('429 for %d s', math.floor(now - limited_since))
else
  failures = failures + 1
  limited_since = 0
end
local outage = failures >= tonumber(ARGV[5]) or (limited_since > 0 and now - limited_since >= tonumber(ARGV[6]))
redis.call('HSET', KEYS[1], 'model', ARGV[1], 'failures', failures, 'since', fmt(since),
           'limited_since', fmt(limited_since), 'reason', reason, 'updated', fmt(now))
if (probe and state ~= 'closed') or (state == 'closed' and outage) then
  redis.call('HSET', KEYS[1], 'state', 'open', 'opened_at', fmt(now), 'probe_until', fmt(now + tonumber(ARGV[7])))
elseif state == 'closed' then
  redis.call('HSET', KEYS[1], 'state', 'closed')
end
return redis.call('HGETALL', KEYS[1])
