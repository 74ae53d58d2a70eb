"""What each call costs its job, in tokens and money, by role.

Every call the proxy settles is charged to its job (`X-Tandem-Job`) and role
(`X-Tandem-Role`: the user `simulator`, the `judge`, an `extraction` of R_ext by an LLM, or
`eval`, every call of a held-out conversation; default: the call's priority). Money is the
upstream's `prices` (USD per million tokens) times what its reply's `usage` reports:

    usd = ((prompt - cached) * input + cached * cached_input + completion * output) / 1e6

where `cached` is `usage.prompt_tokens_details.cached_tokens` (the prompt tokens the
provider served from its cache and bills at `cached_input`, by default the input price).
A reply whose usage is missing or does not add up (more tokens than the budget billed,
which is never more than the call reserved) is charged the billed tokens at the dearer of
the input and output prices: a conservative bill for what cannot be believed. An upstream without
prices costs tokens only.

The sums live in Redis, shared by every proxy replica, in two bills: the job's `spend` hash
(`usd:<role>`, `tokens:<role>`, `cached:<role>`, `calls:<role>`), what the learner records
per step and the API shows as the job's cost, and the same sums for its tenant's calendar
month (`services.bills`), what the API shows the tenant.

Caps: the job's `budget`, and the operator's cap on every tenant's month. Before a call
goes upstream it holds its dearest cost (every token it may reserve at the dearer price) in
both bills (`held_usd`, `held_tokens`), in one script that refuses when, in either, the bill
so far, what calls in flight hold and this call's hold would pass a cap. The hold goes back
when the call settles, its true cost charged. So no call is made that could take a bill past
its cap, whatever replica makes it. A call refused while others hold the room waits for them
to settle (429 after the queue deadline); one that a bill alone leaves no room for, even
with the caps read afresh (a resume may have raised one), is 402 `spend_cap_reached`,
marked in the job's hash (`refused`, and `refused_by`: which cap) for the learner to end the
job on. Holds expire: a proxy killed with calls in flight leaves none behind for long.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from judge_proxy.errors import ProxyError
from judge_proxy.scripts import lua
from services import bills
from services.config import BudgetSpec
from services.jobs import JudgeTerms
from services.queues import Keys

ROLES = ("simulator", "judge", "extraction", "eval")
ROLE: ContextVar[str] = ContextVar("tandem_proxy_role", default="")
"""The role the request being served is charged as (set by its route, read when its attempts begin)."""

SPEND_TTL_S = 400 * 86400
"""A spend hash outlives any job's retention; only a call charged after its job's keys were
deleted leaves one behind, and this is how long."""
JOB_COST = Counter("tandem_judge_job_cost_usd_total", "USD charged to each job, by role", ["job", "role"])
JOB_CACHED = Counter("tandem_judge_job_cached_tokens_total", "Prompt tokens served from the provider's cache", ["job"])


class Prices(BaseModel):
    """An upstream's prices, USD per million tokens."""

    model_config = ConfigDict(extra="forbid")

    input_per_mtok: float = Field(ge=0, description="USD per million prompt tokens.")
    output_per_mtok: float = Field(ge=0, description="USD per million completion tokens.")
    cached_input_per_mtok: float | None = Field(
        None,
        ge=0,
        description="USD per million prompt tokens served from the provider's cache; the input price when unset.",
    )


@dataclass(frozen=True)
class CallCost:
    tokens: int
    """Prompt and completion tokens, as billed."""
    cached: int
    """Of the prompt, the tokens billed at the cached price."""
    usd: float


