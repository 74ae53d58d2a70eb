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
from redis.typing import EncodableT

from judge_proxy.scripts import lua
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

_SCRIPTS = {
    model: tuple(lua("now", "common", model, f"{model}_{script}") for script in ("reserve", "settle", "peek"))
    for model in ("bucket", "window")
}
"""Each limit model's reserve, settle and peek scripts (`judge_proxy/lua/`), by model."""


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

    def left(self, at: float) -> Seen:
        """What the state leaves, as seen at `at` (`time.monotonic()`)."""
        return Seen(self.available_tokens, self.available_requests, self.tokens_reset_s, self.requests_reset_s, at)


class Budget:
    """One upstream's budget, as seen by one replica (all replicas share the Redis state)."""

    def __init__(self, client: aioredis.Redis, upstream: str, limits: Limits) -> None:
        self.limits = limits
        state = Keys.judge_budget(upstream)
        self.keys = [state, state + ":leases"]
        if limits.model == "window":
            self.keys += [state + ":window", state + ":entries"]
        self._reserve, self._settle, self._peek = (client.register_script(s) for s in _SCRIPTS[limits.model])
        self._restamp = client.register_script(lua("restamp"))
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
        args: list[EncodableT] = [
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
            tokens, requests, tokens_reset_s, requests_reset_s = map(float, left)
            self.seen = Seen(tokens, requests, tokens_reset_s, requests_reset_s, now)
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
        args: list[EncodableT] = [
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
        view = BudgetView(
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
        self.seen = view.left(time.monotonic())
        return view


def _optional(value: float | None) -> str:
    return "" if value is None else repr(float(value))
