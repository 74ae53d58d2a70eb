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

The sums live in Redis, in the job's `spend` hash (`usd:<role>`, `tokens:<role>`,
`cached:<role>`, `calls:<role>`), shared by every proxy replica: what the learner records per
step, the API shows as the job's cost, and a job's cap is held against.

Caps (`budget` in the job's spec): before a call goes upstream it holds its dearest cost
(every token it may reserve at the dearer price) in the same hash (`held_usd`, `held_tokens`),
in one script that refuses when the bill so far, what calls in flight hold and this call's
hold would pass a cap. The hold goes back when the call settles, its true cost charged. So
no call is made that could take the bill past the cap, whatever replica makes it. A call
refused while others hold the room waits for them to settle (429 after the queue
deadline); one that the bill alone leaves no room for is 402 `spend_cap_reached`, counted
in the hash (`refused`) for the learner to end the job on.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from services.config import BudgetSpec
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
class Held:
    """What one call in flight holds of its job's caps."""

    usd: float
    tokens: int


@dataclass(frozen=True)
class Refusal:
    """Why a call may not hold what it needs: `wait` (calls in flight hold the room; it
    comes back as they settle) or not (the bill so far leaves none), and the bill so far."""

    wait: bool
    spent_usd: float
    spent_tokens: int


# KEYS[1]: the job's spend hash. ARGV: the usd cap and the token cap (-1: none), what this
# call would hold (usd, tokens). Returns {1} and holds it; {0, usd, tokens} when calls in
# flight hold the room; {-1, usd, tokens} when the bill alone leaves none (counted in
# `refused`). The bill is returned as strings (Lua numbers become integers on the way out).
HOLD_LUA = """
local fields = redis.call('HGETALL', KEYS[1])
local usd, tokens, held_usd, held_tokens = 0, 0, 0, 0
for i = 1, #fields, 2 do
  local name, value = fields[i], tonumber(fields[i + 1])
  if string.sub(name, 1, 4) == 'usd:' then usd = usd + value
  elseif string.sub(name, 1, 7) == 'tokens:' then tokens = tokens + value
  elseif name == 'held_usd' then held_usd = value
  elseif name == 'held_tokens' then held_tokens = value end
end
local usd_cap, tokens_cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local need_usd, need_tokens = tonumber(ARGV[3]), tonumber(ARGV[4])
local function passes(held_usd, held_tokens)
  return (usd_cap >= 0 and usd + held_usd + need_usd > usd_cap)
      or (tokens_cap >= 0 and tokens + held_tokens + need_tokens > tokens_cap)
end
if passes(0, 0) then
  redis.call('HINCRBY', KEYS[1], 'refused', 1)
  return {-1, tostring(usd), tostring(tokens)}
end
if passes(held_usd, held_tokens) then return {0, tostring(usd), tostring(tokens)} end
redis.call('HINCRBYFLOAT', KEYS[1], 'held_usd', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'held_tokens', ARGV[4])
return {1}
"""


class JobSpend:
    """Charges calls to their jobs' `spend` hashes, and holds calls in flight against caps."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._hold = redis.register_script(HOLD_LUA)

    async def hold(self, job: str, budget: BudgetSpec, usd: float, tokens: int) -> Held | Refusal:
        """Hold a call's dearest cost (`usd`, `tokens`) against the job's caps, or say why
        it may not (the call must not be made now, or, with the bill as it is, ever)."""
        caps = [-1 if budget.usd is None else budget.usd, -1 if budget.tokens is None else budget.tokens]
        verdict = await self._hold(keys=[Keys.job_spend(job)], args=[*caps, usd, tokens])
        if verdict[0] == 1:
            return Held(usd, tokens)
        return Refusal(wait=verdict[0] == 0, spent_usd=float(verdict[1]), spent_tokens=int(float(verdict[2])))

    async def release(self, job: str, held: Held | None) -> None:
        """Give back what a settled call held (its true cost is charged by `charge`)."""
        if held is None:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrbyfloat(Keys.job_spend(job), "held_usd", -held.usd)
            pipe.hincrby(Keys.job_spend(job), "held_tokens", -held.tokens)
            await pipe.execute()

    async def charge(self, job: str, role: str, cost: CallCost) -> None:
        JOB_COST.labels(job, role).inc(cost.usd)
        JOB_CACHED.labels(job).inc(cost.cached)
        if not job:  # a call no job made (an operator's): in the metrics only
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            key = Keys.job_spend(job)
            pipe.hincrbyfloat(key, f"usd:{role}", cost.usd)
            pipe.hincrby(key, f"tokens:{role}", cost.tokens)
            pipe.hincrby(key, f"cached:{role}", cost.cached)
            pipe.hincrby(key, f"calls:{role}", 1)
            pipe.expire(key, SPEND_TTL_S)  # a late call after the job's keys were deleted leaves no key for good
            await pipe.execute()


def role_of(header: str, priority: str) -> str:
    """The role a request is charged as: its `X-Tandem-Role`, else its priority. ValueError
    naming the roles for any other value."""
    role = (header or priority).lower()
    if role not in ROLES:
        raise ValueError(f"X-Tandem-Role must be one of {list(ROLES)}, not {header!r}")
    return role
