"""Learner rank 0: claims jobs one at a time, tenant by tenant, and runs each with the run of its kind
(`learner.runs`). Only this rank talks to Redis; the training work is done by every rank
through `learner.control`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import redis
import redis.asyncio as aioredis

from learner.control import Command, GroupBroken, RankLost, Worker, rank_errors, rank_errors_dir
from learner.runs import run_for
from learner.runs.base import JobCancelled, LearnerStopping, Run
from learner.step_log import JobUnhealthy
from learner.torchrun import note_job, take_exit
from services import job_lease, jobs, protocol
from services.config import JobSpec, LearnerSettings, parse_job_spec
from services.metrics import serve_metrics
from services.queues import Keys, connect, refused_for_memory, when_redis_has_room

log = logging.getLogger(__name__)
QUEUE_POLL_S = 1.0
"""How often an idle learner looks for a queued job."""


class Driver:
    def __init__(self, settings: LearnerSettings, worker: Worker) -> None:
        self.settings = settings
        self.worker = worker
        self.redis = connect(settings.redis_url, max_connections=32, wait_s=30.0, outage_s=settings.redis_outage_s)
        self.current_job = ""
        self.current_run: Run | None = None
        self.stop_requested = False
        self.holder = job_lease.holder_id()
        self.lease: job_lease.Lease | None = None

    def request_stop(self) -> None:
        """Called from the SIGTERM handler: finish the step, checkpoint, exit."""
        self.stop_requested = True

    def health(self) -> tuple[bool, dict]:
        """Alive (200) while the process serves; `status` says whether the job progresses."""
        watchdog = getattr(self.current_run, "watchdog", None)
        condition = watchdog.condition() if watchdog is not None else {"status": "ok"}
        return True, {"job": self.current_job, **condition}

    async def serve(self, once: bool = False) -> None:
        """Claim and run jobs one at a time: first those a stopped learner left RUNNING or
        PAUSED, then the queued ones, tenant by tenant (`jobs.next_pending`)."""
        serve_metrics(self.settings.metrics_port, self.health)
        threading.Thread(target=self.beat, name="learner-heartbeat", daemon=True).start()
        left_running = await jobs.running_jobs(self.redis)
        while True:
            job_id = left_running.pop(0) if left_running else await self.next_job()
            if job_id is not None:
                try:
                    await self.run_job(job_id)
                except LearnerStopping:
                    log.info("stopping: job %s left RUNNING for --resume", self.current_job)
                    return
                if once:
                    return
            elif not self.stop_requested:
                await asyncio.sleep(QUEUE_POLL_S)
            if self.stop_requested:
                return

    async def next_job(self) -> str | None:
        """A RUNNING or PAUSED job no learner holds any more (its learner died, froze past
        the lease, or stopped) when this one resumes jobs; else the next queued one."""
        if self.settings.resume:
            left = await job_lease.unheld(self.redis, await jobs.running_jobs(self.redis))
            if left:
                return left[0]
        return await jobs.next_pending(self.redis, self.settings.pending_ttl_s, self.settings.job_retention_s)

    def beat(self) -> None:
        """On a thread of its own, so that a long step does not silence it: the lease on
        the held job renewed and the running job's `learner_seen`, every
        `jobs.LEARNER_BEAT_S` or a third of the lease, if shorter. A learner that died, or
        was never restarted, shows as silent in the job's record (`jobs.learner_silence`)
        and loses its lease."""
        client = redis.Redis.from_url(self.settings.redis_url, socket_timeout=5.0)
        while True:
            lease, job_id = self.lease, self.current_job
            try:
                if lease is not None and not job_lease.renew(client, lease, self.settings.lease_ttl_s):
                    log.error("job %s: lease lost, another learner holds it; its writes here are refused", job_id)
                elif job_id:
                    client.hset(Keys.job(job_id), "learner_seen", time.time())
            except redis.RedisError as err:  # an outage: the calls on the loop wait it out
                log.debug("learner heartbeat: %s", err)
            time.sleep(min(jobs.LEARNER_BEAT_S, self.settings.lease_ttl_s / 3))

    async def run_job(self, job_id: str) -> None:
        """Run the job unless another learner holds it: under a lease, whose token every
        write of the job carries (`job_lease`). A stop leaves the job marked as stopped on
        request, so the learner that takes it up next counts no crash."""
        lease = await job_lease.acquire(self.redis, job_id, self.holder, self.settings.lease_ttl_s)
        if lease is None:
            log.info("skipping job %s: another learner holds it", job_id)
            return
        self.lease, stopped = lease, False
        try:
            with job_lease.holding(lease):
                await self.run_held(job_id)
        except job_lease.LeaseLost as err:
            log.error("%s; leaving it to that learner", err)
        except LearnerStopping:
            stopped = True
            raise
        finally:
            self.lease = None
            with contextlib.suppress(redis.RedisError):  # unreleased, it lapses after its TTL
                await job_lease.release(self.redis, lease, stopped)

    async def run_held(self, job_id: str) -> None:
        claimed = await claim_job(self.redis, job_id, self.settings)
        if claimed is None:
            return
        spec, resuming = claimed
        unreported = rank_errors(rank_errors_dir(self.settings.runs_dir, job_id))
        if resuming and unreported:  # the last learner was torn down before it could say why
            await self.end_job(job_id, jobs.JobStatus.FAILED, "; ".join(unreported))
            return
        log.info("%s job %s: %s", "resuming" if resuming else "running", job_id, spec.model_dump_json())
        self.current_job = job_id
        note_job(job_id)
        status, error = jobs.JobStatus.SUCCEEDED, ""
        try:
            self.worker.run(Command(kind="job", job_id=job_id, spec_json=spec.model_dump_json()))
            self.current_run = run_for(self, job_id, spec)
            try:
                await self.current_run.run(resuming)
                error = self.current_run.ended_early  # SUCCEEDED short of its steps: why
            finally:
                self.current_run.close()
        except LearnerStopping:
            self.worker.run(Command(kind="end"))
            raise
        except RankLost:  # a rank was killed: the job stays RUNNING for the restarted learner
            raise
        except job_lease.LeaseLost:  # another learner runs the job now: leave it as it is
            self.worker.run(Command(kind="end"))
            self.current_job, self.current_run = "", None
            raise
        except GroupBroken as err:  # the ranks cannot go on together: report, then exit
            await self.end_job(job_id, jobs.JobStatus.FAILED, str(err))
            raise
        except JobCancelled as err:  # with what it could not keep, if anything
            status, error = jobs.JobStatus.CANCELLED, str(err)
        except JobUnhealthy as err:
            status, error = jobs.JobStatus.FAILED, str(err)
        except Exception as err:
            log.exception("job %s failed", job_id)
            status, error = jobs.JobStatus.FAILED, failure_reason(err)
        self.worker.run(Command(kind="end"))
        await self.end_job(job_id, status, error)

    async def end_job(self, job_id: str, status: jobs.JobStatus, error: str) -> None:
        """The job ended: its status and reason, the stop event, and its rank errors
        (reported now) cleared. A Redis at its memory cap is waited for, not crashed on: a
        restarted learner would train the job again into the same refusal."""
        await when_redis_has_room(
            lambda: jobs.set_status(self.redis, job_id, status, error, self.settings.job_retention_s),
            f"the end of job {job_id}",
        )
        await self.redis.publish(Keys.events(job_id), protocol.encode(protocol.JobEvent(kind="stop")))
        for path in rank_errors_dir(self.settings.runs_dir, job_id).glob("rank-*.txt"):
            path.unlink()
        self.current_job, self.current_run = "", None
        note_job("")
        log.info("job %s %s %s", job_id, status.value, error)


def failure_reason(error: Exception) -> str:
    """Why a job failed, for its record. A Redis refusal at its memory cap says what to do:
    FAILED rather than PAUSED, since Redis, with nothing left to evict, makes no room by
    itself, and a resume continues the job exactly from its checkpoint once room is made."""
    reason = f"{type(error).__name__}: {error}"
    if refused_for_memory(error):
        return (
            f"Redis is full: at its memory cap (maxmemory) with nothing left to evict, it refused a write. "
            f"Make room (raise maxmemory, delete ended jobs), then resume the job. {reason}"
        )
    return reason


async def claim_job(client: aioredis.Redis, job_id: str, settings: LearnerSettings) -> tuple[JobSpec, bool] | None:
    """Mark a queued job RUNNING: its spec, and whether it resumes (it was RUNNING or PAUSED,
    or it ended and was queued again by `jobs.resume`). None when it is not to run: gone,
    ended, cancelled first, or left RUNNING by a learner that died while this one was
    started without `settings.resume` (the job is failed)."""
    record = await jobs.get_job(client, job_id)
    if record is None or record["status"] in jobs.TERMINAL:
        log.info("skipping job %s (%s)", job_id, record and record["status"])
        return None
    spec = parse_job_spec(record["spec"])
    left_running = record["status"] in (jobs.JobStatus.RUNNING.value, jobs.JobStatus.PAUSED.value)
    resuming = left_running or record["resumes"] > 0
    if left_running and not settings.resume:
        await jobs.set_status(
            client,
            job_id,
            jobs.JobStatus.FAILED,
            "the learner restarted during this job; start it with --resume to continue from the last checkpoint",
            settings.job_retention_s,
        )
        return None
    if crash_loop := await count_crash(client, record, settings):
        await jobs.set_status(client, job_id, jobs.JobStatus.FAILED, crash_loop, settings.job_retention_s)
        return None
    if not await jobs.set_status(client, job_id, jobs.JobStatus.RUNNING):  # a cancel came first
        log.info("job %s was cancelled before it started", job_id)
        return None
    return spec, resuming


async def count_crash(client: aioredis.Redis, record: dict, settings: LearnerSettings) -> str:
    """Count the claim of a job its learner left RUNNING or PAUSED as a restart, with how
    that learner ended (torchrun's record of its ranks' exits, `learner.torchrun`). The
    reason to fail the job when its learner has now died `max_crashes_per_step` times
    after the same step, else ''."""
    if record["status"] not in (jobs.JobStatus.RUNNING.value, jobs.JobStatus.PAUSED.value):
        return ""
    last_seen = record.get("learner_seen") or record.get("started") or 0.0
    last_exit = take_exit(settings.runs_dir, record["id"], not_before=last_seen)
    crashes, step = await job_lease.count_restart(client, record["id"], last_exit)
    if crashes == 0:  # it stopped on request (SIGTERM): no crash
        return ""
    log.warning("job %s: restart %d after step %d; the last learner ended: %s", record["id"], crashes, step, last_exit)
    if crashes < settings.max_crashes_per_step:
        return ""
    return (
        f"the learner died {crashes} times in a row after step {step} without completing another "
        f"(max_crashes_per_step={settings.max_crashes_per_step}); the last exit: {last_exit}"
    )
