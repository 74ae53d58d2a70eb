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

COST = Gauge("tandem_job_cost_usd", "What the job's LLM calls have cost so far (USD)", ["job"])
PROJECTED = Gauge("tandem_job_cost_projected_usd", "Cost so far plus this run's mean step cost x steps left", ["job"])


class CostMeter:
    def __init__(self, redis: aioredis.Redis, job_id: str) -> None:
        self.redis, self.job_id = redis, job_id
        self.last_usd = 0.0
        self.start: tuple[int, float] | None = None
        """(step, cost so far) when this run's steps began: the mean step cost is over them."""

    async def begin(self, step: int) -> None:
        """This run trains from `step` (0, or the step it resumed from)."""
        usd = (await jobs.job_spend(self.redis, self.job_id))["usd"]
        self.last_usd, self.start = usd, (step, usd)

    async def after_step(self, step: int, groups: list[protocol.TrajectoryGroup], total_steps: int) -> dict[str, float]:
        """The cost fields of the record of step `step` (of `total_steps`), made of `groups`."""
        samples = sum(len(g.samples) for g in groups)
        spend = await jobs.job_spend(self.redis, self.job_id)
        usd = spend["usd"]
        first_step, first_usd = self.start or (0, 0.0)
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
