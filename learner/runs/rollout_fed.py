"""The parts of a run fed by rollout servers (RL and generate jobs): the dispatcher that
admits tasks, the trajectory stream, and the weight publisher that keeps the servers'
membership and versions."""

from __future__ import annotations

from learner.dispatcher import Dispatcher
from learner.publisher import WeightPublisher
from learner.runs.base import Learner, Run
from services import protocol
from services.config import JobSpec
from services.queues import Keys, StreamConsumer


class RolloutFedRun(Run):
    dispatcher_class: type[Dispatcher] = Dispatcher

    def __init__(self, learner: Learner, job_id: str, spec: JobSpec) -> None:
        super().__init__(learner, job_id, spec)
        self.dispatcher = self.dispatcher_class(self.redis, job_id, spec)
        self.publisher = WeightPublisher(self.redis, job_id, self.settings, self.worker)

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

    async def while_waiting(self) -> None:
        """A read for groups found none: honour a cancel or stop, follow the membership."""
        await self.check_cancel()
        await self.check_stop()
        await self.publisher.follow_membership(self.version)
