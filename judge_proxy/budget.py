"""The shared TPM/RPM budget of one upstream: token buckets in Redis, updated by Lua.

Window semantics (the local upstream enforces the same, see `local_upstream.py`): a
continuously refilled bucket per limit. Tokens: capacity `tpm`, refilled at `tpm / 60` per
second; requests: capacity `rpm`, refilled at `rpm / 60` per second. Over any interval of
`t` seconds an upstream then accepts at most `capacity + rate * t`, and in a steady state
exactly `rate * t`: the budget used in full, never more.

Every replica runs the same three scripts on one Redis, with the Redis server's clock
(`TIME`), so replicas agree on the refill and no interleaving can over-admit:
- `reserve` takes `cost` tokens, one request and one concurrency lease at once, or takes
  nothing and says how long to wait;
- `settle` puts back `reserved - used` tokens. `used` larger than `reserved` drives the
  level below zero: the overshoot is charged and later admissions wait for it. The level is
  then clamped to the upstream's `x-ratelimit-remaining-*` when that is lower, and an
  upstream 429 pauses the upstream for every replica;
- `peek` reads the state without changing it.

State: hash `tandem:judge:budget:{upstream}` (levels, refill time, pause, totals) and zset
`tandem:judge:budget:{upstream}:leases` (lease id -> expiry). The concurrency cap is shared
by all replicas; a lease whose replica died expires after `lease_ttl_s`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.queues import Keys

CONCURRENCY_POLL_S = 0.02
"""How long to wait when only the concurrency cap blocks: leases end at unknown times."""

_REFILL = """
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function refilled(key, tpm, rpm, now)
  local s = redis.call('HMGET', key, 'tokens', 'requests', 'ts', 'paused_until')
  local dt = math.max(now - (tonumber(s[3]) or now), 0)
  local tokens = math.min(tpm, (tonumber(s[1]) or tpm) + dt * tpm / 60)
  local requests = math.min(rpm, (tonumber(s[2]) or rpm) + dt * rpm / 60)
  return tokens, requests, tonumber(s[4]) or 0
end
local function store(key, tokens, requests, now)
  redis.call('HSET', key, 'tokens', string.format('%.6f', tokens),
             'requests', string.format('%.6f', requests), 'ts', string.format('%.6f', now))
end
"""

_RESERVE = _REFILL + """
-- KEYS: state, leases. ARGV: tpm, rpm, max_concurrency, cost, lease_id, lease_ttl_s
local tpm, rpm, max_concurrency = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local now = now_s()
local tokens, requests, paused_until = refilled(KEYS[1], tpm, rpm, now)
local wait = math.max(paused_until - now, (cost - tokens) * 60 / tpm, (1 - requests) * 60 / rpm, 0)
if wait > 0 then return {0, tostring(wait)} end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) >= max_concurrency then return {0, '-1'} end
store(KEYS[1], tokens - cost, requests - 1, now)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[5])
return {1, '0'}
"""

_SETTLE = _REFILL + """
-- KEYS: state, leases. ARGV: tpm, rpm, reserved, used_tokens, used_requests, lease_id,
--       remaining_tokens ('' = unknown), remaining_requests ('' = unknown), pause_s
local tpm, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local used_tokens, used_requests = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_s()
local tokens, requests, paused_until = refilled(KEYS[1], tpm, rpm, now)
tokens = math.min(tpm, tokens + tonumber(ARGV[3]) - used_tokens)
requests = math.min(rpm, requests + 1 - used_requests)
if ARGV[7] ~= '' then tokens = math.min(tokens, tonumber(ARGV[7])) end
if ARGV[8] ~= '' then requests = math.min(requests, tonumber(ARGV[8])) end
store(KEYS[1], tokens, requests, now)
local pause_s = tonumber(ARGV[9])
if pause_s > 0 then
  redis.call('HSET', KEYS[1], 'paused_until', string.format('%.6f', math.max(paused_until, now + pause_s)))
end
redis.call('ZREM', KEYS[2], ARGV[6])
redis.call('HINCRBY', KEYS[1], 'used_tokens_total', used_tokens)
redis.call('HINCRBY', KEYS[1], 'used_requests_total', used_requests)
return tostring(tokens)
"""

_PEEK = _REFILL + """
-- KEYS: state, leases. ARGV: tpm, rpm. Reads only.
local now = now_s()
local tokens, requests, paused_until = refilled(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), now)
local totals = redis.call('HMGET', KEYS[1], 'used_tokens_total', 'used_requests_total')
return {tostring(tokens), tostring(requests), tostring(math.max(paused_until - now, 0)),
        redis.call('ZCOUNT', KEYS[2], now, '+inf'), tonumber(totals[1]) or 0, tonumber(totals[2]) or 0}
"""


@dataclass(frozen=True)
class Limits:
    tpm: int
    rpm: int
    max_concurrency: int
    lease_ttl_s: float
    """Longest an upstream call may hold a concurrency slot (its timeout plus a margin)."""


@dataclass(frozen=True)
class Lease:
    lease_id: str
    tokens: int
    """Tokens reserved at admission."""


@dataclass(frozen=True)
class Admission:
    lease: Lease | None
    wait_s: float
    """0 when admitted; else seconds until the reservation could succeed."""


@dataclass(frozen=True)
class BudgetView:
    available_tokens: float
    available_requests: float
    paused_for_s: float
    inflight: int
    used_tokens_total: int
    used_requests_total: int


class Budget:
    """One upstream's budget, as seen by one replica (all replicas share the Redis state)."""

    def __init__(self, client: aioredis.Redis, upstream: str, limits: Limits) -> None:
        self.limits = limits
        self.keys = [Keys.judge_budget(upstream), Keys.judge_budget(upstream) + ":leases"]
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)
        self._peek = client.register_script(_PEEK)

    async def reserve(self, tokens: int) -> Admission:
        lease_id = uuid.uuid4().hex
        limits = self.limits
        ok, wait = await self._reserve(self.keys, [limits.tpm, limits.rpm, limits.max_concurrency,
                                                   tokens, lease_id, limits.lease_ttl_s])
        if ok:
            return Admission(Lease(lease_id, tokens), 0.0)
        wait_s = float(wait)
        return Admission(None, CONCURRENCY_POLL_S if wait_s < 0 else wait_s)

    async def settle(self, lease: Lease, used_tokens: int, *, used_request: bool = True,
                     remaining_tokens: float | None = None, remaining_requests: float | None = None,
                     pause_s: float = 0.0) -> float:
        """Reconcile a lease with what the upstream charged; returns the new token level."""
        args = [self.limits.tpm, self.limits.rpm, lease.tokens, used_tokens, int(used_request), lease.lease_id,
                _optional(remaining_tokens), _optional(remaining_requests), pause_s]
        return float(await self._settle(self.keys, args))

    async def view(self) -> BudgetView:
        tokens, requests, paused, inflight, used_tokens, used_requests = await self._peek(
            self.keys, [self.limits.tpm, self.limits.rpm])
        return BudgetView(float(tokens), float(requests), float(paused), int(inflight),
                          int(used_tokens), int(used_requests))


def _optional(value: float | None) -> str:
    return "" if value is None else repr(float(value))
