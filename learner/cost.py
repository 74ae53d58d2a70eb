"""What a job has cost, step by step, and what it will cost at this rate.

The judge proxy charges every LLM call to its job and role (`judge_proxy.spend`); after
each step the learner reads the job's sums (`services.jobs.job_spend`) and records:
`cost_usd` (so far, every call: training, held-out rounds, calls whose tasks failed),
`cost_usd_<role>`, `cost_usd_step` (since the last record), `cost_usd_per_sample` (that,
over the samples the step trained), `cost_tokens`, and `cost_usd_projected`: so far, plus
the mean cost of this run's steps times the steps left. A step's own cost is read after it,
so calls of the groups still in flight count in the step that reads them.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from prometheus_client import Gauge

from services import jobs, protocol
from services.config import BudgetSpec, TrainSpec
from services.queues import Keys
from services.redis_values import text

COST = Gauge("tandem_job_cost_usd", "What the job's LLM calls have cost so far (USD)", ["job"])
PROJECTED = Gauge("tandem_job_cost_projected_usd", "Cost so far plus this run's mean step cost x steps left", ["job"])


def planned_steps(step: int, per_step: float, spent: float, cap: float, admitted_steps: int, num_steps: int) -> int:
    """How many steps a job can train within `cap`, at step `step` having spent `spent` at
    `per_step` a step: the steps the money left pays for at that rate, but never fewer than
    its tasks already admitted fill (`admitted_steps`: their calls are paid for in part, and
    are trained, not thrown away) nor more than `num_steps`."""
    affordable = step + int((cap - spent) // per_step) if per_step > 0 else num_steps
    return max(admitted_steps, min(affordable, num_steps))


class SpendCapReached(Exception):
    """The judge proxy refused a call of the job: its spend cap binds now."""


class CostMeter:
    def __init__(self, redis: aioredis.Redis, job_id: str) -> None:
        self.redis, self.job_id = redis, job_id
        self.last_usd = 0.0
        self.start: tuple[int, float, int] | None = None
        """(step, cost so far, tokens so far) when this run's steps began: the mean step cost is over them."""
        self.spend: dict = {}
        """The job's bill as the last step read it (`services.jobs.job_spend`)."""
        self.binding = ""
        """Why the plan is short of the job's steps (`planned`), if it is."""

    async def begin(self, step: int) -> None:
        """This run trains from `step` (0, or the step it resumed from)."""
        self.spend = await jobs.job_spend(self.redis, self.job_id)
        self.last_usd, self.start = self.spend["usd"], (step, self.spend["usd"], self.spend["tokens"])

    def planned(
        self, step: int, caps: list[tuple[str, BudgetSpec, dict]], admitted_tasks: int, train: TrainSpec
    ) -> int:
        """The steps the job can train within its `caps` (each named, with the bill it
        holds: the job's own, its tenant's month) at this run's mean step cost
        (`planned_steps`), having admitted `admitted_tasks` tasks. A tenant's other jobs spend
        its month too, so there the plan is the most this job can reach, and the proxy's
        refusal the stop. The cap that binds is kept (`binding`) for the job's record."""
        first_step, first_usd, first_tokens = self.start or (0, 0.0, 0)
        steps = max(step - first_step, 1)
        per_step = {"usd": (self.spend["usd"] - first_usd) / steps}
        per_step["tokens"] = (self.spend["tokens"] - first_tokens) / steps
        admitted, plan = -(-admitted_tasks // train.batch_size), train.num_steps
        for label, cap, bill in caps:
            for kind, limit in cap.limits.items():
                steps_within = planned_steps(step, per_step[kind], bill[kind], limit, admitted, train.num_steps)
                if steps_within < plan:
                    plan, self.binding = steps_within, f"{label} leaves no room for more steps"
        return plan

    async def check_refused(self) -> None:
        """`SpendCapReached` once the proxy has refused a call of the job for a cap (its
        own, or its tenant's month's)."""
        if int(await self.redis.hget(Keys.job_spend(self.job_id), "refused") or 0):
            raise SpendCapReached()

    async def reason(self, step: int, num_steps: int) -> str:
        """Why a job ended before `num_steps`, for its record: the cap that refused its call,
        or else the one its plan stopped at."""
        self.spend = await jobs.job_spend(self.redis, self.job_id)
        refused_by = await self.redis.hget(Keys.job_spend(self.job_id), "refused_by")
        why = f"{text(refused_by)} refused a call" if refused_by else self.binding or "a spend cap refused a call"
        return (
            f"{jobs.CAP_REACHED} at step {step} of {num_steps}: ${self.spend.get('usd', 0.0):.4f} and "
            f"{self.spend.get('tokens', 0)} tokens spent; {why}"
        )

    async def after_step(self, step: int, groups: list[protocol.TrajectoryGroup], total_steps: int) -> dict[str, float]:
        """The cost fields of the record of step `step` (of `total_steps`), made of `groups`."""
        samples = sum(len(g.samples) for g in groups)
        spend = self.spend = await jobs.job_spend(self.redis, self.job_id)
        usd = spend["usd"]
        first_step, first_usd, _ = self.start or (0, 0.0, 0)
        per_step = (usd - first_usd) / max(step - first_step, 1)
        record = {
            "cost_usd": usd,
            "cost_usd_step": usd - self.last_usd,
            "cost_usd_per_sample": (usd - self.last_usd) / max(samples, 1),
            "cost_tokens": float(spend["tokens"]),
            "cost_usd_projected": usd + per_step * max(total_steps - step, 0),
        } | {f"cost_usd_{role}": part["usd"] for role, part in sorted(spend["by_role"].items())}
        self.last_usd = usd
        COST.labels(self.job_id).set(usd)
        PROJECTED.labels(self.job_id).set(record["cost_usd_projected"])
        return record
