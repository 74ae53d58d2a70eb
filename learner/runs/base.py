"""What every kind of job's run on rank 0 has: its folder, the warm start, the step log,
cancels and stops. Each kind's run (`rl.py`, `offline.py`, `generate.py`) builds on `Run`
and says how it checkpoints; `learner.runs.run_for` picks the run of a job's kind."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import redis.asyncio as aioredis

from learner import checkpoint, warm_start
from learner.control import Command, GroupBroken, RankLost, Worker
from learner.runs.checkpoints import Checkpoints
from learner.step_log import StepLog
from learner.tracking import Trackers
from services import job_lease, jobs
from services.config import JobSpec, LearnerSettings

log = logging.getLogger(__name__)


class JobCancelled(Exception):
    """The job was cancelled; a message, if any, says what it could not keep (the job's error)."""


class LearnerStopping(Exception):
    """SIGTERM: the job was checkpointed and stays RUNNING for a `--resume` to continue."""


class Learner(Protocol):
    """What a run uses of the learner that runs it (`learner.driver.Driver`)."""

    settings: LearnerSettings
    worker: Worker
    redis: aioredis.Redis
    stop_requested: bool


class Run:
    """One job's run on rank 0 (the training itself is done by every rank through
    `learner.control`)."""

    def __init__(self, learner: Learner, job_id: str, spec: JobSpec) -> None:
        self.learner = learner
        self.redis = learner.redis
        self.settings = learner.settings
        self.worker = learner.worker
        self.job_id = job_id
        self.spec = spec
        self.version = 0
        self.step = 0
        self.ended_early = ""
        """Why the job ends before its steps yet SUCCEEDED (a spend cap): its record's reason."""
        self.run_dir = Path(self.settings.runs_dir) / job_id
        trackers = Trackers(spec.tracking, self.run_dir, job_id, spec.model_dump(mode="json"))
        self.steps = StepLog(self.redis, job_id, self.run_dir, self.health_rules(), self.settings.history_keep, trackers)
        self.checkpoints = Checkpoints(self.redis, self.worker, self.settings, job_id, spec.train)

    def health_rules(self) -> list:
        """The rules the step log judges each step by (only an RL job has them)."""
        return []

    async def run(self, resuming: bool = False) -> None:
        raise NotImplementedError

    async def checkpoint(self, stopping: bool = False) -> None:
        """What this kind keeps to resume from; `stopping`: the stop's own (SIGTERM)."""
        raise NotImplementedError

    def make_run_dir(self) -> None:
        """The job's folder, with the spec it runs (`job.json`): what `tandem export` reads to
        turn a checkpoint back into the model it trained."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / checkpoint.SPEC).write_text(self.spec.model_dump_json(indent=2) + "\n")

    async def warm_start(self) -> None:
        """The SFT steps before RL. A cancel ends the job between two of them, keeping
        nothing; a stop (SIGTERM) leaves it RUNNING with nothing dispatched. Either way a
        resume starts it over."""
        for step, batch in enumerate(warm_start.batches(self.spec), 1):
            metrics = self.worker.run(Command(kind="sft", samples=batch))
            await self.steps.write({"phase": "sft", "sft_step": step, **metrics}, self.step, self.version)
            await self.check_cancel(keep=False)
            if self.learner.stop_requested:
                raise LearnerStopping()
        if self.spec.warm_start.steps:  # the policy RL starts from, kept to evaluate against
            self.worker.run(Command(kind="export", path=str(self.run_dir / "policy-warm-start")))

    async def check_stop(self) -> None:
        if self.learner.stop_requested:
            await self.checkpoint(stopping=True)
            raise LearnerStopping()

    async def check_waiting(self) -> None:
        """While waiting for rollout servers: a cancel or a stop ends the wait."""
        await self.check_cancel()
        await self.check_stop()

    async def check_cancel(self, keep: bool = True) -> None:
        """A cancel ends the job (`JobCancelled`); with `keep`, after `on_cancel` keeps what
        it has (not in the warm start, which a resume starts over). The cancel is what the
        user asked for, so a keep that fails (a full disk) still ends the job cancelled, with
        what failed as its error and what was kept before still there; only a failure the
        ranks cannot go on from ends it otherwise."""
        if not await jobs.cancel_requested(self.redis, self.job_id):
            return
        if keep:
            try:
                await self.on_cancel()
            except (GroupBroken, RankLost, job_lease.LeaseLost):
                raise
            except Exception as err:
                log.exception("job %s: keeping its state on cancel failed", self.job_id)
                raise JobCancelled(f"cancelled, but keeping its checkpoint or policy failed: {err}") from err
        raise JobCancelled()

    async def on_cancel(self) -> None:
        """What a cancelled job keeps before it ends: what a stop keeps (its checkpoint), so
        `tandem resume` continues it as it would a stopped one."""
        await self.checkpoint(stopping=True)

    def close(self) -> None:
        """What the run holds open beyond it: its trackers (flushed and closed)."""
        self.steps.trackers.close()

    def export_policy(self) -> None:
        """The policy as it stands, as the job's model (`runs/<job>/policy`; all ranks)."""
        self.worker.run(Command(kind="export", path=str(self.run_dir / "policy")))
