"""Admission, the gateway's first half (`judge_proxy.gateway`): a request's cost from its
job's share of the model group, then from an upstream's budget, waiting in the group's queue
for both; upstreams that failed here recently are tried last, and one whose circuit is open
(`circuit.py`) not at all. When every upstream left to try is open, the request is refused at
once with 503 `upstream_unavailable` (nothing reserved), its `retry-after` the next probe."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from judge_proxy import metrics
from judge_proxy.budget import LEASE_MARGIN_S, Lease
from judge_proxy.circuit import Gate
from judge_proxy.errors import ProxyError, too_large
from judge_proxy.queue import Admitter, QueueTimeout, Tried
from judge_proxy.share import Share, Weights
from judge_proxy.spend import Bill, Held, JobSpend, bills_of, hold_caps
from judge_proxy.upstream import Upstream, weighted_order
from services.upstream_health import Outage, outage_of


@dataclass
class Grant:
    upstream: Upstream
    lease: Lease
    job: str
    share_tokens: int
    """Taken from the job's share of the group (settled with the lease)."""
    probe: bool = False
    """The call is its upstream's half-open probe: its outcome closes or reopens the circuit."""
    held: Held | None = None
    """What it holds of its bills' caps (`JobSpend.hold`) until it settles."""
    bills: list[str] = field(default_factory=list)
    """The spend hashes its cost is charged to: its job's and its tenant's month (`bills_of`)."""


class Reserved(NamedTuple):
    """An upstream's lease for one call, and whether the call is its circuit's probe."""

    upstream: Upstream
    lease: Lease
    probe: bool


@dataclass
class Group:
    """The upstreams clients reach under one model name, this replica's queue for them and
    the jobs' shares of their budget."""

    model: str
    upstreams: list[Upstream]
    admitter: Admitter[Grant]
    share: Share
    spend: JobSpend
    """The jobs' bills and caps (one for the proxy; every group holds it)."""
    structured: bool
    """Its upstreams keep to a JSON schema in `response_format` (all or none of them)."""


@dataclass
class Attempts:
    """What one request's attempts have met so far."""

    job: str
    priority: str
    tag: str = ""
    """Sent upstream as `X-Client-Request-Id` (the client's idempotency key, if any)."""
    role: str = ""
    """What the job's bill calls the request (`judge_proxy.spend.ROLES`); its priority when unset."""
    failed: dict[str, str] = field(default_factory=dict)
    """Upstream name -> why it failed (5xx, timeout, ...)."""
    rate_limited_last: bool = False
    last_pause_s: float = 0.0
    queue_s: float = 0.0
    upstream_s: float = 0.0


def dearest_usd(upstream: Upstream, need: Need) -> float:
    """The most a call can cost on `upstream`: the prompt it reserves at the input price
    (none of it cached) and every completion token at the output price (0 without prices)."""
    prices = upstream.config.prices
    if prices is None:
        return 0.0
    prompt = need.cost(upstream) - need.fixed_tokens
    return (prompt * prices.input_per_mtok + need.fixed_tokens * prices.output_per_mtok) / 1e6


def hold_ttl_s(candidates: list[Upstream], deadline: float) -> float:
    """How long a call's cap hold lives unless renewed: its wait in the queue (until
    `deadline`), then the longest its call may go with nothing arriving, and a margin (a
    stream renews it as it arrives, as it does its budget lease)."""
    quiet_s = max(u.config.quiet_bound_s for u in candidates)
    return max(deadline - time.monotonic(), 0.0) + quiet_s + LEASE_MARGIN_S


@dataclass(frozen=True)
class Need:
    """What one request asks of an upstream's budget."""

    fixed_tokens: int
    """Every completion at its maximum (`n * max_tokens`)."""
    prompt_estimates: dict[str, int]
    """Upstream name -> the prompt's local estimate (the budget scales it by the learned ratio)."""

    def cost(self, upstream: Upstream) -> int:
        return upstream.budget.cost(self.fixed_tokens, self.prompt_estimates[upstream.name])


