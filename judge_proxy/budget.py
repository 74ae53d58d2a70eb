"""The shared TPM/RPM budget of one upstream, in Redis, updated by Lua scripts.

Providers enforce their limits in one of two ways, and the proxy must hold the line against
either (an upstream's config names its `limit_model`):
- `bucket`: a continuously refilled bucket per limit. Tokens: capacity `tpm`, refilled at
  `tpm / 60` per second; requests likewise with `rpm`. Over `t` seconds an upstream accepts
  at most `capacity + rate * t`: a full minute's burst, then the refill rate.
- `window`: a strict trailing window. Whatever was charged in the last `window_s` seconds
  counts, so there is never more than `tpm` tokens (`rpm` requests) in any window, and no
  burst beyond it. Each reservation is an entry that leaves the window `window_s +
  WINDOW_MARGIN_S` after it was made: the upstream starts its own clock when the request
  arrives, a little later, so the proxy's entry must not leave before the upstream's does.
  A sequence the window admits is one a bucket admits too, so `window` is the safe choice
  for a provider whose rule is not documented. Admissions into a window are also paced
  (`Limits.pace_s`), so the window fills evenly rather than in a burst that then repeats.

Prompt tokens are estimated (characters / 4, or a local tokenizer) and the upstream counts
them its own way. Each upstream learns the ratio of counted to estimated prompt tokens from
the `usage` of its replies (an average over all replicas' calls, the first call counting in
full), and a reservation takes `estimate * ratio * (1 + prompt_margin)` plus every
completion at its maximum. An upstream whose tokenizer is denser than the estimate is then
overrun only by its first few calls. The ratio stays inside a band (`Limits.prompt_ratio_band`):
a call whose own counted/estimated lies outside it teaches nothing and is counted as an
outlier (`prompt_outliers`), and a stored ratio outside it is read at the nearer bound. So no
run of calls, whatever they hide from the estimate, moves later reservations by more than
the band allows.

Every replica runs the same scripts on one Redis, with the Redis server's clock (`TIME`),
so replicas agree on refills and expiries and no interleaving can over-admit:
- `reserve` takes the cost, one request and one concurrency lease at once, or takes nothing
  and says how long to wait, or that the cost (at the ratio learned by now) is more than the
  limit and never fits;
- `settle` replaces what was reserved with what the upstream charged (`usage`): more than
  reserved is charged, and later admissions wait for it, but never more than the request
  could cost (`Budget.billed`: a report over it is a usage outlier) nor than `tpm`. No level
  (a bucket's, a pacing bucket's) owes more than `tpm`, the most one call can cost, so a
  state poisoned by a report from before that bound is whole again within two minutes. It then clamps the state to the
  upstream's `x-ratelimit-remaining-*` when those say less is left (in a window, the
  difference is held until the upstream's `x-ratelimit-reset-*` says it is gone, at most
  a window), learns the prompt ratio, and an upstream 429 pauses the upstream for every
  replica;
- `sent` (a window only) restamps a reservation's entry just before its request goes out
  when that is more than `RESTAMP_AFTER_S` after the reservation, so a request that waited
  in the event loop still leaves the window after the upstream's entry does;
- `peek` reads the state (a window's expired entries are dropped on the way).

State: hash `tandem:judge:budget:{upstream}` (bucket levels, window sums, pause, learned
ratio, totals), zset `...:leases` (lease id -> expiry; the concurrency cap shared by all
replicas, a lease whose replica died expires after `lease_ttl_s`), and for a window zset
`...:window` (entry -> time it leaves) with hash `...:entries` (its tokens and requests).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from services.queues import Keys

LEASE_MARGIN_S = 10.0
"""A concurrency lease outlives the longest its call goes with nothing arriving
(`UpstreamConfig.quiet_bound_s`) by this much before Redis drops it; a stream renews its
lease at a chunk when this long has passed since the last renewal, so a stream that keeps
arriving keeps its slot."""
CONCURRENCY_POLL_S = 0.02
"""How long to wait when only the concurrency cap blocks: leases end at unknown times."""
WINDOW_MARGIN_S = 1.0
"""A window entry outlives the upstream's by this much (the request reaches it later)."""
RESTAMP_AFTER_S = 0.1
"""A request sent later than this after its reservation has its window entry restamped
(sooner, the margin covers the trip)."""
RATIO_MIN_WEIGHT = 0.05
"""The prompt ratio is the mean of the first 20 calls, then a moving average of this weight."""
PROMPT_RATIO_BAND = (0.5, 4.0)
"""Where the learned prompt ratio may lie (provider's count over the local estimate). The
estimate without a tokenizer is chars/4; a provider counts at most about one token per
character (CJK text, punctuation runs), 4x the estimate, and no real text averages more than
8 characters a token, half of it. Outside the band a call is an outlier, not a tokenizer
difference: unbounded, a few calls with parts the estimate missed raised the ratio a
hundredfold, and every ordinary request was then refused as larger than the budget."""

