"""One job on a rollout server, from the moment the server takes it up until the job ends or
the server drains: the weight plans that name the server (`Weights`), the job's work streams
read within the server's capacity (`ServedJob`), and each entry played: a task turned into a
group, a held-out conversation into a result (`Work`).

A served job knows its server only through `Host`: its id and start time, Redis, its
settings, the engine, and whether it is draining or stopping.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram
from redis.typing import EncodableT, FieldT

from rollout.engine import Engine
from rollout.evaluate import HeldOutPlayer
from rollout.group import GroupRollout
from rollout.journal import Journal
from services import jobs, protocol
from services.config import JobSpec, RolloutSettings
from services.queues import GROUPS_KEPT, Delivery, Keys, StreamConsumer, publish
from services.redis_values import raw
from services.tokenization import TokenizationMismatch

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
VERSION = Gauge("tandem_rollout_weight_version", "Weight version served", ["job"])
TASK_ERRORS_KEPT = 1000
"""Task failures a job's `task-errors` stream keeps, about (newest)."""
WEIGHT_POLL_S = 0.05
"""How often a server looks for a new weight plan (one HGET)."""


class BadTask(ValueError):
    """A task message whose content no retry can fix; it goes to the dead-letter stream."""


class Host(Protocol):
    """What a served job uses of its server (`rollout.server.RolloutServer`)."""

    server_id: str
    started: float
    """When the server's process started: a weight plan made for an earlier process of the
    same id is not for this one."""
    redis: aioredis.Redis
    settings: RolloutSettings
    drain_requested: asyncio.Event
    stopping: bool

    @property
    def engine(self) -> Engine | None: ...

    async def beat(self) -> None: ...


async def wait_until_ended(redis: aioredis.Redis, job_id: str, stop: Callable[[], bool] = lambda: False) -> None:
    """Until the job leaves `jobs:running`, or `stop()` holds."""
    while job_id in await jobs.running_jobs(redis) and not stop():
        await asyncio.sleep(0.5)


