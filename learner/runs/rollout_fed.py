"""The parts of a run fed by rollout servers (RL and generate jobs): the dispatcher that
admits tasks, the trajectory stream, the weight publisher that keeps the servers'
membership and versions, the watchdog that keeps the job from waiting in silence, the
held-out evaluation the servers also play (an RL job's, when it has `eval`), and the meter
of what the job's LLM calls cost."""

from __future__ import annotations

import logging
import time

from learner.cost import CostMeter
from learner.dispatcher import Dispatcher
from learner.evaluation import HeldOutEvaluation
from learner.intake import BatchIntake
from learner.publisher import WeightPublisher
from learner.runs.base import Learner, Run
from learner.watchdog import Watchdog
from services import bills, jobs, protocol
from services.config import JobSpec
from services.queues import Keys, StreamConsumer

log = logging.getLogger(__name__)
GAUGES_EVERY_S = 5.0
"""How often the queue gauges are brought up to date while the learner waits (a step does it too)."""


class RolloutFedRun(Run):
    dispatcher_class: type[Dispatcher] = Dispatcher
    intake: BatchIntake
    """The trajectory stream's groups into batches: built as the run starts, on the stream."""

    def __init__(self, learner: Learner, job_id: str, spec: JobSpec) -> None:
        super().__init__(learner, job_id, spec)
        self.dispatcher = self.dispatcher_class(self.redis, job_id, spec)
        self.publisher = WeightPublisher(self.redis, job_id, self.settings, self.worker)
        self.cost = CostMeter(self.redis, job_id)
        self.gauges_at = 0.0
        self.evaluation = HeldOutEvaluation(self.redis, job_id, spec, self.steps)
        self.watchdog = Watchdog(
            self.redis, job_id, spec, self.settings, self.publisher, self.dispatcher, self.progress_marker
        )

    def progress_marker(self) -> tuple[int, int, int]:
        """(steps trained, groups admitted, held-out results read): what moves when the job
        progresses (asked only while the run waits, once its intake exists)."""
        return self.step, self.intake.admitted, self.evaluation.received

    async def trajectories(self) -> StreamConsumer:
        """The job's trajectory stream, read by the learner's consumer group."""
        return await StreamConsumer(
            self.redis,
            Keys.trajectories(self.job_id),
            "learner",
            "learner",
            protocol.TrajectoryGroup,
            Keys.dead(self.job_id),
        ).setup()

    def counts(self) -> dict[str, int]:
        return self.intake.counts | self.publisher.counts

    async def waiting_for_groups(self) -> None:
        """While a batch waits: what `while_waiting` does, and `SpendCapReached` once the
        proxy has refused a call of the job for its spend cap (its groups will not come)."""
        await self.while_waiting()
        await self.cost.check_refused()

    async def plan_within_budget(self, step: int) -> None:
        """After a step: the steps its spend caps leave the job (its own `budget`, and its
        tenant's month; the dispatcher admits no task beyond them), and `SpendCapReached`
        once the proxy refuses its calls for a cap."""
        terms = await jobs.judge_terms(self.redis, self.job_id)
        month = await bills.month(self.redis, terms.tenant or "", terms.tenant_cap)
        caps = [(bills.job_cap_label(terms.budget), terms.budget, self.cost.spend), (month.label, month.cap, month.spent)]
        planned = self.cost.planned(step, caps, self.dispatcher.outstanding, self.spec.train)
        if planned != self.dispatcher.total_steps:
            log.info("job %s: its spend caps leave %d steps of %d", self.job_id, planned, self.spec.train.num_steps)
        self.dispatcher.total_steps = planned
        await self.cost.check_refused()

    async def while_waiting(self) -> None:
        """A read for groups found none: honour a cancel or stop, follow the membership, and
        let the watchdog pause, resume or fail the job."""
        await self.check_cancel()
        await self.check_stop()
        await self.publisher.follow_membership(self.version)
        await self.watchdog.check()
        if time.monotonic() - self.gauges_at > GAUGES_EVERY_S:  # dashboards move while no step does
            self.gauges_at = time.monotonic()
            await self.steps.export_queue_gauges()
        await self.evaluation.collect()  # nothing to read without `eval`