NOW_S_LUA = """
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
"""
"""Seconds on the Redis server's clock, which every replica's scripts share."""

_COMMON = (
    NOW_S_LUA
    + """
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
"""
)

_BUCKET = (
    _COMMON
    + """
local function refilled(key, tpm, rpm, now)
  local s = redis.call('HMGET', key, 'tokens', 'requests', 'ts', 'paused_until')
  local dt = math.max(now - (tonumber(s[3]) or now), 0)
  local tokens = math.min(tpm, math.max(-tpm, tonumber(s[1]) or tpm) + dt * tpm / 60)
  local requests = math.min(rpm, (tonumber(s[2]) or rpm) + dt * rpm / 60)
  return tokens, requests, tonumber(s[4]) or 0
end
local function store(key, tokens, requests, now, tpm)  -- never owing more than one call can take
  redis.call('HSET', key, 'tokens', string.format('%.6f', math.max(tokens, -tpm)),
             'requests', string.format('%.6f', requests), 'ts', string.format('%.6f', now))
end
"""
)

_BUCKET_RESERVE = (
    _BUCKET
    + """
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
"""
)

_BUCKET_SETTLE = (
    _BUCKET
    + """
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
"""
)

_BUCKET_PEEK = (
    _BUCKET
    + """
-- KEYS: state, leases. ARGV: tpm, rpm, pace_s (unused here), ratio_low, ratio_high. Reads only.
local tpm, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_s()
local tokens, requests, paused_until = refilled(KEYS[1], tpm, rpm, now)
local totals = redis.call('HMGET', KEYS[1], 'used_tokens_total', 'used_requests_total')
return {tostring(tokens), tostring(requests), tostring(math.max(paused_until - now, 0)),
        redis.call('ZCOUNT', KEYS[2], now, '+inf'), tonumber(totals[1]) or 0, tonumber(totals[2]) or 0,
        tostring((tpm - tokens) * 60 / tpm), tostring((rpm - requests) * 60 / rpm), tostring(ratio_of(KEYS[1])),
        counters(KEYS[1]), '', ''}
"""
)

