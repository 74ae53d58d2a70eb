"""Weighted fair share of a model group's budget across jobs, shared by all replicas.

Jobs that use one model group get its budget by weight, the job's `judge_weight` (`w_j`; 1
for a job id with no record). The group's upstreams together refill `R` tokens a second
(their `tpm / 60`) and admit at most `C` at once (`burst_tokens`: a bucket's `tpm`, a paced
window's `pace_s` seconds' worth). A job is *active* while it has asked for budget within
the last `active_s` seconds; `W` is the sum of the active jobs' weights. Each active job has
a token bucket of capacity `C * w_j / W` refilled at `R * w_j / W`, and a request of job `j`
needs its cost from `j`'s bucket as well as from an upstream's budget (`budget.py`):

- *Shares*: a job that asks for more than its share is held to its bucket's refill, so
  under a saturated budget each job gets `w_j / W` of the tokens the upstreams charge.
- *Work-conserving*: a job that stops asking leaves `W` after `active_s`, and the others'
  buckets grow at once. A job that asks for less than its share fills its bucket; while a
  bucket is above half its capacity, other jobs may borrow its tokens above that half (in
  proportion to what each lender has above half). A lender keeps half its bucket for its
  own next burst, so no job's burst starves another.
- *Large requests*: a request larger than the job's bucket is admitted when the bucket is
  full (with what can be borrowed) and leaves the bucket in debt, repaid by its refill; it
  waits for a full bucket, never forever.
- *Refunds*: a reservation holds the request's cost at its maximum (every completion at
  `max_tokens`), the upstream charges its `usage`; `refund` gives the difference back to
  the job's bucket (or takes more), as the upstream's budget does, so the share charges
  what the upstream charges and never binds before the provider. A reservation whose
  upstream reservation fails is refunded whole at once.

Buckets are stored as their fill (level over capacity, at most 1), so a change of `W`
changes no fill and every fill grows at the same `R / C` a second. The group's own level
(`g`: capacity `C`, refilled at `R`, charged and refunded like the jobs) mirrors what the
upstreams have left; a job that (re)joins starts at the group's fill, so the jobs' buckets
hold together about what the upstreams hold: when the upstreams are empty, so are the
buckets, and the shares, not the race between replicas for the upstreams' refill, decide
who goes next. A refund goes to the bucket of the job that reserved, borrowed tokens
included (capped at full).

Every replica runs the same scripts on one Redis with the server's clock (`TIME`), so
replicas agree on refills and expiries. State per model group: hash
`tandem:judge:share:{model}` (`ts`, `g`, and per active job `f:{job}` fill and `w:{job}`
weight) and zset `...:asked` (job -> when it last asked).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from judge_proxy.scripts import lua
from judge_proxy.upstream import UpstreamConfig
from services.jobs import JudgeTerms, judge_terms
from services.queues import Keys

ACTIVE_S = 5.0
"""A job that has not asked for budget for this long no longer counts in `W`."""
WEIGHT_TTL_S = 10.0
"""How long a replica keeps a job's weight before reading its record again."""
LENDER_KEEPS = 0.5
"""A bucket lends only what it holds above this share of its capacity."""

_RESERVE = lua("now", "share", "share_reserve")
_REFUND = lua("now", "share", "share_refund")
"""A job's take from the shared bucket and what goes back (`judge_proxy/lua/share*.lua`)."""


def burst_tokens(config: UpstreamConfig) -> float:
    """The most an upstream's budget admits at once: a bucket's `tpm`; a paced window's
    `pace_s` seconds' worth (an unpaced window admits its whole `tpm`)."""
    if config.limit_model == "window" and config.pace_s > 0:
        return config.tpm * config.pace_s / 60
    return float(config.tpm)


@dataclass(frozen=True)
class Held:
    """The outcome of asking a job's share for tokens."""

    admitted: bool
    wait_s: float
    """0 when admitted; else seconds until the job's refill (and what its lenders refill
    above half) covers it, if no one else takes any."""
    share: float
    """`w_j / W`: the job's target share of the group now."""
    tokens: float
    """Left in the job's bucket (after the reservation, when admitted)."""
    borrowed: float = 0.0
    """Taken from other jobs' buckets (their part above half)."""


class Share:
    """One model group's shares, as seen by one replica (all replicas share the Redis state)."""

    def __init__(self, client: aioredis.Redis, model: str, active_s: float = ACTIVE_S) -> None:
        state = Keys.judge_share(model)
        self.keys = [state, state + ":asked"]
        self.capacity_tokens = 0.0
        self.tokens_per_s = 0.0
        self.active_s = active_s
        self._reserve = client.register_script(_RESERVE)
        self._refund = client.register_script(_REFUND)

    def add_upstream(self, config: UpstreamConfig) -> None:
        """The group's capacity and refill are its upstreams' together."""
        self.capacity_tokens += burst_tokens(config)
        self.tokens_per_s += config.tpm / 60

    @property
    def _limits(self) -> list[float]:
        return [self.capacity_tokens, self.tokens_per_s, self.active_s]

    async def reserve(self, job: str, weight: float, tokens: int) -> Held:
        """Take `tokens` from `job`'s bucket (borrowing what other buckets hold above half),
        or take nothing and say how long its own refill needs; either way `job` counts as
        active, with `weight`, from now."""
        admitted, wait, share, left, borrowed = await self._reserve(
            self.keys, [*self._limits, job, weight, tokens, LENDER_KEEPS]
        )
        return Held(bool(admitted), float(wait), float(share), float(left), float(borrowed))

    async def refund(self, job: str, tokens: float) -> float:
        """Give `tokens` back to `job`'s bucket (negative: charge more); returns its level."""
        return float(await self._refund(self.keys, [*self._limits, job, tokens]))


class Weights:
    """Each job's terms (`judge_weight`, `budget`, tenant and the cap on its month), read
    from its record at most every `ttl_s` per replica."""

    def __init__(self, client: aioredis.Redis, ttl_s: float = WEIGHT_TTL_S) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.read: dict[str, tuple[JudgeTerms, float]] = {}
        """Job -> (its terms, `time.monotonic()` when read)."""

    async def terms(self, job: str, fresh: bool = False) -> JudgeTerms:
        """The job's terms, as read at most `ttl_s` ago (`fresh`: read now)."""
        cached = self.read.get(job)
        if not fresh and cached is not None and time.monotonic() - cached[1] < self.ttl_s:
            return cached[0]
        terms = await judge_terms(self.client, job)
        self.read[job] = (terms, time.monotonic())
        return terms
