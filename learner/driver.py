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
import random
import time
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram

from learner import checkpoint, health
from learner.control import Command, Worker
from learner.dispatcher import Dispatcher
from services import jobs, protocol
from services.config import JobSpec, LearnerSettings
from services.metrics import serve_metrics
from services.queues import FIELD, Delivery, Keys, StreamConsumer
from services.stats import TrailingRate, mean_by_key

log = logging.getLogger(__name__)

STEP = Gauge("tandem_learner_step", "Learner steps done", ["job"])
VERSION = Gauge("tandem_learner_version", "Policy version", ["job"])
REWARD = Gauge("tandem_learner_reward_mean", "Mean reward of the last batch", ["job"])
STEP_GAUGES = {  # record key -> gauge of the last step's value
    "loss": Gauge("tandem_learner_loss", "Policy loss of the last step", ["job"]),
    "sft_loss": Gauge("tandem_learner_sft_loss", "Warm-start (SFT) loss of the last step", ["job"]),
    "grad_norm": Gauge("tandem_learner_grad_norm", "Gradient norm before clipping", ["job"]),
    "entropy": Gauge("tandem_learner_entropy", "Mean policy entropy on trained tokens", ["job"]),
    "mismatch_kl": Gauge("tandem_learner_mismatch_kl", "KL(behaviour || proximal), k3, per token", ["job"]),
    "kl_ref": Gauge("tandem_learner_kl_ref", "KL to the reference policy per token", ["job"]),
    "clip_fraction": Gauge("tandem_learner_clip_fraction", "Share of tokens where the PPO clip bites", ["job"]),
    "is_weight_mean": Gauge("tandem_learner_importance_weight_mean", "Mean behaviour importance weight", ["job"]),
    "is_weight_max": Gauge("tandem_learner_importance_weight_max", "Largest behaviour importance weight", ["job"]),
    "is_masked_fraction": Gauge("tandem_learner_importance_masked_fraction", "Share of tokens masked by MIS", ["job"]),
    "success": Gauge("tandem_learner_task_success", "Task success in the last batch", ["job"]),
    "zero_spread_share": Gauge("tandem_learner_zero_spread_group_share",
                               "Share of the last batch's groups whose advantages are all 0 (trained on nothing)",
                               ["job"]),
    "is_capped_tokens": Gauge("tandem_learner_importance_capped_tokens",
                              "Trained tokens of the last step whose importance weight the cap C set", ["job"]),
    "futures_malformed": Gauge("tandem_learner_futures_malformed_share",
                               "Share of MR futures a later policy turn left malformed, last batch", ["job"]),
    "skipped_updates": Gauge("tandem_learner_skipped_updates",
                             "Optimizer updates of the last step skipped for an exactly zero gradient", ["job"]),
}
MALFORMED = Gauge("tandem_learner_malformed_share",
                  "Share of the last batch's trained responses the format filter rejected, by reason",
                  ["job", "reason"])
STALE_DROPPED = Counter("tandem_learner_stale_dropped_total", "Groups dropped as over-stale", ["job"])
DUPLICATES = Counter("tandem_learner_duplicate_groups_total", "Groups for an already trained task", ["job"])
TRAINED_TOKENS = Counter("tandem_learner_trained_tokens_total", "Tokens trained on", ["job"])
STALENESS = Histogram("tandem_learner_staleness", "Staleness of trained groups (versions)", ["job"],
                      buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32))