_WINDOW = (
    _COMMON
    + """
-- KEYS[3]: zset entry -> time it leaves the window; KEYS[4]: hash 't:'..entry, 'r:'..entry.
local function add(state, field, amount)
  redis.call('HINCRBYFLOAT', state, field, amount)
end
local function expire(state, window, entries, now)
  local gone = redis.call('ZRANGEBYSCORE', window, '-inf', now)
  for _, entry in ipairs(gone) do
    local amounts = redis.call('HMGET', entries, 't:' .. entry, 'r:' .. entry)
    add(state, 'window_tokens', -(tonumber(amounts[1]) or 0))
    add(state, 'window_requests', -(tonumber(amounts[2]) or 0))
    redis.call('HDEL', entries, 't:' .. entry, 'r:' .. entry)
  end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', window, '-inf', now) end
  return num(state, 'window_tokens', 0), num(state, 'window_requests', 0)
end
-- Seconds until `tokens` more tokens and `requests` more requests fit: entries leave in order.
local function wait_to_fit(window, entries, now, used_tokens, used_requests, tokens, requests, tpm, rpm)
  local offset = 0
  while used_tokens + tokens > tpm or used_requests + requests > rpm do
    local batch = redis.call('ZRANGEBYSCORE', window, '-inf', '+inf', 'WITHSCORES', 'LIMIT', offset, 64)
    if #batch == 0 then return -2 end
    for i = 1, #batch, 2 do
      local amounts = redis.call('HMGET', entries, 't:' .. batch[i], 'r:' .. batch[i])
      used_tokens = used_tokens - (tonumber(amounts[1]) or 0)
      used_requests = used_requests - (tonumber(amounts[2]) or 0)
      if used_tokens + tokens <= tpm and used_requests + requests <= rpm then
        return math.max(tonumber(batch[i + 1]) - now, 0)
      end
    end
    offset = offset + 64
  end
  return 0
end
-- Pacing: a bucket of `pace_s` seconds' worth, refilled at the window's average rate, so
-- admissions spread over the window instead of filling it at once and then stalling.
local function paced(state, tpm, rpm, pace_s, now)
  local s = redis.call('HMGET', state, 'pace_tokens', 'pace_requests', 'pace_ts')
  local cap_tokens, cap_requests = tpm * pace_s / 60, math.max(rpm * pace_s / 60, 1)
  local dt = math.max(now - (tonumber(s[3]) or now), 0)
  local tokens = math.min(cap_tokens, math.max(-tpm, tonumber(s[1]) or cap_tokens) + dt * tpm / 60)
  local requests = math.min(cap_requests, (tonumber(s[2]) or cap_requests) + dt * rpm / 60)
  return tokens, requests, cap_tokens, cap_requests
end
local function store_pace(state, tokens, requests, now, tpm)  -- owing at most one call, as a bucket
  redis.call('HSET', state, 'pace_tokens', string.format('%.6f', math.max(tokens, -tpm)),
             'pace_requests', string.format('%.6f', requests), 'pace_ts', string.format('%.6f', now))
end
local function enter(state, window, entries, entry, leaves_at, tokens, requests)
  redis.call('ZADD', window, leaves_at, entry)
  redis.call('HSET', entries, 't:' .. entry, tokens, 'r:' .. entry, requests)
  add(state, 'window_tokens', tokens)
  add(state, 'window_requests', requests)
end
"""
)

_WINDOW_RESERVE = (
    _WINDOW
    + """
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
"""
)

_WINDOW_SETTLE = (
    _WINDOW
    + """
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
"""
)

_RESTAMP = """
-- KEYS: a window or the leases. ARGV: entry or lease id, seconds from now. Only an entry still
-- there moves, and only later.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
return redis.call('ZADD', KEYS[1], 'XX', 'GT', now + tonumber(ARGV[2]), ARGV[1])
"""

_WINDOW_PEEK = (
    _WINDOW
    + """
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
"""
)


LimitModel = Literal["bucket", "window"]


@dataclass(frozen=True)
class Limits:
    tpm: int
    rpm: int
    max_concurrency: int
    lease_ttl_s: float
    """Longest an upstream call holds a concurrency slot unless renewed (its quiet bound plus
    `LEASE_MARGIN_S`)."""
    model: LimitModel = "bucket"
    window_s: float = 60.0
    """The trailing window of the `window` model, as the upstream counts it."""
    window_margin_s: float = WINDOW_MARGIN_S
    pace_s: float = 6.0
    """In a window, admissions are paced at the window's average rate (`tpm / 60` a second)
    with at most `pace_s` seconds' worth at once; 0 admits up to the window's limit at once.
    Without pacing, a window filled in a burst empties in a burst, a minute later, every
    minute: clients wait for a whole minute at a time and the provider sees the bursts."""
    prompt_margin: float = 0.05
    """Reserve this much more than the learned prompt count, for calls that count above average."""
    prompt_ratio_band: tuple[float, float] = PROMPT_RATIO_BAND
    """The learned prompt ratio stays in it; a call whose own ratio lies outside is an outlier."""


@dataclass(frozen=True)
class Lease:
    lease_id: str
    tokens: int
    """Tokens reserved at admission."""
    prompt_estimate: int = 0
    """The prompt's own estimate (before the learned ratio), to learn from its `usage`."""
    reserved_at: float = 0.0
    """`time.monotonic()` when it was reserved."""
    fixed_tokens: int = 0
    """Every completion at its maximum (`n * max_tokens`), reserved beside the prompt."""


