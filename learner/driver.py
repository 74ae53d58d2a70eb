"""Learner rank 0: claims jobs and runs each one's loop.

    warm start (SFT) -> publish version 0 -> repeat num_steps times:
        admit tasks -> collect a batch of fresh groups -> RL step (all ranks)
        -> version += 1 -> publish weights -> acknowledge the trained groups

Only this rank talks to Redis; the training work is done by every rank through
`learner.control`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import redis.asyncio as aioredis

from learner import checkpoint, policy, warm_start
from learner.control import Command, Worker
from learner.dispatcher import Dispatcher
from learner.group_log import GroupLog
from learner.intake import Acks, BatchIntake
from learner.publisher import WeightPublisher
from learner.step_log import JobUnhealthy, StepLog, rl_record
from services import jobs, preference, protocol, retention
from services.config import JobSpec, LearnerSettings
from services.metrics import serve_metrics
from services.queues import FIELD, Delivery, Keys, StreamConsumer, connect

log = logging.getLogger(__name__)


class JobCancelled(Exception):
    pass


class LearnerStopping(Exception):
    """SIGTERM: the job was checkpointed and stays RUNNING for a `--resume` to continue."""


class Driver:
    def __init__(self, settings: LearnerSettings, worker: Worker) -> None:
        self.settings = settings
        self.worker = worker
        self.redis = connect(settings.redis_url, max_connections=32, wait_s=30.0, outage_s=settings.redis_outage_s)
        self.current_job = ""
        self.stop_requested = False

    def request_stop(self) -> None:
        """Called from the SIGTERM handler: finish the step, checkpoint, exit."""
        self.stop_requested = True

    def health(self) -> tuple[bool, dict]:
        return True, {"job": self.current_job}

    async def serve(self, once: bool = False) -> None:
        """Claim and run jobs one at a time (a job left pending by a crash comes first)."""
        serve_metrics(self.settings.metrics_port, self.health)
        queue = await StreamConsumer(
            self.redis, Keys.jobs_pending, "learners", "learner", protocol.JobRef, Keys.jobs_pending + ":dead"
        ).setup()
        backlog = await queue.read_own_pending(1)
        while True:
            deliveries = backlog or await queue.read(1, block_ms=1000)
            backlog = []
            for delivery in deliveries:
                try:
                    await self.run_job(delivery.message.job_id)
                except LearnerStopping:
                    log.info("stopping: job %s checkpointed, left pending for --resume", self.current_job)
                    return
                await queue.ack(delivery.entry_id)
                if once:
                    return
            if self.stop_requested:
                return

    async def run_job(self, job_id: str) -> None:
        claimed = await claim_job(self.redis, job_id, self.settings)
        if claimed is None:
            return
        spec, resuming = claimed
        log.info("%s job %s: %s", "resuming" if resuming else "running", job_id, spec.model_dump_json())
        self.current_job = job_id
        status, error = jobs.JobStatus.SUCCEEDED, ""
        try:
            self.worker.run(Command(kind="job", job_id=job_id, spec_json=spec.model_dump_json()))
            await job_run(self, job_id, spec).run(resuming)
        except LearnerStopping:
            self.worker.run(Command(kind="end"))
            raise
        except JobCancelled:
            status = jobs.JobStatus.CANCELLED
        except JobUnhealthy as err:
            status, error = jobs.JobStatus.FAILED, str(err)
        except Exception as err:
            log.exception("job %s failed", job_id)
            status, error = jobs.JobStatus.FAILED, f"{type(err).__name__}: {err}"
        self.worker.run(Command(kind="end"))
        await jobs.set_status(self.redis, job_id, status, error, self.settings.job_retention_s)
        await self.redis.publish(Keys.events(job_id), protocol.encode(protocol.JobEvent(kind="stop")))
        self.current_job = ""
        log.info("job %s %s %s", job_id, status.value, error)


async def claim_job(client: aioredis.Redis, job_id: str, settings: LearnerSettings) -> tuple[JobSpec, bool] | None:
    """Mark a queued job RUNNING: its spec, and whether it resumes (it was RUNNING already).
    None when it is not to run: gone, ended, cancelled first, or left RUNNING by a learner
    that died while this one was started without `settings.resume` (the job is failed)."""
    record = await jobs.get_job(client, job_id)
    if record is None or record["status"] in jobs.TERMINAL:
        log.info("skipping job %s (%s)", job_id, record and record["status"])
        return None
    spec = JobSpec.model_validate(record["spec"])
    resuming = record["status"] == jobs.JobStatus.RUNNING.value
    if resuming and not settings.resume:
        await jobs.set_status(
            client,
            job_id,
            jobs.JobStatus.FAILED,
            "the learner restarted during this job; start it with --resume to continue from the last checkpoint",
            settings.job_retention_s,
        )
        return None
    if not await jobs.set_status(client, job_id, jobs.JobStatus.RUNNING):  # a cancel came first
        log.info("job %s was cancelled before it started", job_id)
        return None
    return spec, resuming


def job_run(driver: Driver, job_id: str, spec: JobSpec) -> JobRun:
    """The loop a job's kind runs."""
    from learner.generate import GenerateRun  # they build on JobRun, defined below
    from learner.offline import OfflineRun

    kinds = {"rl": JobRun, "offline": OfflineRun, "generate": GenerateRun}
    return kinds[spec.kind](driver, job_id, spec)