class Admission:
    """Grants for one replica's requests: the job's share, then an upstream's budget."""

    def __init__(self, weights: Weights, rng: random.Random) -> None:
        self.weights = weights
        self.rng = rng
        self.cooldown_until: dict[str, float] = {}
        """Upstream name -> until when this replica tries it last (it failed here)."""

    def cool_down(self, upstream: str, seconds: float) -> None:
        self.cooldown_until[upstream] = time.monotonic() + seconds

    @staticmethod
    def check_fits(group: Group, need: Need) -> None:
        """Refuse, before it touches any shared state, a request larger than every upstream's
        limit at the ratio this replica last saw."""
        if all(need.cost(u) > u.config.tpm for u in group.upstreams):
            raise too_large(group.model, min(need.cost(u) for u in group.upstreams))

    async def admit(
        self, group: Group, need: Need, attempts: Attempts, deadline: float, job: str, priority: str
    ) -> Grant:
        """A grant from the job's share and an upstream's budget, waiting in the queue for it."""
        candidates = [u for u in group.upstreams if u.name not in attempts.failed and need.cost(u) <= u.config.tpm]
        if not candidates:
            raise exhausted(group, attempts, priority)
        terms = await self.weights.terms(job)
        bills = bills_of(job, terms)
        usd, tokens = max(dearest_usd(u, need) for u in candidates), max(need.cost(u) for u in candidates)

        async def fresh() -> list[Bill]:
            return bills_of(job, await self.weights.terms(job, fresh=True))

        ttl_s = hold_ttl_s(candidates, deadline)
        held = await hold_caps(group.spend, job, bills, usd, tokens, deadline, ttl_s, fresh)
        try_admit = self.reservation(group, candidates, need, job, terms.weight, attempts.failed)
        try:
            grant, waited_s = await group.admitter.admit(
                job, priority, min(need.cost(u) for u in candidates), deadline - time.monotonic(), try_admit
            )
        except QueueTimeout as timeout:
            await group.spend.release(held)
            metrics.REJECTED.labels(priority).inc()
            raise ProxyError(
                429,
                f"no budget for model {group.model!r} within the queue deadline",
                "rate_limited",
                retry_after_s=timeout.retry_after_s,
            ) from None
        except BaseException:
            await group.spend.release(held)
            raise
        attempts.queue_s += waited_s
        grant.held, grant.bills = held, [b.key for b in bills]
        return grant

    def reservation(
        self, group: Group, candidates: list[Upstream], need: Need, job: str, weight: float, failed: dict[str, str]
    ) -> Callable[[], Awaitable[Tried[Grant]]]:
        """One request's reservation attempt: its cost from the job's share first (a refusal
        there lets other jobs go first), then from an upstream's budget; the share is
        refunded at once when no upstream has room."""
        share_tokens = max(need.cost(u) for u in candidates)
        held_back = False

        async def try_admit() -> Tried[Grant]:
            nonlocal held_back
            held = await group.share.reserve(job, weight, share_tokens)
            metrics.JOB_SHARE.labels(group.model, job).set(held.share)
            if not held.admitted:
                if not held_back:
                    metrics.SHARE_WAITS.labels(group.model, job).inc()
                    held_back = True
                return Tried(None, held.wait_s, by_share=True)
            reserved: Reserved | float = math.inf
            try:
                reserved = await self.reserve_upstream(candidates, need, failed)
            finally:
                if not isinstance(reserved, Reserved):
                    await group.share.refund(job, share_tokens)
            if not isinstance(reserved, Reserved):
                return Tried(None, reserved)
            return Tried(Grant(reserved.upstream, reserved.lease, job, share_tokens, reserved.probe), 0.0)

        return try_admit

    async def reserve_upstream(
        self, candidates: list[Upstream], need: Need, failed: dict[str, str]
    ) -> Reserved | float:
        """A lease from the first upstream, in order of preference, whose circuit lets a
        call go and with room for `need` (and whether the call is the circuit's probe); else
        the seconds until the soonest could have room or probe. A request that
        no upstream could ever admit at the ratio learned by now (`check_fits` read an older
        one), or whose every upstream left is open, is refused alone, so it does not hold
        the queue's head until its deadline."""
        wait_s, costs, down = math.inf, [], []
        for upstream in self.preference(candidates):
            gate = await upstream.circuit.gate()
            if gate.verdict == "wait":
                down.append(gate)
                continue
            admission = await upstream.budget.reserve(need.fixed_tokens, need.prompt_estimates[upstream.name])
            if admission.lease is not None:
                return Reserved(upstream, admission.lease, gate.verdict == "probe")
            if gate.verdict == "probe":
                await upstream.circuit.release_probe()
            wait_s = min(wait_s, admission.wait_s)
            costs.append(admission.cost)
        model = candidates[0].config.model
        outage = outage_of(model, [g.health for g in down]) if len(down) == len(candidates) else None
        if outage is not None:
            raise unavailable(outage, down, failed)
        if not down and math.isinf(wait_s):
            raise too_large(model, min(costs))
        return min([wait_s, *(g.health.next_probe_s(g.now) for g in down)])

    def preference(self, candidates: list[Upstream]) -> list[Upstream]:
        """By weight, upstreams that failed here recently last."""
        now = time.monotonic()
        ordered = weighted_order(candidates, self.rng)
        return sorted(ordered, key=lambda u: self.cooldown_until.get(u.name, 0.0) > now)


def exhausted(group: Group, attempts: Attempts, priority: str) -> ProxyError:
    """The error once no attempt is left: the last upstream's 429, or every failure."""
    if attempts.rate_limited_last:
        metrics.REJECTED.labels(priority).inc()
        return ProxyError(
            429,
            f"upstreams of {group.model!r} kept answering 429",
            "rate_limited",
            retry_after_s=max(1, math.ceil(attempts.last_pause_s)),
        )
    reasons = "; ".join(f"{name}: {why}" for name, why in attempts.failed.items())
    return ProxyError(502, f"upstreams of {group.model!r} failed ({reasons})", "upstream_error")


def unavailable(outage: Outage, down: list[Gate], failed: dict[str, str]) -> ProxyError:
    """503 when every upstream left to try has its circuit open (`outage`, the gates of
    `down`): each named with its reason and since when (and what failed for this request
    before), `retry-after` the next probe."""
    message = outage.reason
    if failed:
        failures = "; ".join(f"{name}: {why}" for name, why in failed.items())
        downs = "; ".join(g.health.describe() for g in down)
        message = f"upstreams of model {outage.model!r} failed ({failures}) or are down: {downs}"
    retry_after_s = max(1, math.ceil(min(g.health.next_probe_s(g.now) for g in down)))
    return ProxyError(503, message, "upstream_unavailable", retry_after_s=retry_after_s)