@dataclass(frozen=True)
class Seen:
    """What this replica last saw left of the budget (at a reservation or a peek), for the
    `x-ratelimit-*` headers without another trip to Redis."""

    tokens: float
    requests: float
    tokens_reset_s: float
    requests_reset_s: float
    at: float
    """`time.monotonic()` when seen; the resets count down from it."""


@dataclass(frozen=True)
class Admission:
    lease: Lease | None
    wait_s: float
    """0 when admitted; else seconds until the reservation could succeed (infinite: never,
    the cost is more than the limit)."""
    cost: int = 0
    """Tokens this request costs at the current ratio (reserved when admitted)."""


@dataclass(frozen=True)
class BudgetView:
    available_tokens: float
    available_requests: float
    paused_for_s: float
    inflight: int
    used_tokens_total: int
    used_requests_total: int
    tokens_reset_s: float
    """Seconds until the token limit is whole again (a full bucket, an empty window)."""
    requests_reset_s: float
    prompt_ratio: float
    """Learned: prompt tokens the upstream counts per estimated one."""
    prompt_outliers: int = 0
    """Calls whose own counted/estimated lay outside the band, so taught the ratio nothing."""
    prompt_calls: int = 0
    """Calls the ratio was learned from."""
    usage_outliers: int = 0
    """Replies that reported more `total_tokens` than their request could cost (`Budget.most`),
    so were charged that instead."""
    pace_tokens: float | None = None
    """What the pacing bucket of a paced window holds (None without one)."""
    pace_requests: float | None = None


