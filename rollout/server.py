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
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollout.assembly import assemble, check_sandbox, group_rollout, held_out_player
from rollout.engine import Engine
from rollout.engine_slot import EngineDied, EngineSlot
from rollout.evaluate import HeldOutPlayer
from rollout.group import GroupRollout
from rollout.served_job import ServedJob, held_entries, job_lanes, wait_until_ended
from services import jobs, protocol
from services.config import JobSpec, RolloutSettings
from services.judge_client import JudgeClient
from services.metrics import serve_metrics
from services.queues import Keys, connect
from services.tool_catalog import load_catalog

log = logging.getLogger(__name__)

REDIS_CONNECTIONS = 64
"""Redis connections per rollout server; more callers wait for one."""
REDIS_REPLY_TIMEOUT_S = 30.0
"""The longest wait for any Redis reply. Every blocking read here blocks for well under a
second, so a reply this late is lost: the wait ends in a TimeoutError, which `run` treats
as an outage (serve again), instead of a silent hang (a blocking XREADGROUP that never
returns would hold a server between two jobs, its task group unable to finish)."""


OUTAGE_GRACE_S = 60.0
"""How much longer than the learner's `judge_outage_s` a judge call waits out an outage:
the learner fails the job with the outage as its reason before any task fails of it."""


class RolloutServer:
    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.server_id = settings.server_id or f"{socket.gethostname()}-{os.getpid()}"
        self.started = time.time()
        self.tool_catalog = load_catalog(settings.tool_catalog)
        self.redis = rollout_redis(settings)
        self.slot = EngineSlot(settings)
        self.job: ServedJob | None = None
        self.judge_client = rollout_judge_client(settings)
        self.reward_slots = asyncio.Semaphore(settings.max_concurrent_rewards)
        self.drain_requested = asyncio.Event()
        """Set by SIGTERM or a drain request: leave the job, take no new one."""
        self.exit_after_drain = False
        self.stopping = False
        """Set when either of `run`'s loops ends: the other stops by itself at its next turn.
        Cancelling is not enough on Python 3.11: a cancel that lands inside a redis-py call
        can be swallowed there, and the loop would go on (heartbeating for a server that is
        gone) with its task group never closing."""

    @property
    def job_id(self) -> str:
        """The job being served; "" when idle."""
        return self.job.job_id if self.job else ""

    @property
    def engine(self) -> Engine | None:
        return self.slot.engine

    @property
    def inflight(self) -> dict:
        """The job's tasks (and held-out conversations) being worked on (`ServedJob.inflight`)."""
        return self.job.inflight if self.job else {}

    def health(self) -> tuple[bool, dict]:
        """The engine's condition (`EngineSlot.condition`: not ok once it died or is wedged,
        and the server is exiting), with the job and its tasks in flight."""
        ok, condition = self.slot.condition()
        return ok, {"server_id": self.server_id, "job": self.job_id, "inflight": len(self.inflight)} | condition

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
            self.slot.shutdown()
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
            version=self.job.weights.synced_plan[2] if self.job and self.job.weights.synced_plan else -1,
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
            self.slot.check()
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
            self.slot.export_busy(self.job_id)
            await asyncio.sleep(self.settings.heartbeat_s)

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
        await wait_until_ended(self.redis, job_id, self.drain_requested.is_set)

    async def prepare_job(self, job_id: str, spec: JobSpec) -> tuple[GroupRollout, HeldOutPlayer | None]:
        """The engine with the job's model; the job's tokenizer, task set, user and rewards,
        which turn its tasks into groups, and the player of its held-out conversations (None
        when it evaluates none)."""
        log.info("serving job %s (model %s)", job_id, spec.model.path)
        await check_sandbox(spec)
        engine = await self.slot.load(spec)
        played = await assemble(
            engine, spec, job_id, self.judge_client, self.tool_catalog, self.settings.allow_inline_mcp
        )
        held_out = (
            await held_out_player(played, spec, job_id, self.judge_client, self.server_id)
            if spec.evaluation() is not None
            else None
        )
        return group_rollout(played, spec, job_id, self.reward_slots, self.server_id), held_out

    async def serve_job(
        self, job_id: str, spec: JobSpec, rollout: GroupRollout, held_out: HeldOutPlayer | None
    ) -> None:
        lanes = await job_lanes(
            self.redis, self.server_id, job_id, self.settings.max_concurrent_tasks, held_out is not None
        )
        self.job = ServedJob(self, job_id, spec, lanes, rollout, held_out)
        self.slot.count_from_now()
        try:
            await self.job.serve()
        finally:
            self.job = None


def rollout_redis(settings: RolloutSettings) -> aioredis.Redis:
    """A blocking pool: with futures in flight, hundreds of coroutines touch Redis at once
    (journal, streams); they wait for a free connection instead of failing with "Too many
    connections" (redis-py 8 caps a plain pool at 100)."""
    return connect(
        settings.redis_url,
        REDIS_CONNECTIONS,
        REDIS_REPLY_TIMEOUT_S,
        outage_s=settings.redis_outage_s,
        socket_timeout=REDIS_REPLY_TIMEOUT_S,
    )


def rollout_judge_client(settings: RolloutSettings) -> JudgeClient:
    """The client of every LLM call the server's episodes make (through the judge proxy);
    an outage is waited out `OUTAGE_GRACE_S` longer than the learner waits for it."""
    return JudgeClient(
        settings.judge_url,
        token=settings.judge_token,
        timeout_s=settings.judge_timeout_s,
        max_connections=settings.judge_max_connections,
        max_retries=settings.judge_max_retries,
        max_retry_wait_s=settings.judge_max_retry_wait_s,
        outage_wait_s=settings.judge_outage_s + OUTAGE_GRACE_S,
    )


class _Drained(Exception):
    """A drain that ends in exit (SIGTERM) is complete."""


def log_task_stacks() -> None:
    """SIGUSR1: every asyncio task's stack into the log, to see what a stalled server waits on
    (`kill -USR1 <pid>`)."""
    tasks = asyncio.all_tasks()
    log.warning("SIGUSR1: %d asyncio tasks", len(tasks))
    for task in tasks:
        chain: list[str] = []
        awaited: object = task.get_coro()  # walked by the attributes coroutines and generators have
        while awaited is not None and len(chain) < 20:  # the await chain, outermost first
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
            if frame is not None:
                chain.append(f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
        log.warning("task %s: %s", task.get_name(), " -> ".join(chain) or repr(task))