def call_cost(prices: Prices | None, usage: dict[str, int], billed: int) -> CallCost:
    """What one call cost by its reply's `usage` (`prompt_tokens`, `completion_tokens`,
    `cached_tokens`). Usage that cannot be read, or does not add up to at most the `billed`
    tokens (what the budget charged, never more than the call reserved), is not believed:
    the call costs `billed` tokens at the dearer price."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if prompt is None or completion is None or prompt < 0 or completion < 0 or prompt + completion > billed:
        rate = max(prices.input_per_mtok, prices.output_per_mtok) if prices else 0.0
        return CallCost(billed, 0, billed * rate / 1e6)
    cached = min(max(usage.get("cached_tokens", 0), 0), prompt)
    if prices is None:
        return CallCost(prompt + completion, cached, 0.0)
    cached_rate = prices.input_per_mtok if prices.cached_input_per_mtok is None else prices.cached_input_per_mtok
    usd = ((prompt - cached) * prices.input_per_mtok + cached * cached_rate + completion * prices.output_per_mtok) / 1e6
    return CallCost(prompt + completion, cached, usd)


@dataclass(frozen=True)
class Bill:
    """A spend hash a call is charged to, and the caps held against it there."""

    key: str
    cap: BudgetSpec
    label: str
    """What the cap is called when it refuses (`the job's spend cap (usd 0.5)`), for the job's record."""


@dataclass(frozen=True)
class Held:
    """What one call in flight holds of its bills' caps: `usd` and `tokens` in each hash of
    `keys`, under `member` in each one's holds (`Keys.cap_holds`) until it settles or expires."""

    usd: float
    tokens: int
    keys: tuple[str, ...]
    member: str


@dataclass(frozen=True)
class Refusal:
    """Why a call may not hold what it needs: `wait` (calls in flight hold the room; it
    comes back as they settle) or not (the bill so far leaves none), which bill refused,
    and that bill so far."""

    wait: bool
    bill: Bill
    spent_usd: float
    spent_tokens: int


HOLD_LUA = lua("now", "spend_holds", "spend_hold")
RELEASE_LUA = lua("spend_release")
RENEW_LUA = lua("now", "spend_renew")
"""A call's hold against its bills' caps, given back, and renewed (`judge_proxy/lua/spend_*.lua`,
each saying its keys and arguments; `spend_holds.lua`: how holds are kept and expire)."""


class JobSpend:
    """Charges calls to their bills (their job's and their tenant's spend hashes), and holds
    calls in flight against the caps there."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._hold = redis.register_script(HOLD_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._renew = redis.register_script(RENEW_LUA)

    async def hold(self, bills: list[Bill], usd: float, tokens: int, ttl_s: float) -> Held | Refusal:
        """Hold a call's dearest cost (`usd`, `tokens`) against its bills' caps for at most
        `ttl_s` unless renewed, or say why it may not (the call must not be made now, or,
        with a bill as it is, ever)."""
        member = f"{uuid.uuid4().hex}:{usd!r}:{tokens}"
        args: list = [usd, tokens, member, ttl_s]
        for bill in bills:
            args += [_cap(bill.cap.usd), _cap(bill.cap.tokens)]
        verdict = await self._hold(keys=[k for b in bills for k in (b.key, Keys.cap_holds(b.key))], args=args)
        if verdict[0] == 1:
            return Held(usd, tokens, tuple(b.key for b in bills), member)
        bill = bills[int(verdict[1]) - 1]
        return Refusal(verdict[0] == 0, bill, spent_usd=float(verdict[2]), spent_tokens=int(float(verdict[3])))

    async def release(self, held: Held | None) -> None:
        """Give back what a settled call held (its true cost is charged by `charge`)."""
        if held is None:
            return
        keys = [k for key in held.keys for k in (key, Keys.cap_holds(key))]
        await self._release(keys=keys, args=[held.member, held.usd, held.tokens])

    async def refused(self, job: str, bill: Bill) -> None:
        """Mark the job refused by `bill`'s cap (`refused`, `refused_by`: its label), for the
        learner to end it on."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(Keys.job_spend(job), "refused", 1)
            pipe.hset(Keys.job_spend(job), "refused_by", bill.label)
            await pipe.execute()

    async def renew(self, held: Held | None, ttl_s: float) -> None:
        """Keep a call's hold another `ttl_s` (a stream that is still arriving)."""
        if held is not None:
            await self._renew(keys=[Keys.cap_holds(key) for key in held.keys], args=[held.member, ttl_s])

    async def charge(self, job: str, keys: list[str], role: str, cost: CallCost) -> None:
        """Charge a call of `job` (in the metrics) to the spend hashes `keys` (its bills')."""
        JOB_COST.labels(job, role).inc(cost.usd)
        JOB_CACHED.labels(job).inc(cost.cached)
        if not keys:  # a call no job made (an operator's): in the metrics only
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            for key in keys:
                pipe.hincrbyfloat(key, f"usd:{role}", cost.usd)
                pipe.hincrby(key, f"tokens:{role}", cost.tokens)
                pipe.hincrby(key, f"cached:{role}", cost.cached)
                pipe.hincrby(key, f"calls:{role}", 1)
                pipe.expire(key, SPEND_TTL_S)  # a late call after the job's keys were deleted leaves no key for good
            await pipe.execute()