class Budget:
    """One upstream's budget, as seen by one replica (all replicas share the Redis state)."""

    def __init__(self, client: aioredis.Redis, upstream: str, limits: Limits) -> None:
        self.limits = limits
        state = Keys.judge_budget(upstream)
        self.keys = [state, state + ":leases"]
        if limits.model == "window":
            self.keys += [state + ":window", state + ":entries"]
        scripts = {
            "bucket": (_BUCKET_RESERVE, _BUCKET_SETTLE, _BUCKET_PEEK),
            "window": (_WINDOW_RESERVE, _WINDOW_SETTLE, _WINDOW_PEEK),
        }[limits.model]
        self._reserve, self._settle, self._peek = (client.register_script(s) for s in scripts)
        self._restamp = client.register_script(_RESTAMP)
        self._client = client
        self.prompt_ratio = 1.0
        """The learned ratio as last seen by this replica (for estimates outside Redis)."""
        self.seen: Seen | None = None

    @property
    def _window_s(self) -> float:
        return self.limits.window_s + self.limits.window_margin_s

    def cost(self, fixed_tokens: int, prompt_estimate: int = 0) -> int:
        """The reservation at the last seen ratio (Redis applies the current one)."""
        return math.ceil(prompt_estimate * self.prompt_ratio * (1 + self.limits.prompt_margin)) + fixed_tokens

    async def reserve(self, fixed_tokens: int, prompt_estimate: int = 0) -> Admission:
        """Reserve `fixed_tokens` (the completions at their maximum) plus the prompt at the
        learned ratio, one request and one concurrency slot; or learn how long to wait."""
        lease_id = uuid.uuid4().hex
        limits = self.limits
        args = [
            limits.tpm,
            limits.rpm,
            limits.max_concurrency,
            prompt_estimate,
            fixed_tokens,
            limits.prompt_margin,
            lease_id,
            limits.lease_ttl_s,
        ]
        if limits.model == "window":
            args += [self._window_s, limits.pace_s]
        ok, wait, cost, *left = await self._reserve(self.keys, [*args, *limits.prompt_ratio_band])
        if ok:
            now = time.monotonic()
            self.seen = Seen(*map(float, left), at=now)
            return Admission(Lease(lease_id, int(cost), prompt_estimate, now, fixed_tokens), 0.0, int(cost))
        wait_s = float(wait)  # -1: only the concurrency cap blocks; -2: the cost is over the limit
        return Admission(None, {-1.0: CONCURRENCY_POLL_S, -2.0: math.inf}.get(wait_s, wait_s), int(cost))

    async def sent(self, lease: Lease) -> None:
        """The request of `lease` is about to go out: in a window, its entry leaves a window
        from now (a bucket has nothing to move)."""
        if self.limits.model == "window" and time.monotonic() - lease.reserved_at > RESTAMP_AFTER_S:
            await self._restamp([self.keys[2]], [lease.lease_id, self._window_s])

    async def renew(self, lease: Lease) -> None:
        """`lease`'s call is still going (a stream arriving): hold its concurrency slot for
        another `lease_ttl_s`."""
        await self._restamp([self.keys[1]], [lease.lease_id, self.limits.lease_ttl_s])

    def most(self, lease: Lease) -> int:
        """The most `lease`'s call can cost: its prompt counted at the top of the ratio band
        and every completion at its maximum, or what was reserved when that is more. The
        upstream's count of a prompt beyond the band's top is an outlier (`finish_settle`),
        and no completion is longer than the `max_tokens` sent."""
        return max(
            lease.tokens, math.ceil(lease.prompt_estimate * self.limits.prompt_ratio_band[1]) + lease.fixed_tokens
        )

    def billed(self, lease: Lease, reported: int | None) -> tuple[int, bool]:
        """What a reply reporting `reported` total tokens is charged, and whether the report
        was an outlier: the report up to `most`, and `most` above it; all that was reserved
        when there is no report or it is negative (the upstream may have charged it)."""
        if reported is None or reported < 0:
            return lease.tokens, False
        most = self.most(lease)
        return min(reported, most), reported > most

    async def settle(
        self,
        lease: Lease,
        used_tokens: int,
        *,
        usage_outlier: bool = False,
        used_request: bool = True,
        prompt_tokens: int | None = None,
        remaining_tokens: float | None = None,
        remaining_requests: float | None = None,
        reset_tokens_s: float | None = None,
        reset_requests_s: float | None = None,
        pause_s: float = 0.0,
    ) -> float:
        """Reconcile a lease with what the upstream charged (`prompt_tokens`: its count of
        the prompt, from `usage`; `usage_outlier`: its report was over `most`, and counted);
        returns the tokens left."""
        if usage_outlier:
            await self._client.hincrby(self.keys[0], "usage_outliers", 1)
        args = [
            self.limits.tpm,
            self.limits.rpm,
            lease.tokens,
            used_tokens,
            int(used_request),
            lease.lease_id,
            _optional(remaining_tokens),
            _optional(remaining_requests),
            _optional(reset_tokens_s),
            _optional(reset_requests_s),
            pause_s,
            lease.prompt_estimate,
            prompt_tokens or 0,
        ]
        if self.limits.model == "window":
            args += [self._window_s, self.limits.pace_s]
        args += [RATIO_MIN_WEIGHT, *self.limits.prompt_ratio_band]
        return float(await self._settle(self.keys, args))

    async def view(self) -> BudgetView:
        """Every part of the shared state: levels, pause, leases, totals, the learned ratio
        and its counts, and a paced window's pacing bucket."""
        limits = self.limits
        args = [limits.tpm, limits.rpm, limits.pace_s, *limits.prompt_ratio_band]
        levels = await self._peek(self.keys, args)
        tokens, requests, paused, inflight, used_tokens, used_requests, tokens_reset, requests_reset, ratio = levels[:9]
        prompt_outliers, prompt_calls, usage_outliers = levels[9]
        pace_tokens, pace_requests = (float(p) if p else None for p in levels[10:])
        self.prompt_ratio = float(ratio)
        self.seen = Seen(float(tokens), float(requests), float(tokens_reset), float(requests_reset), time.monotonic())
        return BudgetView(
            float(tokens),
            float(requests),
            float(paused),
            int(inflight),
            int(used_tokens),
            int(used_requests),
            float(tokens_reset),
            float(requests_reset),
            float(ratio),
            int(prompt_outliers),
            int(prompt_calls),
            int(usage_outliers),
            pace_tokens,
            pace_requests,
        )


def _optional(value: float | None) -> str:
    return "" if value is None else repr(float(value))
