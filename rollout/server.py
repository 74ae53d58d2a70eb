"""The rollout server process: one engine, episodes, rewards, advantages.

It watches `jobs:running`. For a job it (re)loads the job's model, announces itself in
`rollout:servers`, waits to be included in a weight update (the learner's version 0 is
the warm-started policy), then consumes the job's `tasks` stream in group `rollout`,
writes one `TrajectoryGroup` per task and acknowledges the task after the group is in
Redis (`rollout.group` turns a task into its group). Weight updates pause the engine,
reload in place and resume.

Draining (SIGTERM, or `tandem drain` through the API) takes a server out of its job without
losing work or stalling the weight broadcast: it says so in its heartbeat at once (the
learner leaves it out of every later plan), takes no new task, finishes its tasks for up
to `drain_timeout_s` and hands the rest back to the other servers, still applying any plan
that already names it; then it leaves the job. After SIGTERM it exits; after `tandem drain`
it idles until the drain is lifted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollout.assembly import assemble, check_sandbox, held_out_player
from rollout.engine import Engine
from rollout.evaluate import HeldOutPlayer
from rollout.group import GroupRollout
from rollout.journal import Journal
from services import jobs, protocol
from services.config import JobSpec, RolloutSettings
from services.judge_client import JudgeClient
from services.metrics import serve_metrics
from services.queues import GROUPS_KEPT, Delivery, Keys, StreamConsumer, connect, publish
from services.stats import TrailingRate
from services.tokenization import TokenizationMismatch
from services.tool_catalog import load_catalog

log = logging.getLogger(__name__)

TASKS = Counter("tandem_rollout_tasks_total", "Tasks finished, by outcome", ["job", "outcome"])
EPISODE_SECONDS = Histogram(
    "tandem_rollout_task_seconds",
    "Wall time of one task (all episodes and rewards)",
    ["job"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
SYNC_SECONDS = Histogram(
    "tandem_rollout_weight_sync_seconds",
    "Pause, receive, reload, resume",
    ["job"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
INFLIGHT = Gauge("tandem_rollout_inflight_tasks", "Tasks being worked on", ["job"])
ENGINE_BUSY = Counter(
    "tandem_rollout_engine_busy_seconds_total", "Seconds the engine had at least one request generating", ["job"]
)
ENGINE_BUSY_RATIO = Gauge(
    "tandem_rollout_engine_busy_ratio", "Share of the last minute the engine had a request generating", ["job"]
)
VERSION = Gauge("tandem_rollout_weight_version", "Weight version served", ["job"])


REDIS_CONNECTIONS = 64
"""Redis connections per rollout server; more callers wait for one."""
REDIS_REPLY_TIMEOUT_S = 30.0
"""The longest wait for any Redis reply. Every blocking read here blocks for well under a
second, so a reply this late is lost: the wait ends in a TimeoutError, which `run` treats
as an outage (serve again), instead of a silent hang. A blocking XREADGROUP that never
returned once held a server between two jobs, its task group unable to finish."""


OUTAGE_GRACE_S = 60.0
"""How much longer than the learner's `judge_outage_s` a judge call waits out an outage:
the learner fails the job with the outage as its reason before any task fails of it."""


class BadTask(ValueError):
    """A task message whose content no retry can fix; it goes to the dead-letter stream."""


class RolloutServer:
    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.server_id = settings.server_id or f"{socket.gethostname()}-{os.getpid()}"
        self.started = time.time()
        self.tool_catalog = load_catalog(settings.tool_catalog)
        # A blocking pool: with futures in flight, hundreds of coroutines touch Redis at
        # once (journal, streams); they wait for a free connection instead of failing with
        # "Too many connections" (redis-py 8 caps a plain pool at 100).
        self.redis = connect(
            settings.redis_url,
            REDIS_CONNECTIONS,
            REDIS_REPLY_TIMEOUT_S,
            outage_s=settings.redis_outage_s,
            socket_timeout=REDIS_REPLY_TIMEOUT_S,
        )
        self.engine: Engine | None = None
        self.job: ServedJob | None = None
        self.inflight: dict[tuple[StreamConsumer, bytes], asyncio.Task] = {}
        """The job's tasks (and held-out conversations) being worked on, by consumer and stream
        entry; the heartbeat keeps them claimed."""
        self.judge_client = JudgeClient(
            settings.judge_url,
            token=settings.judge_token,
            timeout_s=settings.judge_timeout_s,
            max_connections=settings.judge_max_connections,
            max_retries=settings.judge_max_retries,
            max_retry_wait_s=settings.judge_max_retry_wait_s,
            outage_wait_s=settings.judge_outage_s + OUTAGE_GRACE_S,
        )
        self.reward_slots = asyncio.Semaphore(settings.max_concurrent_rewards)
        self.drain_requested = asyncio.Event()
        """Set by SIGTERM or a drain request: leave the job, take no new one."""
        self.exit_after_drain = False
        self.stopping = False
        """Set when either of `run`'s loops ends: the other stops by itself at its next turn.
        Cancelling is not enough on Python 3.11: a cancel that lands inside a redis-py call
        can be swallowed there (a SIGTERMed server once heartbeated on after a Redis restart,
        and its task group never closed)."""
        self.busy_exported_s = 0.0
        """The engine's busy seconds already counted under the current job."""
        self.busy_rate = TrailingRate(window_s=60.0)

    @property
    def job_id(self) -> str:
        """The job being served; "" when idle."""
        return self.job.job_id if self.job else ""

    def health(self) -> tuple[bool, dict]:
        """Not ok once the engine died or is wedged (the server is exiting); degraded, with
        why, once the engine has produced nothing for half of `engine_stall_s`."""
        engine, stall_s = self.engine, self.settings.engine_stall_s
        stalled_s = engine.stalled_s() if engine else 0.0
        condition = {"status": "ok"}
        if stalled_s > stall_s / 2:
            condition = {"status": "degraded", "reason": f"the engine has {stall_reason(engine)}"}
        return (engine is None or not engine.dead) and stalled_s <= stall_s, {
            "server_id": self.server_id,
            "job": self.job_id,
            "version": engine.version if engine else -1,
            "inflight": len(self.inflight),
            **condition,
        }

    async def run(self) -> None:
        serve_metrics(self.settings.metrics_port, self.health)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, log_task_stacks)
        loop.add_signal_handler(signal.SIGTERM, self.request_drain, True)
        log.info("rollout server %s up: %s", self.server_id, self.settings.loggable())
        backoff_s, drained, engine_died = 1.0, False, False
        try:
            while not drained:
                started, self.stopping = time.monotonic(), False
                try:
                    async with asyncio.TaskGroup() as group:
                        for loop_ in (self.heartbeat(), self.serve_jobs()):
                            group.create_task(loop_).add_done_callback(self.stop_loops)
                except* _Drained:
                    log.info("drained; exiting")
                    drained = True
                except* EngineDied as errors:
                    log.critical(
                        "%s; exiting so that a new server takes its place (its tasks stay pending "
                        "and are taken up again)",
                        errors.exceptions[0],
                    )
                    drained = engine_died = True
                except* (RedisConnectionError, RedisTimeoutError) as errors:
                    # Redis restarting or a network blip: keep the loaded engine, start over
                    # (the job's pending tasks wait in Redis; the learner regroups weights).
                    backoff_s = 1.0 if time.monotonic() - started > 60 else min(2 * backoff_s, 30.0)
                    log.warning("Redis unreachable (%s); serving again in %.0f s", errors.exceptions[0], backoff_s)
                    await asyncio.sleep(backoff_s)
        finally:
            await self.redis.hdel(Keys.rollout_servers, self.server_id)
            await self.judge_client.aclose()
            if self.engine:
                self.engine.shutdown()
        if engine_died:
            raise SystemExit(1)  # for a supervisor to replace it (compose's restart policy, Kubernetes)

    def stop_loops(self, _: asyncio.Task) -> None:
        self.stopping = True

    def request_drain(self, then_exit: bool) -> None:
        if not self.drain_requested.is_set():
            log.info("draining (%s)", "SIGTERM: exit after" if then_exit else "drain requested")
        self.exit_after_drain |= then_exit
        self.drain_requested.set()

    async def beat(self) -> None:
        """Write this server's record in `rollout:servers` now."""
        info = protocol.ServerInfo(
            server_id=self.server_id,
            heartbeat=time.time(),
            job_id=self.job_id,
            version=self.job.synced_plan[2] if self.job and self.job.synced_plan else -1,
            capacity=self.settings.max_concurrent_tasks,
            inflight=len(self.inflight),
            engine=self.engine.model.path if self.engine else "",
            draining=self.drain_requested.is_set(),
            started=self.started,
            devices=self.engine.devices if self.engine else [],
            **self.waiting_on(),
        )
        await self.redis.hset(Keys.rollout_servers, self.server_id, protocol.encode(info))

    def waiting_on(self) -> dict:
        """What this server's episodes wait on instead of failing (a judge outage), for its record."""
        reason, since = self.judge_client.waiting_on()
        return {"waiting_on": reason, "waiting_since": since} if self.job and reason else {}

    async def heartbeat(self) -> None:
        while not self.stopping:
            if self.engine is not None:
                check_engine(self.engine, self.settings.engine_stall_s)
            if await self.redis.sismember(Keys.rollout_drain, self.server_id):
                if not self.drain_requested.is_set():
                    self.request_drain(then_exit=False)
            elif self.drain_requested.is_set() and not self.exit_after_drain:
                log.info("drain lifted; serving again")
                self.drain_requested.clear()
            await self.beat()
            if self.job and self.inflight:
                for consumer, entries in held_entries(self.inflight).items():
                    await consumer.touch(*entries)
            self.export_engine_busy()
            await asyncio.sleep(self.settings.heartbeat_s)

    def export_engine_busy(self) -> None:
        """The engine's busy seconds since the last heartbeat, and its busy share of the
        last minute, under the job being served."""
        if self.engine is None or not self.job_id:
            return
        busy_s = self.engine.busy.busy_s()
        ENGINE_BUSY.labels(self.job_id).inc(busy_s - self.busy_exported_s)
        ENGINE_BUSY_RATIO.labels(self.job_id).set(self.busy_rate.add(time.monotonic(), busy_s))
        self.busy_exported_s = busy_s

    async def serve_jobs(self) -> None:
        while not self.stopping:
            if self.drain_requested.is_set():
                if self.exit_after_drain:
                    raise _Drained
                await asyncio.sleep(0.5)  # until the drain is lifted
                continue
            running = await jobs.running_jobs(self.redis)
            if not running:
                await asyncio.sleep(0.5)
                continue
            job_id = running[0]
            try:
                spec = await jobs.job_spec(self.redis, job_id)
                if not spec.uses_rollout_servers:  # an offline job: the learner trains on a file
                    await self.wait_out(job_id)
                    continue
                rollout, held_out = await self.prepare_job(job_id, spec)
            except Exception as err:  # a model that does not load, an unknown task...
                log.exception("cannot serve job %s", job_id)
                await self.redis.hset(
                    Keys.job(job_id), "rollout_error", f"{self.server_id}: {type(err).__name__}: {err}"
                )
                await self.wait_out(job_id)  # the learner fails the job; do not retry in a loop
                continue
            await self.serve_job(job_id, spec, rollout, held_out)

    async def wait_out(self, job_id: str) -> None:
        """Until the job leaves `jobs:running` (or a drain is asked for)."""
        while job_id in await jobs.running_jobs(self.redis) and not self.drain_requested.is_set():
            await asyncio.sleep(0.5)

    async def prepare_job(self, job_id: str, spec: JobSpec) -> tuple[GroupRollout, HeldOutPlayer | None]:
        """The engine with the job's model; the job's tokenizer, task set, user and rewards,
        which turn its tasks into groups, and the player of its held-out conversations (None
        when it evaluates none)."""
        log.info("serving job %s (model %s)", job_id, spec.model.path)
        await check_sandbox(spec)
        await self.prepare_engine(spec)
        played = await assemble(
            self.engine, spec, job_id, self.judge_client, self.tool_catalog, self.settings.allow_inline_mcp
        )
        held_out = await held_out_player(played, spec, job_id, self.judge_client, self.server_id)
        return GroupRollout(
            played.runner,
            played.task_set,
            spec.reward,
            played.judge,
            self.reward_slots,
            self.server_id,
            job_id,
            generate=spec.ranked_conversations,
            seed=spec.train.seed,
            openings=spec.task.simulator_opens(),
        ), held_out

    async def serve_job(
        self, job_id: str, spec: JobSpec, rollout: GroupRollout, held_out: HeldOutPlayer | None
    ) -> None:
        capacity = self.settings.max_concurrent_tasks
        lanes = [Lane(await self.consumer(Keys.tasks(job_id), protocol.Task, job_id), capacity)]
        if held_out is not None:  # held-out conversations first, up to half the tasks: training goes on beside them
            eval_consumer = await self.consumer(Keys.eval_tasks(job_id), protocol.EvalTask, job_id)
            lanes.insert(0, Lane(eval_consumer, max(1, capacity // 2)))
        self.job = ServedJob(self, job_id, spec, lanes, rollout, held_out)
        # Engine busy time counts from here, under this job (the engine may be new).
        self.busy_exported_s, self.busy_rate = self.engine.busy.busy_s(), TrailingRate(window_s=60.0)
        try:
            await self.job.serve()
        finally:
            for task in self.inflight.values():
                task.cancel()
            self.inflight.clear()
            self.job = None
            if rollout.runner.tools is not None:
                await rollout.runner.tools.close()

    async def consumer(self, stream: str, kind: type, job_id: str) -> StreamConsumer:
        """This server in the `rollout` group of one of the job's work streams."""
        return await StreamConsumer(
            self.redis, stream, "rollout", self.server_id, kind, Keys.dead(job_id), max_deliveries=3
        ).setup()

    async def prepare_engine(self, spec: JobSpec) -> None:
        if self.engine and self.engine.model == spec.model:
            await self.engine.reload_from_disk(spec.model.path)
            return
        if self.engine:  # unset first: the heartbeat must not see a shut-down engine as dead
            engine, self.engine = self.engine, None
            engine.shutdown()
        engine = await asyncio.to_thread(
            Engine.start, spec.model, self.settings.kv_cache_gib, spec.train.seed, self.settings.memory_utilization
        )
        try:
            await engine.identify_devices()
        except BaseException:
            engine.shutdown()
            raise
        self.engine = engine

    async def wait_until_job_ends(self, job_id: str) -> None:
        while job_id in await jobs.running_jobs(self.redis):
            await asyncio.sleep(0.5)


class ServedJob:
    """One job on a server until the job leaves `jobs:running`: the weight plans that name
    the server, and the job's tasks, each turned into a group."""

    def __init__(
        self,
        server: RolloutServer,
        job_id: str,
        spec: JobSpec,
        lanes: list[Lane],
        rollout: GroupRollout,
        held_out: HeldOutPlayer | None = None,
    ) -> None:
        self.server, self.job_id, self.spec = server, job_id, spec
        self.lanes, self.rollout, self.held_out = lanes, rollout, held_out
        """Where its work comes from, read in this order: the last lane is the tasks, any
        before it the held-out conversations."""
        self.synced = asyncio.Event()
        """Set once the engine is in a weight update of this job: tasks wait for it."""
        self.synced_plan: tuple[str, int, int] | None = None
        """(learner session, epoch, version) of the last plan applied."""
        self.updating = asyncio.Lock()
        """Held while a weight update runs: a drain leaves only after it."""
        self.leaving = False
        """Set when the job ends or the drain is done: the loops below stop by themselves,
        as `run`'s do on `stopping` (a drained server once polled weight plans forever)."""

    async def serve(self) -> None:
        """Weights and tasks until the job leaves `jobs:running` or this server drains;
        leaving the group by an exception cancels both (and a failure in either one
        propagates)."""
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.follow_weights())
                consuming = group.create_task(self.consume_tasks())
                ended = asyncio.create_task(self.server.wait_until_job_ends(self.job_id))
                drain = asyncio.create_task(self.server.drain_requested.wait())
                try:
                    done, _ = await asyncio.wait([ended, drain], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiter in (ended, drain):
                        waiter.cancel()
                if ended not in done:
                    consuming.cancel()
                    await self.drain()
                self.leaving = True
                raise _JobEnded
        except* _JobEnded:
            log.info("left job %s", self.job_id)

    async def drain(self) -> None:
        """Leave the job without losing a task or stalling a broadcast (the module's
        docstring tells the steps)."""
        await self.server.beat()  # the learner leaves this server out of plans from now on
        inflight = self.server.inflight
        if inflight:
            log.info(
                "draining: %d tasks in flight, waiting up to %.0fs", len(inflight), self.server.settings.drain_timeout_s
            )
            await asyncio.wait(list(inflight.values()), timeout=self.server.settings.drain_timeout_s)
        unfinished = list(inflight)
        for task in list(inflight.values()):
            task.cancel()
        await asyncio.gather(*inflight.values(), return_exceptions=True)
        for consumer, entries in held_entries(unfinished).items():
            await consumer.release(*entries)
        TASKS.labels(self.job_id, "handed_back").inc(len(unfinished))
        # A plan the learner wrote just before it read the drain may still name this server:
        # apply it (follow_weights runs until the group ends) before leaving the group.
        await asyncio.sleep(4 * WEIGHT_POLL_S)
        async with self.updating:
            pass
        log.info("drained job %s: %d tasks handed back", self.job_id, len(unfinished))

    async def follow_weights(self) -> None:
        """Apply every weight plan that names this server, as soon as it is announced
        (polled: a pub/sub read with a timeout once let a CancelledError escape on
        Python 3.11, which ended this task silently and left the server deaf to every
        later plan while it went on heartbeating)."""
        redis = self.server.redis
        while not (self.leaving or self.server.stopping):
            plan_bytes = await redis.hget(Keys.weights(self.job_id), "plan")
            if plan_bytes:
                await self.apply_plan(plan_bytes)
            await asyncio.sleep(WEIGHT_POLL_S)

    async def apply_plan(self, plan_bytes: bytes) -> None:
        server_id = self.server.server_id
        plan = protocol.decode(plan_bytes, protocol.WeightPlan)
        key = (plan.session, plan.epoch, plan.version)
        if key == self.synced_plan or server_id not in plan.ranks:
            return
        if plan.started.get(server_id, self.server.started) != self.server.started:
            return  # made for the process this id had before a restart: the learner plans anew
        async with self.updating:
            await self.update(plan, plan_bytes, key)

    async def update(self, plan: protocol.WeightPlan, plan_bytes: bytes, key: tuple[str, int, int]) -> None:
        server_id = self.server.server_id
        started = time.perf_counter()
        try:  # bounded: a stalled update must not keep this server from the next plan
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # lands as its inner call finishes, and a job's end then never stops this loop.
            async with asyncio.timeout(plan.timeout_s * (len(plan.buckets) + 2)):
                result = await self.server.engine.update_weights(
                    plan, plan_bytes, plan.ranks[server_id], self.spec.rollout.pause_mode
                )
        except Exception:  # a missed collective: wait to be included in the next epoch
            log.exception("weight update to version %d failed", plan.version)
            self.synced_plan = key
            return
        seconds = time.perf_counter() - started
        self.synced_plan = key
        SYNC_SECONDS.labels(self.job_id).observe(seconds)
        VERSION.labels(self.job_id).set(plan.version)
        ack = protocol.WeightAck(server_id=server_id, version=plan.version, epoch=plan.epoch, seconds=seconds)
        await self.server.redis.hset(Keys.weights(self.job_id), f"ack:{server_id}", protocol.encode(ack))
        log.info("weights v%d in %.3fs (%s)", plan.version, seconds, result)
        self.synced.set()

    async def consume_tasks(self) -> None:
        """Keep up to `max_concurrent_tasks` tasks in flight, each lane within its own share:
        first this consumer's own pending entries (a restart), then new ones, then ones idle
        consumers left behind."""
        await self.synced.wait()
        settings, inflight = self.server.settings, self.server.inflight
        capacity = settings.max_concurrent_tasks
        backlog = [(lane, d) for lane in self.lanes for d in await lane.consumer.read_own_pending(lane.share)]
        last_reclaim = 0.0
        while not (self.leaving or self.server.stopping or self.server.drain_requested.is_set()):
            if len(inflight) >= capacity:
                await asyncio.wait(list(inflight.values()), return_when=asyncio.FIRST_COMPLETED)
                continue
            deliveries, backlog = backlog[: capacity - len(inflight)], backlog[capacity - len(inflight) :]
            for lane in self.lanes if not deliveries else ():
                free = room(lane, inflight, deliveries, capacity)
                if free > 0:  # the last lane (tasks) blocks briefly: the loop's only wait for work
                    block_ms = 200 if lane is self.lanes[-1] and not deliveries else None
                    deliveries += [(lane, d) for d in await lane.consumer.read(free, block_ms=block_ms)]
            if not deliveries and time.monotonic() - last_reclaim > settings.heartbeat_s:
                last_reclaim = time.monotonic()
                for lane in self.lanes:
                    free = room(lane, inflight, deliveries, capacity)
                    if free > 0:
                        idle_ms = int(settings.task_reclaim_idle_s * 1000)
                        deliveries += [(lane, d) for d in await lane.consumer.reclaim(idle_ms, free)]
            for lane, delivery in deliveries:
                key = (lane.consumer, delivery.entry_id)
                task = asyncio.create_task(self.run(lane.consumer, delivery))
                inflight[key] = task
                task.add_done_callback(lambda _, key=key: inflight.pop(key, None))
            INFLIGHT.labels(self.job_id).set(len(inflight))

    async def note_error(self, task_id: int, err: Exception) -> None:
        """Why a task failed, for the learner to name if the job stops progressing."""
        error = f"{type(err).__name__}: {err}"[:1000]
        fields = {"task": task_id, "server": self.server.server_id, "error": error}
        await self.server.redis.xadd(Keys.task_errors(self.job_id), fields, maxlen=TASK_ERRORS_KEPT, approximate=True)

    async def run(self, consumer: StreamConsumer, delivery: Delivery) -> None:
        """One entry, held-out or task, played and its outcome published, then acknowledged.
        Bad content goes to the dead-letter stream; any other failure leaves the entry pending
        for a retry (and a task's journal for the server that retries)."""
        message, started = delivery.message, time.perf_counter()
        held_out = isinstance(message, protocol.EvalTask)
        kind = "eval_" if held_out else ""
        try:
            journal = await (self.play_eval(message) if held_out else self.play_task(message, started))
            await consumer.ack(delivery.entry_id)
            if journal is not None:  # kept until the ack: a retry before it replays the same turns
                await journal.discard()
        except asyncio.CancelledError:
            raise
        except (BadTask, TokenizationMismatch) as err:  # bad content: no retry can fix it
            await consumer.dead_letter(delivery.entry_id, protocol.encode(message), str(err))
            TASKS.labels(self.job_id, f"{kind}dead").inc()
            return
        except Exception as err:
            name = f"held-out conversation {message.round}/{message.example}" if held_out else f"task {message.task_id}"
            log.exception("%s failed; it stays pending for a retry", name)
            TASKS.labels(self.job_id, f"{kind}error").inc()
            await self.note_error(-1 if held_out else message.task_id, err)
            return
        TASKS.labels(self.job_id, f"{kind}ok").inc()
        if not held_out:
            EPISODE_SECONDS.labels(self.job_id).observe(time.perf_counter() - started)

    async def play_task(self, task: protocol.Task, started: float) -> Journal:
        """The task's group into the trajectories stream; its journal, for the caller to drop
        once the task is acknowledged."""
        size = len(self.rollout.task_set)
        if not 0 <= task.example < size:
            raise BadTask(f"example {task.example} outside the task set (size {size})")
        redis, ttl_s = self.server.redis, self.server.settings.idempotency_ttl_s
        journal = await Journal.open(redis, self.job_id, task.task_id, ttl_s)
        group, view = await self.rollout.group_and_view(task, journal)
        group.elapsed_s = time.perf_counter() - started
        group.dispatched_version = task.dispatched_version
        await publish(redis, Keys.trajectories(self.job_id), group)
        if view is not None:
            await publish(redis, Keys.groups(self.job_id), view, maxlen=GROUPS_KEPT)
        return journal

    async def play_eval(self, task: protocol.EvalTask) -> None:
        """The held-out conversation's result into the job's eval results (no journal: a
        retry plays it afresh, and the learner keeps one result per example and trial)."""
        size = len(self.held_out.task)
        if not 0 <= task.example < size:
            raise BadTask(f"held-out example {task.example} outside the held-out set (size {size})")
        await publish(self.server.redis, Keys.eval_results(self.job_id), await self.held_out.play(task))


@dataclass
class Lane:
    """One of a served job's work streams: its consumer, and how many of the server's tasks
    in flight it may hold."""

    consumer: StreamConsumer
    share: int

    def held(self, inflight: dict) -> int:
        return sum(consumer is self.consumer for consumer, _ in inflight)


def room(lane: Lane, inflight: dict, starting: list, capacity: int) -> int:
    """How many more entries `lane` may take now: within the server's `capacity` and the
    lane's share, counting the entries in flight and those read this turn (`starting`)."""
    held = lane.held(inflight) + sum(other is lane for other, _ in starting)
    return min(capacity - len(inflight) - len(starting), lane.share - held)


def held_entries(keys) -> dict[StreamConsumer, list[bytes]]:
    """Entries in flight (keys of `RolloutServer.inflight`) by the consumer that holds them."""
    entries: dict[StreamConsumer, list[bytes]] = {}
    for consumer, entry_id in keys:
        entries.setdefault(consumer, []).append(entry_id)
    return entries


TASK_ERRORS_KEPT = 1000
"""Task failures a job's `task-errors` stream keeps, about (newest)."""


WEIGHT_POLL_S = 0.05
"""How often a server looks for a new weight plan (one HGET)."""


class _JobEnded(Exception):
    pass


class EngineDied(Exception):
    """The server's vLLM engine is gone; the server cannot serve again in this process."""


class EngineWedged(EngineDied):
    """The server's vLLM engine is alive but has produced nothing for `engine_stall_s` with
    requests in flight; nothing in this process brings it back."""


def check_engine(engine: Engine, stall_s: float) -> None:
    """EngineDied when the engine died, EngineWedged when it stalled past `stall_s`: the
    server's heartbeats would otherwise keep its held tasks from being reclaimed, forever."""
    if engine.dead:
        raise EngineDied(f"the inference engine of {engine.model.path} died")
    if engine.stalled_s() > stall_s:
        raise EngineWedged(
            f"the inference engine of {engine.model.path} is wedged: it has {stall_reason(engine)} "
            f"(engine_stall_s {stall_s:g} s)"
        )


def stall_reason(engine: Engine) -> str:
    unanswered = ", a pause or resume unanswered" if engine.unanswered_since is not None else ""
    return f"produced nothing for {engine.stalled_s():.0f} s with {engine.requests} requests in flight{unanswered}"


class _Drained(Exception):
    """A drain that ends in exit (SIGTERM) is complete."""


def log_task_stacks() -> None:
    """SIGUSR1: every asyncio task's stack into the log, to see what a stalled server waits on
    (`kill -USR1 <pid>`)."""
    tasks = asyncio.all_tasks()
    log.warning("SIGUSR1: %d asyncio tasks", len(tasks))
    for task in tasks:
        chain, awaited = [], task.get_coro()
        while awaited is not None and len(chain) < 20:  # the await chain, outermost first
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
            if frame is not None:
                chain.append(f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
        log.warning("task %s: %s", task.get_name(), " -> ".join(chain) or repr(task))