class JobRun:
    """One job's RL loop on rank 0. Its parts: the batch intake (trajectory stream ->
    batches), the weight publisher (rollout servers and versions), the step log (records,
    metrics, health) and the checkpoints this class writes and resumes from."""

    def __init__(self, driver: Driver, job_id: str, spec: JobSpec) -> None:
        self.driver = driver
        self.redis = driver.redis
        self.settings = driver.settings
        self.worker = driver.worker
        self.job_id = job_id
        self.spec = spec
        self.version = 0
        self.step = 0
        self.run_dir = Path(self.settings.runs_dir) / job_id
        self.dispatcher = Dispatcher(self.redis, job_id, spec)
        self.publisher = WeightPublisher(self.redis, job_id, self.settings, self.worker)
        self.steps = StepLog(self.redis, job_id, self.run_dir, spec.health, self.settings.history_keep)

    def make_run_dir(self) -> None:
        """The job's folder, with the spec it runs (`job.json`): what `tandem export` reads to
        turn a checkpoint back into the model it trained."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / checkpoint.SPEC).write_text(self.spec.model_dump_json(indent=2) + "\n")

    async def run(self, resuming: bool = False) -> None:
        self.make_run_dir()
        trajectories = await StreamConsumer(
            self.redis,
            Keys.trajectories(self.job_id),
            "learner",
            "learner",
            protocol.TrajectoryGroup,
            Keys.dead(self.job_id),
        ).setup()
        every = self.spec.train.checkpoint_every
        self.intake = BatchIntake(
            self.job_id,
            self.spec.train,
            trajectories,
            self.dispatcher,
            Acks(trajectories, deferred=every > 0),
            policy.vocab_size(self.spec.model.local_folder()),
            GroupLog(self.run_dir),
            self.spec.train.stragglers,
        )
        if not (resuming and await self.resume()):
            await self.start()
        await self.publisher.wait_for_servers(self.check_cancel)
        await self.publisher.publish(self.version)
        await self.intake.read_backlog()
        self.steps.start_rl()
        self.intake.log.start()
        while self.step < self.spec.train.num_steps:
            await self.check_cancel()
            waited = time.monotonic()
            batch = await self.intake.collect(self.version, self.while_waiting)
            await self.train(batch, time.monotonic() - waited)
            if every and self.step % every == 0:
                await self.checkpoint()
            if self.spec.train.export_every and self.step % self.spec.train.export_every == 0:
                self.worker.run(Command(kind="export", path=str(self.run_dir / "policies" / f"step-{self.step:06d}")))
            if self.step < self.spec.train.num_steps:
                await self.check_stop()
        if not every or self.step % every:
            await self.checkpoint()
        self.worker.run(Command(kind="export", path=str(self.run_dir / "policy")))

    async def start(self) -> None:
        """A fresh start: the warm start, then the step-0 checkpoint RL begins from."""
        await self.warm_start()
        self.worker.run(Command(kind="start_rl"))
        await self.checkpoint()

    async def train(self, batch: list[Delivery], wait_s: float) -> None:
        """One RL step on `batch` (collected in `wait_s` seconds), the weight publish after
        it, and the step's record."""
        groups = [d.message for d in batch]
        started = time.perf_counter()
        train = self.spec.train
        if train.algorithm == "dpo":  # online DPO: each group's best and worst response
            pairs, too_long = preference.pairs_from_groups(groups, train.pair_margin, train.max_tokens_per_rank)
            metrics = self.worker.run(Command(kind="dpo", samples=pairs)) | {
                "pairs_too_long": float(too_long),
                "trained_tokens": sum(sum(s.mask) for s in pairs),
            }
        else:
            metrics = self.worker.run(Command(kind="rl", samples=[s for g in groups for s in g.samples]))
        step_seconds = time.perf_counter() - started
        self.version += 1
        self.step += 1
        sync = await self.publisher.publish(self.version)
        await self.intake.trained_on(batch)
        record = rl_record(
            self.step,
            self.version,
            groups,
            metrics,
            step_seconds,
            sync["seconds"],
            self.steps.waited(wait_s),
            self.counts(),
        )
        self.steps.observe_step(record)
        fired = await self.steps.judge_health(record)
        await self.steps.write(record, self.step, self.version)
        for stream in (Keys.tasks(self.job_id), Keys.trajectories(self.job_id)):
            await retention.trim_acked(self.redis, stream)
        await self.steps.act_on(fired)

    async def warm_start(self) -> None:
        for step, batch in enumerate(warm_start.batches(self.spec), 1):
            metrics = self.worker.run(Command(kind="sft", samples=batch))
            await self.steps.write({"phase": "sft", "sft_step": step, **metrics}, self.step, self.version)
        if self.spec.warm_start.steps:  # the policy RL starts from, kept to evaluate against
            self.worker.run(Command(kind="export", path=str(self.run_dir / "policy-warm-start")))

    def counts(self) -> dict[str, int]:
        return self.intake.counts | self.publisher.counts

    # ---- checkpoints ---------------------------------------------------------------

    async def checkpoint(self, stopping: bool = False) -> None:
        """Write a checkpoint (all ranks), then acknowledge what it covers. With periodic
        checkpoints off, trained groups are acknowledged right after their step instead, and
        only a stop (SIGTERM, `stopping`) writes one: the job resumes from it."""
        path = checkpoint.checkpoint_dir(self.settings.runs_dir, self.job_id, self.step)
        if (self.spec.train.checkpoint_every == 0 and not stopping) or (
            path == checkpoint.latest(self.settings.runs_dir, self.job_id) and not self.intake.acks.unacked
        ):
            return
        meta = {
            "step": self.step,
            "version": self.version,
            "trained": sorted(self.intake.trained),
            "counts": self.counts(),
            "dispatcher": self.dispatcher.state(),
            "history_length": await self.steps.length(),
        }
        self.worker.run(Command(kind="save", path=str(path), meta_json=json.dumps(meta)))
        await self.intake.acks.flush()
        await self.redis.rpush(
            Keys.checkpoints(self.job_id),
            json.dumps({"step": self.step, "version": self.version, "path": str(path), "time": time.time()}),
        )
        keep = self.settings.keep_checkpoints
        for removed in await asyncio.to_thread(checkpoint.prune, self.settings.runs_dir, self.job_id, keep):
            log.info("job %s: deleted checkpoint %s (keeping the newest %d)", self.job_id, removed, keep)
        await self.redis.ltrim(Keys.checkpoints(self.job_id), -keep, -1)

    async def resume(self) -> bool:
        """Continue from the newest complete checkpoint: restore every rank's state and the
        parts' bookkeeping, drop history written after it, and move the dispatcher past
        every task already in the stream. False: nothing to resume, start over."""
        path = checkpoint.latest(self.settings.runs_dir, self.job_id)
        if path is None:
            if await self.redis.xlen(Keys.tasks(self.job_id)):
                raise RuntimeError(
                    "cannot resume: tasks were dispatched but there is no checkpoint (train.checkpoint_every = 0?)"
                )
            log.info("no checkpoint yet and nothing dispatched: starting job %s over", self.job_id)
            await self.steps.trim(0)
            return False
        self.worker.run(Command(kind="start_rl"))
        meta = self.worker.run(Command(kind="load", path=str(path)))
        self.step, self.version = meta["step"], meta["version"]
        self.intake.trained = set(meta["trained"])
        for part in (self.intake, self.publisher):
            part.counts.update({name: meta["counts"].get(name, 0) for name in part.counts})
        self.dispatcher.load_state(meta["dispatcher"])
        last = await self.redis.xrevrange(Keys.tasks(self.job_id), count=1)
        if last:
            last_task = protocol.decode(last[0][1][FIELD], protocol.Task).task_id
            self.dispatcher.skip_past(last_task, self.version)
        await self.steps.trim(meta["history_length"])
        log.info("resumed job %s from %s (step %d)", self.job_id, path, self.step)
        return True

    # ---- interruptions -------------------------------------------------------------

    async def while_waiting(self) -> None:
        """A read for groups found none: honour a cancel or stop, follow the membership."""
        await self.check_cancel()
        await self.check_stop()
        await self.publisher.follow_membership(self.version)

    async def check_stop(self) -> None:
        if self.driver.stop_requested:
            await self.checkpoint(stopping=True)
            raise LearnerStopping()

    async def check_cancel(self) -> None:
        if await jobs.cancel_requested(self.redis, self.job_id):
            raise JobCancelled()