class Weights:
    """The weight plans of one job that name this server, applied as soon as they are
    announced: the engine pauses, takes the broadcast and resumes."""

    def __init__(self, host: Host, job_id: str, spec: JobSpec) -> None:
        self.host, self.job_id, self.spec = host, job_id, spec
        self.synced = asyncio.Event()
        """Set once the engine is in a weight update of this job: tasks wait for it."""
        self.synced_plan: tuple[str, int, int] | None = None
        """(learner session, epoch, version) of the last plan applied."""
        self.updating = asyncio.Lock()
        """Held while a weight update runs: a drain leaves only after it."""

    async def follow(self, leaving: Callable[[], bool]) -> None:
        """Apply every plan that names this server until `leaving()` holds. Polled: a pub/sub
        read with a timeout can let a CancelledError escape on Python 3.11, which would end
        this task silently and leave the server deaf to every later plan."""
        while not (leaving() or self.host.stopping):
            plan_bytes = await self.host.redis.hget(Keys.weights(self.job_id), "plan")
            if plan_bytes:
                await self.apply(raw(plan_bytes))
            await asyncio.sleep(WEIGHT_POLL_S)

    async def apply(self, plan_bytes: bytes) -> None:
        server_id = self.host.server_id
        plan = protocol.decode(plan_bytes, protocol.WeightPlan)
        key = (plan.session, plan.epoch, plan.version)
        if key == self.synced_plan or server_id not in plan.ranks:
            return
        if plan.started.get(server_id, self.host.started) != self.host.started:
            return  # made for the process this id had before a restart: the learner plans anew
        async with self.updating:
            await self.update(plan, plan_bytes, key)

    async def update(self, plan: protocol.WeightPlan, plan_bytes: bytes, key: tuple[str, int, int]) -> None:
        server_id, started = self.host.server_id, time.perf_counter()
        try:  # bounded: a stalled update must not keep this server from the next plan
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # lands as its inner call finishes, and a job's end then never stops this loop.
            engine = self.host.engine
            if engine is None:
                raise RuntimeError("no engine to take the weights: the job's model is not loaded")
            async with asyncio.timeout(plan.timeout_s * (len(plan.buckets) + 2)):
                result = await engine.update_weights(
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
        await self.host.redis.hset(Keys.weights(self.job_id), f"ack:{server_id}", protocol.encode(ack))
        log.info("weights v%d in %.3fs (%s)", plan.version, seconds, result)
        self.synced.set()


@dataclass
class Lane:
    """One of a served job's work streams: its consumer, and how many of the server's tasks
    in flight it may hold."""

    consumer: StreamConsumer
    share: int

    def held(self, inflight: dict) -> int:
        return sum(consumer is self.consumer for consumer, _ in inflight)


async def job_lanes(redis: aioredis.Redis, server_id: str, job_id: str, capacity: int, held_out: bool) -> list[Lane]:
    """The server's lanes on a job's work streams, in the `rollout` group: the tasks, and
    with `held_out` its held-out conversations first, up to half the capacity (training
    goes on beside them)."""

    async def consumer(stream: str, kind: type) -> StreamConsumer:
        return await StreamConsumer(
            redis, stream, "rollout", server_id, kind, Keys.dead(job_id), max_deliveries=3
        ).setup()

    lanes = [Lane(await consumer(Keys.tasks(job_id), protocol.Task), capacity)]
    if held_out:
        lanes.insert(0, Lane(await consumer(Keys.eval_tasks(job_id), protocol.EvalTask), max(1, capacity // 2)))
    return lanes


def room(lane: Lane, inflight: dict, starting: list, capacity: int) -> int:
    """How many more entries `lane` may take now: within the server's `capacity` and the
    lane's share, counting the entries in flight and those read this turn (`starting`)."""
    held = lane.held(inflight) + sum(other is lane for other, _ in starting)
    return min(capacity - len(inflight) - len(starting), lane.share - held)


def held_entries(keys) -> dict[StreamConsumer, list[bytes]]:
    """Entries in flight (keys of `ServedJob.inflight`) by the consumer that holds them."""
    entries: dict[StreamConsumer, list[bytes]] = {}
    for consumer, entry_id in keys:
        entries.setdefault(consumer, []).append(entry_id)
    return entries


class ServedJob:
    """One job on a server until the job leaves `jobs:running` or the server drains: its
    weight plans (`weights`), and its work streams (`lanes`), each entry played in a task of
    its own and kept in `inflight` until it is published and acknowledged."""

    def __init__(
        self,
        host: Host,
        job_id: str,
        spec: JobSpec,
        lanes: list[Lane],
        rollout: GroupRollout,
        held_out: HeldOutPlayer | None = None,
    ) -> None:
        self.host, self.job_id, self.spec = host, job_id, spec
        self.lanes, self.rollout, self.held_out = lanes, rollout, held_out
        """Where its work comes from, read in this order: the last lane is the tasks, any
        before it the held-out conversations."""
        self.weights = Weights(host, job_id, spec)
        self.work = Work(host, job_id, rollout, held_out)
        self.inflight: dict[tuple[StreamConsumer, bytes], asyncio.Task] = {}
        """The entries being worked on, by consumer and stream entry; the server's
        heartbeat keeps them claimed."""
        self.leaving = False
        """Set when the job ends or the drain is done: the loops below stop by themselves,
        as the server's do on `stopping`."""

    async def serve(self) -> None:
        """Weights and work until the job leaves `jobs:running` or the server drains; leaving
        the group by an exception cancels both (and a failure in either one propagates).
        Whatever is still in flight is cancelled on the way out."""
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.weights.follow(lambda: self.leaving))
                consuming = group.create_task(self.consume())
                ended = asyncio.create_task(wait_until_ended(self.host.redis, self.job_id))
                drain = asyncio.create_task(self.host.drain_requested.wait())
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
        finally:
            for task in self.inflight.values():
                task.cancel()
            self.inflight.clear()
            if self.rollout.runner.tools is not None:
                await self.rollout.runner.tools.close()

    async def drain(self) -> None:
        """Leave the job without losing a task or stalling a broadcast (`rollout.server`'s
        docstring tells the steps)."""
        await self.host.beat()  # the learner leaves this server out of plans from now on
        timeout_s, inflight = self.host.settings.drain_timeout_s, self.inflight
        if inflight:
            log.info("draining: %d tasks in flight, waiting up to %.0fs", len(inflight), timeout_s)
            await asyncio.wait(list(inflight.values()), timeout=timeout_s)
        unfinished = list(inflight)
        for task in list(inflight.values()):
            task.cancel()
        await asyncio.gather(*inflight.values(), return_exceptions=True)
        for consumer, entries in held_entries(unfinished).items():
            await consumer.release(*entries)
        TASKS.labels(self.job_id, "handed_back").inc(len(unfinished))
        # A plan the learner wrote just before it read the drain may still name this server:
        # apply it (the weights loop runs until the group ends) before leaving the group.
        await asyncio.sleep(4 * WEIGHT_POLL_S)
        async with self.weights.updating:
            pass
        log.info("drained job %s: %d tasks handed back", self.job_id, len(unfinished))

    async def consume(self) -> None:
        """Keep up to `max_concurrent_tasks` entries in flight, each lane within its own share:
        first this consumer's own pending entries (a restart), then new ones, then ones idle
        consumers left behind."""
        await self.weights.synced.wait()
        capacity, inflight = self.host.settings.max_concurrent_tasks, self.inflight
        backlog = [(lane, d) for lane in self.lanes for d in await lane.consumer.read_own_pending(lane.share)]
        reclaimed_at = 0.0
        while not (self.leaving or self.host.stopping or self.host.drain_requested.is_set()):
            if len(inflight) >= capacity:
                await asyncio.wait(list(inflight.values()), return_when=asyncio.FIRST_COMPLETED)
                continue
            deliveries, backlog = backlog[: capacity - len(inflight)], backlog[capacity - len(inflight) :]
            if not deliveries:
                deliveries = await self.read_new(capacity)
            if not deliveries and time.monotonic() - reclaimed_at > self.host.settings.heartbeat_s:
                reclaimed_at = time.monotonic()
                deliveries = await self.reclaim(capacity)
            for lane, delivery in deliveries:
                key = (lane.consumer, delivery.entry_id)
                task = asyncio.create_task(self.work.run(lane.consumer, delivery))
                inflight[key] = task
                task.add_done_callback(functools.partial(self.forget, key))
            INFLIGHT.labels(self.job_id).set(len(inflight))

    def forget(self, key: tuple[StreamConsumer, bytes], _: asyncio.Task) -> None:
        """A finished entry's task leaves `inflight` (a done callback)."""
        self.inflight.pop(key, None)

    async def read_new(self, capacity: int) -> list[tuple[Lane, Delivery]]:
        """New entries for each lane with room; the last lane (tasks) blocks briefly when
        nothing else came: the loop's only wait for work."""
        deliveries: list[tuple[Lane, Delivery]] = []
        for lane in self.lanes:
            free = room(lane, self.inflight, deliveries, capacity)
            if free > 0:
                block_ms = 200 if lane is self.lanes[-1] and not deliveries else None
                deliveries += [(lane, d) for d in await lane.consumer.read(free, block_ms=block_ms)]
        return deliveries

    async def reclaim(self, capacity: int) -> list[tuple[Lane, Delivery]]:
        """Entries other consumers have held idle past `task_reclaim_idle_s`, for each lane with room."""
        deliveries: list[tuple[Lane, Delivery]] = []
        idle_ms = int(self.host.settings.task_reclaim_idle_s * 1000)
        for lane in self.lanes:
            free = room(lane, self.inflight, deliveries, capacity)
            if free > 0:
                deliveries += [(lane, d) for d in await lane.consumer.reclaim(idle_ms, free)]
        return deliveries


class Work:
    """What one entry of a served job's streams becomes: a task's group (and its view for the
    job page) published, a held-out conversation's result published, or, for content no
    retry can fix, a dead letter."""

    def __init__(self, host: Host, job_id: str, rollout: GroupRollout, held_out: HeldOutPlayer | None) -> None:
        self.host, self.job_id, self.rollout, self.held_out = host, job_id, rollout, held_out

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

    async def note_error(self, task_id: int, err: Exception) -> None:
        """Why a task failed, for the learner to name if the job stops progressing."""
        error = f"{type(err).__name__}: {err}"[:1000]
        fields: dict[FieldT, EncodableT] = {"task": task_id, "server": self.host.server_id, "error": error}
        await self.host.redis.xadd(Keys.task_errors(self.job_id), fields, maxlen=TASK_ERRORS_KEPT, approximate=True)

    async def play_task(self, task: protocol.Task, started: float) -> Journal:
        """The task's group into the trajectories stream; its journal, for the caller to drop
        once the task is acknowledged."""
        size = len(self.rollout.task_set)
        if not 0 <= task.example < size:
            raise BadTask(f"example {task.example} outside the task set (size {size})")
        redis, ttl_s = self.host.redis, self.host.settings.idempotency_ttl_s
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
        if self.held_out is None:  # its lane is read only with a player (`job_lanes`)
            raise RuntimeError("a held-out conversation for a job this server evaluates nothing of")
        size = len(self.held_out.task)
        if not 0 <= task.example < size:
            raise BadTask(f"held-out example {task.example} outside the held-out set (size {size})")
        await publish(self.host.redis, Keys.eval_results(self.job_id), await self.held_out.play(task))


class _JobEnded(Exception):
    pass