SYNC_SECONDS = Histogram("tandem_learner_weight_sync_seconds", "Gather + broadcast of one update",
                         ["job"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
STEP_SECONDS = Histogram("tandem_learner_step_seconds", "Wall time of a training step", ["job"],
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300))
IDLE_RATIO = Gauge("tandem_learner_idle_ratio",
                   "Share of the last minute the learner spent waiting for a batch of groups", ["job"])
WAIT_SECONDS = Histogram("tandem_learner_batch_wait_seconds", "Time waiting for a batch of groups",
                         ["job"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300))
QUEUE_DEPTH = Gauge("tandem_queue_depth", "Entries in a job stream not yet read", ["job", "stream"])
PENDING = Gauge("tandem_queue_pending", "Entries read but not acknowledged", ["job", "stream"])
DEAD = Gauge("tandem_queue_dead_letters", "Entries in the job's dead stream", ["job"])
HEALTH_ALERTS = Counter("tandem_learner_health_alerts_total", "Health rules that fired, by metric and action",
                        ["job", "metric", "action"])


class JobCancelled(Exception):
    pass


class JobUnhealthy(Exception):
    """A health rule with action `stop` fired; the message says which and why."""


class LearnerStopping(Exception):
    """SIGTERM: the job was checkpointed and stays RUNNING for a `--resume` to continue."""


class Driver:
    def __init__(self, settings: LearnerSettings, worker: Worker) -> None:
        self.settings = settings
        self.worker = worker
        self.redis = aioredis.from_url(settings.redis_url)
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
        queue = await StreamConsumer(self.redis, Keys.jobs_pending, "learners", "learner",
                                     protocol.JobRef, Keys.jobs_pending + ":dead").setup()
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
        record = await jobs.get_job(self.redis, job_id)
        if record is None or record["status"] in jobs.TERMINAL:
            log.info("skipping job %s (%s)", job_id, record and record["status"])
            return
        spec = JobSpec.model_validate(record["spec"])
        resuming = record["status"] == jobs.JobStatus.RUNNING.value
        if resuming and not self.settings.resume:
            await jobs.set_status(self.redis, job_id, jobs.JobStatus.FAILED,
                                  "the learner restarted during this job; start it with --resume to continue "
                                  "from the last checkpoint")
            return
        if not await jobs.set_status(self.redis, job_id, jobs.JobStatus.RUNNING):  # a cancel came first
            log.info("job %s was cancelled before it started", job_id)
            return
        log.info("%s job %s: %s", "resuming" if resuming else "running", job_id, spec.model_dump_json())
        self.current_job = job_id
        status, error = jobs.JobStatus.SUCCEEDED, ""
        try:
            self.worker.run(Command(kind="job", job_id=job_id, spec_json=spec.model_dump_json()))
            await JobRun(self, job_id, spec).run(resuming)
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
        await jobs.set_status(self.redis, job_id, status, error)
        await self.redis.publish(Keys.events(job_id), protocol.encode(protocol.JobEvent(kind="stop")))
        self.current_job = ""
        log.info("job %s %s %s", job_id, status.value, error)


class JobRun:
    """One job's RL loop on rank 0."""

    def __init__(self, driver: Driver, job_id: str, spec: JobSpec) -> None:
        self.driver = driver
        self.redis = driver.redis
        self.settings = driver.settings
        self.worker = driver.worker
        self.job_id = job_id
        self.spec = spec
        self.version = 0
        self.step = 0
        self.trained: set[int] = set()
        self.dispatcher = Dispatcher(self.redis, job_id, spec)
        self.counts = {"stale_dropped": 0, "duplicates": 0, "weight_updates": 0, "regroups": 0,
                       "sync_failures": 0}
        self.membership_checked = 0.0
        self.run_dir = Path(self.settings.runs_dir) / job_id
        self.unacked: list[bytes] = []
        """Trajectory entries trained since the last checkpoint (acknowledged when it is complete)."""
        self.rl_started = time.monotonic()
        """When this run of the job began RL steps (after the first weight publish)."""
        self.waited_s = 0.0
        """Seconds since `rl_started` spent waiting for batches: the learner's idle time."""
        self.idle_rate = TrailingRate(window_s=60.0)

    async def run(self, resuming: bool = False) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.trajectories = await StreamConsumer(
            self.redis, Keys.trajectories(self.job_id), "learner", "learner",
            protocol.TrajectoryGroup, Keys.dead(self.job_id),
        ).setup()
        if resuming:
            await self.resume()
        else:
            await self.warm_start()
            self.worker.run(Command(kind="start_rl"))
            await self.checkpoint()
        await self.wait_for_rollout_servers()
        await self.publish_weights()
        backlog = await self.read_backlog()
        every = self.spec.train.checkpoint_every
        self.rl_started = time.monotonic()
        while self.step < self.spec.train.num_steps:
            await self.check_cancel()
            waited = time.monotonic()
            batch, backlog = await self.collect_batch(backlog)
            wait_s = time.monotonic() - waited
            WAIT_SECONDS.labels(self.job_id).observe(wait_s)
            self.waited_s += wait_s
            await self.train(batch, wait_s)
            if every and self.step % every == 0:
                await self.checkpoint()
            if self.step < self.spec.train.num_steps:
                await self.check_stop()
        if not every or self.step % every:
            await self.checkpoint()
        self.worker.run(Command(kind="export", path=str(self.run_dir / "policy")))

    async def resume(self) -> None:
        """Continue from the newest complete checkpoint: restore every rank's state and this
        driver's bookkeeping, drop history written after it, and move the dispatcher past
        every task already in the stream."""
        path = checkpoint.latest(self.settings.runs_dir, self.job_id)
        if path is None:
            if await self.redis.xlen(Keys.tasks(self.job_id)):
                raise RuntimeError("cannot resume: tasks were dispatched but there is no checkpoint "
                                   "(train.checkpoint_every = 0?)")
            log.info("no checkpoint yet and nothing dispatched: starting job %s over", self.job_id)
            await self.trim_history(0)
            await self.warm_start()
            self.worker.run(Command(kind="start_rl"))
            await self.checkpoint()
            return
        self.worker.run(Command(kind="start_rl"))
        meta = self.worker.run(Command(kind="load", path=str(path)))
        self.step, self.version = meta["step"], meta["version"]
        self.trained = set(meta["trained"])
        self.counts = meta["counts"]
        self.dispatcher.load_state(meta["dispatcher"])
        last = await self.redis.xrevrange(Keys.tasks(self.job_id), count=1)
        if last:
            last_task = protocol.decode(last[0][1][FIELD], protocol.Task).task_id
            self.dispatcher.next_task_id = max(self.dispatcher.next_task_id, last_task + 1)
        await self.trim_history(meta["history_length"])
        log.info("resumed job %s from %s (step %d)", self.job_id, path, self.step)

    async def trim_history(self, length: int) -> None:
        """Keep the first `length` history records: those a checkpoint covers."""
        if length:
            await self.redis.ltrim(Keys.history(self.job_id), 0, length - 1)
        else:  # LTRIM 0 -1 would keep every record
            await self.redis.delete(Keys.history(self.job_id))

    async def checkpoint(self) -> None:
        """Write a checkpoint (all ranks), then acknowledge what it covers. With checkpoints
        off, trained groups are acknowledged right after their step instead."""
        path = checkpoint.checkpoint_dir(self.settings.runs_dir, self.job_id, self.step)
        if self.spec.train.checkpoint_every == 0 or (path == checkpoint.latest(self.settings.runs_dir, self.job_id)
                                                     and not self.unacked):
            return
        meta = {
            "step": self.step, "version": self.version, "trained": sorted(self.trained),
            "counts": self.counts, "dispatcher": self.dispatcher.state(),
            "history_length": await self.redis.llen(Keys.history(self.job_id)),
        }
        self.worker.run(Command(kind="save", path=str(path), meta_json=json.dumps(meta)))
        await self.trajectories.ack(*self.unacked)
        self.unacked = []
        await self.redis.rpush(Keys.checkpoints(self.job_id), json.dumps(
            {"step": self.step, "version": self.version, "path": str(path), "time": time.time()}))

    # ---- phases --------------------------------------------------------------------

    async def warm_start(self) -> None:
        warm = self.spec.warm_start
        if warm.steps == 0:
            return
        if not warm.data:
            raise ValueError("warm_start.data is required when warm_start.steps > 0")
        samples = load_demonstrations(warm.data, self.spec)
        rng = random.Random(self.spec.train.seed)
        for step in range(warm.steps):
            batch = rng.sample(samples, min(warm.batch_size, len(samples)))
            metrics = self.worker.run(Command(kind="sft", samples=batch))
            await self.record({"phase": "sft", "sft_step": step + 1, **metrics})
        # The policy RL starts from, kept for evaluation against the trained one.
        self.worker.run(Command(kind="export", path=str(self.run_dir / "policy-warm-start")))

    async def wait_for_rollout_servers(self) -> None:
        deadline = time.monotonic() + self.settings.rollout_wait_s
        while len(await self.live_servers()) < self.settings.min_rollout_servers:
            await self.check_cancel()
            error = await self.redis.hget(Keys.job(self.job_id), "rollout_error")
            if error:
                raise RuntimeError(f"a rollout server cannot serve this job: {error.decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rollout server joined within {self.settings.rollout_wait_s:.0f}s")
            await asyncio.sleep(0.5)

    async def job_servers(self) -> list[protocol.ServerInfo]:
        infos = [protocol.decode(raw, protocol.ServerInfo)
                 for raw in (await self.redis.hgetall(Keys.rollout_servers)).values()]
        return [info for info in infos if info.job_id == self.job_id]

    async def live_servers(self) -> list[str]:
        """Servers on this job whose last heartbeat is younger than `server_timeout_s`."""
        now = time.time()
        return [info.server_id for info in await self.job_servers()
                if now - info.heartbeat < self.settings.server_timeout_s]

    async def settle_membership(self, since: float) -> None:
        """After a failed update, wait until every server on the job has either sent a
        heartbeat since `since` (alive) or aged out (dead), so the next group is right."""
        timeout = self.settings.server_timeout_s
        while time.time() < since + timeout:
            now = time.time()
            if all(info.heartbeat > since or now - info.heartbeat >= timeout for info in await self.job_servers()):
                return
            await asyncio.sleep(0.2)

    async def publish_weights(self, servers: list[str] | None = None, regroup: bool = False) -> dict:
        """Announce the plan for `self.version`, then broadcast it (all ranks). `regroup`
        re-sends the current version to a new membership (a server joined or vanished).
        A failed broadcast (a member died) is retried on the settled membership."""
        for attempt in range(3):
            plan = self.worker.sender.plan(self.version, await self.live_servers() if servers is None else servers)
            await self.redis.hset(Keys.weights(self.job_id),
                                  mapping={"version": self.version, "plan": protocol.encode(plan)})
            await self.redis.publish(Keys.events(self.job_id),
                                     protocol.encode(protocol.JobEvent(kind="version", version=self.version)))
            result = self.worker.run(Command(kind="sync", plan=plan))
            SYNC_SECONDS.labels(self.job_id).observe(result["seconds"])
            self.counts["regroups" if regroup or attempt else "weight_updates"] += 1
            if not result["failed"]:
                return result
            self.counts["sync_failures"] += 1
            await self.settle_membership(since=time.time())
            servers = None
        return result

    async def follow_membership(self) -> None:
        """While waiting for data: a server that joined (or left) since the last update gets
        the current weights now, in a new group, instead of idling until the next step."""
        if time.monotonic() - self.membership_checked < 1.0:
            return
        self.membership_checked = time.monotonic()
        servers = await self.live_servers()
        if set(servers) != set(self.worker.sender.ranks):
            log.info("rollout servers changed to %s: re-sending version %d", sorted(servers), self.version)
            await self.publish_weights(servers, regroup=True)

    async def read_backlog(self) -> list[Delivery]:
        """Every trajectory entry an earlier run of this job read and never acknowledged, in
        stream order: all of them, since what a capped read leaves out is never read again."""
        consumer = self.trajectories
        summary = await self.redis.xpending(consumer.stream, consumer.group)
        pending = sum(c["pending"] for c in summary["consumers"] if c["name"].decode() == consumer.consumer)
        return await consumer.read_own_pending(pending) if pending else []

    async def collect_batch(self, backlog: list[Delivery]) -> tuple[list[Delivery], list[Delivery]]:
        """`batch_size` fresh groups of distinct, untrained tasks; over-stale groups are
        dropped (and their tasks replaced), duplicates acknowledged and skipped."""
        batch: list[Delivery] = []
        seen: set[int] = set()
        while len(batch) < self.spec.train.batch_size:
            await self.dispatcher.top_up(self.version)
            need = self.spec.train.batch_size - len(batch)
            deliveries, backlog = backlog[:need], backlog[need:]
            if not deliveries:
                deliveries = await self.trajectories.read(need, block_ms=200)
                if not deliveries:
                    await self.check_cancel()
                    await self.check_stop()
                    await self.follow_membership()
            for delivery in deliveries:
                if await self.admit(delivery, seen):
                    batch.append(delivery)
                    seen.add(delivery.message.task_id)
        return batch, backlog

    async def admit(self, delivery: Delivery, seen: set[int]) -> bool:
        """Whether a group may join the batch. Rejected: a task already trained (a rollout
        server died after writing it), malformed groups (dead-lettered), over-stale groups
        and groups from versions newer than ours (sampled by weights a crashed learner
        published and this one never had)."""
        group: protocol.TrajectoryGroup = delivery.message
        if group.task_id in self.trained or group.task_id in seen:
            self.counts["duplicates"] += 1
            DUPLICATES.labels(self.job_id).inc()
            await self.settle(delivery.entry_id)
            return False
        problem = invalid_reason(group, self.spec.train.max_tokens_per_rank)
        if problem:
            # Refused here, on rank 0, for all ranks: in a step it would fail on some ranks
            # only and leave the others blocked in a collective.
            await self.trajectories.dead_letter(delivery.entry_id, protocol.encode(group), problem)
            return False  # the dispatcher replaces its task when it reads the dead stream
        oldest = group.min_version()
        staleness = self.version - (self.version if oldest is None else oldest)
        if staleness > self.spec.train.max_staleness or group.max_version() > self.version:
            self.counts["stale_dropped"] += 1
            STALE_DROPPED.labels(self.job_id).inc()
            self.dispatcher.replace()
            await self.settle(delivery.entry_id)
            return False
        return True

    async def settle(self, entry_id: bytes) -> None:
        """Acknowledge an entry now, or with the next checkpoint when checkpoints are on, so
        a resumed run sees (and decides on) exactly the entries the lost one had not covered."""
        if self.spec.train.checkpoint_every:
            self.unacked.append(entry_id)
        else:
            await self.trajectories.ack(entry_id)

    async def train(self, batch: list[Delivery], wait_s: float) -> None:
        """One RL step on `batch` (collected in `wait_s` seconds), the weight publish after
        it, and the step's record."""
        groups = [d.message for d in batch]
        samples = [s for g in groups for s in g.samples]
        started = time.perf_counter()
        metrics = self.worker.run(Command(kind="rl", samples=samples))
        step_seconds = time.perf_counter() - started
        self.version += 1
        self.step += 1
        sync = await self.publish_weights()
        for delivery in batch:
            await self.settle(delivery.entry_id)
        self.trained.update(g.task_id for g in groups)
        staleness = [self.version - 1 - g.min_version() for g in groups if g.min_version() is not None]
        for value in staleness:
            STALENESS.labels(self.job_id).observe(value)
        trained_tokens = sum(sum(s.mask) for s in samples)
        TRAINED_TOKENS.labels(self.job_id).inc(trained_tokens)
        STEP_SECONDS.labels(self.job_id).observe(step_seconds)
        record = {
            "phase": "rl", "step": self.step, "version": self.version,
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "staleness_mean": sum(staleness) / max(len(staleness), 1),
            "staleness_max": max(staleness, default=0),
            "groups": len(groups), "samples": len(samples), "trained_tokens": trained_tokens,
            "zero_spread_share": sum(not g.has_spread() for g in groups) / len(groups),
            "task_ids": sorted(g.task_id for g in groups),
            "unversioned_tokens": sum(1 for s in samples for v, m in zip(s.versions, s.mask) if m and v < 0),
            "step_seconds": step_seconds, "sync_seconds": sync["seconds"],
            "rollout_seconds_mean": sum(g.elapsed_s for g in groups) / len(groups),
            "staleness_counts": {str(v): staleness.count(v) for v in sorted(set(staleness))},
            **self.idleness(wait_s),
            **mean_by_key([s.metrics for s in samples]), **metrics, **self.counts,
        }
        fired = await self.judge_health(record)
        await self.record(record)
        await self.act_on(fired)

    def idleness(self, wait_s: float) -> dict[str, float]:
        """The step's wait for its batch, and the learner's idle share: since RL began (in
        the record) and over the last minute (the gauge)."""
        now = time.monotonic()
        IDLE_RATIO.labels(self.job_id).set(self.idle_rate.add(now, self.waited_s))
        rl_seconds = now - self.rl_started
        return {"batch_wait_seconds": wait_s, "rl_seconds": rl_seconds,
                "idle_ratio": self.waited_s / rl_seconds if rl_seconds > 0 else 0.0}

    async def judge_health(self, record: dict) -> list[health.Alert]:
        """The job's health rules that fire at this step, also listed in its record."""
        if not self.spec.health:
            return []
        raw = await self.redis.lrange(Keys.history(self.job_id), 1 - health.history_needed(self.spec.health), -1)
        recent = [r for r in map(json.loads, raw) if r.get("phase") == "rl"] + [record]
        fired = health.alerts(self.spec.health, recent)
        if fired:
            record["health"] = [alert.message for alert in fired]
        return fired

    async def act_on(self, fired: list[health.Alert]) -> None:
        """Warnings go to the log, the job's alerts and a counter; a `stop` ends the job."""
        for alert in fired:
            log.warning("job %s: %s", self.job_id, alert.message)
            HEALTH_ALERTS.labels(self.job_id, alert.rule.metric, alert.rule.action).inc()
            await jobs.add_alert(self.redis, self.job_id, alert.message)
        stops = [alert.message for alert in fired if alert.stops]
        if stops:
            raise JobUnhealthy("; ".join(stops))

    # ---- bookkeeping ---------------------------------------------------------------

    async def record(self, record: dict) -> None:
        record["time"] = time.time()
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        await self.redis.rpush(Keys.history(self.job_id), json.dumps(record))
        await jobs.record_progress(self.redis, self.job_id, self.step, self.version, record)
        self.export_gauges(record)
        await self.export_queue_gauges()

    def export_gauges(self, record: dict) -> None:
        STEP.labels(self.job_id).set(self.step)
        VERSION.labels(self.job_id).set(self.version)
        if "reward_mean" in record:
            REWARD.labels(self.job_id).set(record["reward_mean"])
        for name, gauge in STEP_GAUGES.items():
            if name in record:
                gauge.labels(self.job_id).set(record[name])
        for name, value in record.items():
            if name.startswith("malformed_"):
                MALFORMED.labels(self.job_id, name.removeprefix("malformed_")).set(value)

    async def export_queue_gauges(self) -> None:
        for name, stream, group in (("tasks", Keys.tasks(self.job_id), "rollout"),
                                    ("trajectories", Keys.trajectories(self.job_id), "learner")):
            if not await self.redis.exists(stream):
                continue
            for info in await self.redis.xinfo_groups(stream):
                if info["name"].decode() == group:
                    QUEUE_DEPTH.labels(self.job_id, name).set(info.get("lag") or 0)
                    PENDING.labels(self.job_id, name).set(info["pending"])
        DEAD.labels(self.job_id).set(await self.redis.xlen(Keys.dead(self.job_id)))

    async def check_stop(self) -> None:
        if self.driver.stop_requested:
            await self.checkpoint()
            raise LearnerStopping()

    async def check_cancel(self) -> None:
        if await jobs.cancel_requested(self.redis, self.job_id):
            raise JobCancelled()


def invalid_reason(group: protocol.TrajectoryGroup, max_tokens_per_rank: int) -> str:
    """Why the trainer could not train `group` ("" if it can): no samples, a sample without
    tokens, per-token fields of different lengths, or a sequence longer than a rank takes."""
    if not group.samples:
        return "the group has no samples"
    for sample in group.samples:
        lengths = {field: len(getattr(sample, field)) for field in ("tokens", "mask", "logprobs", "versions")}
        if len(set(lengths.values())) > 1:
            return f"sample {sample.sample_id}: per-token fields differ in length {lengths}"
        if not sample.tokens:
            return f"sample {sample.sample_id} has no tokens"
        if len(sample.tokens) > max_tokens_per_rank:
            return (f"sample {sample.sample_id}: {len(sample.tokens)} tokens exceed "
                    f"train.max_tokens_per_rank={max_tokens_per_rank}")
    return ""


def load_demonstrations(path: str, spec: JobSpec) -> list[protocol.Sample]:
    """JSONL of {"messages": [...]} -> SFT samples (mask on assistant tokens)."""
    from transformers import AutoTokenizer

    from services.tokenization import ChatTokenizer

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(spec.model.path), "off")
    samples = []
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            tokens, mask = chat.encode_demonstration(json.loads(line)["messages"])
            samples.append(protocol.Sample(
                sample_id=f"sft:{line_number}", tokens=tokens, mask=mask, logprobs=[0.0] * len(tokens),
                versions=[-1] * len(tokens), reward=0.0, advantage=0.0, num_turns=0,
            ))
    if not samples:
        raise ValueError(f"no demonstrations in {path}")
    return samples