def _cap(value: float | int | None) -> float | int:
    return -1 if value is None else value


CAP_WAIT_S = 0.1
"""How often a call waiting for calls in flight to give back cap holds looks again."""


def bills_of(job: str, terms: JudgeTerms, now: float | None = None) -> list[Bill]:
    """The spend hashes a call of `job` is charged to: its job's and, when the job has a
    record, its tenant's this month (`services.bills`); none for a call no job made."""
    if not job:
        return []
    found = [Bill(Keys.job_spend(job), terms.budget, bills.job_cap_label(terms.budget))]
    if terms.tenant is not None:
        month = bills.period(now)
        label = bills.tenant_cap_label(terms.tenant, month, terms.tenant_cap)
        found.append(Bill(Keys.tenant_spend(terms.tenant, month), terms.tenant_cap, label))
    return found


async def hold_caps(
    spend: JobSpend,
    job: str,
    owed: list[Bill],
    usd: float,
    tokens: int,
    deadline: float,
    ttl_s: float,
    fresh: Callable[[], Awaitable[list[Bill]]],
) -> Held | None:
    """Hold a call's dearest cost (`usd`, `tokens`) against the caps of the bills it is
    `owed` to, until it settles or `ttl_s` passes without a renewal (a proxy killed with calls
    in flight leaves no hold behind for longer). While calls in flight hold what it needs it
    waits for them, until `deadline` (`time.monotonic()`; then 429); when even a bill so far
    leaves no room, the caps are read afresh (`fresh`: a cap raised since they were read,
    by a resume, counts) and, if one still refuses, 402 `spend_cap_reached` naming it,
    marked on the job's bill (`JobSpend.refused`). None: no bill has a cap."""
    read_afresh = False
    while True:
        if not any(b.cap.limits for b in owed):
            return None
        held = await spend.hold(owed, usd, tokens, ttl_s)
        if not isinstance(held, Refusal):
            return held
        if not held.wait and not read_afresh:
            owed, read_afresh = await fresh(), True
            continue
        if not held.wait:
            await spend.refused(job, held.bill)
            raise ProxyError(
                402,
                f"job {job!r} reached {held.bill.label}: ${held.spent_usd:.4f} and {held.spent_tokens} tokens "
                f"spent, and this call could cost ${usd:.4f}, {tokens} tokens",
                "spend_cap_reached",
            )
        if time.monotonic() > deadline:
            why = f"job {job!r}: calls in flight hold what is left of {held.bill.label}"
            raise ProxyError(429, why, "rate_limited", retry_after_s=1)
        await asyncio.sleep(CAP_WAIT_S)


def role_of(header: str, priority: str) -> str:
    """The role a request is charged as: its `X-Tandem-Role`, else its priority. ValueError
    naming the roles for any other value."""
    role = (header or priority).lower()
    if role not in ROLES:
        raise ValueError(f"X-Tandem-Role must be one of {list(ROLES)}, not {header!r}")
    return role
