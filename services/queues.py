"""Redis keys and at-least-once stream consumption.

Every stream entry holds one msgpack message in the field `m`. A consumer reads new
entries with XREADGROUP, acknowledges them only after their effect is durable, and takes
over entries another consumer left pending (crashed, or stuck) with XAUTOCLAIM. An entry
that does not decode, or that has been delivered `max_deliveries` times without an ack,
goes to the job's dead stream with the reason and is acknowledged, so one bad message
never blocks or crashes a consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ResponseError
from redis.typing import XReadGroupResponse

from services import protocol
from services.redis_values import Value, raw, text

log = logging.getLogger(__name__)
PREFIX = "tandem:"
FIELD = b"m"
M = TypeVar("M", bound=protocol.Message)
T = TypeVar("T")


DEAD_MAXLEN = 10_000
"""A dead stream keeps about this many newest entries: a producer that only sends garbage
cannot grow Redis without bound (the dispatcher reads new dead entries at every wait, far
faster than this many arrive)."""
GROUPS_KEPT = 200
"""Training-group views (`Keys.groups`) a job keeps, about (newest): at most about 200 x 8
responses x 4 futures x a few messages of 4 kB (`rollout.group_view.TEXT_CHARS`), tens of
MB in the worst case, far less in practice."""
RELEASED_IDLE_MS = 10**10
"""The idle time (ms, about four months) a released entry claims: above any reclaim threshold."""


class Keys:
    """The Redis key layout of DESIGN.md, in one place."""

    jobs_index = PREFIX + "jobs"
    jobs_served = PREFIX + "jobs:served"
    """Tenant -> when the learner last started one of its jobs (0: never yet); every tenant
    that has submitted a job is here. The learner serves the least recently served first."""
    jobs_running = PREFIX + "jobs:running"
    rollout_servers = PREFIX + "rollout:servers"
    rollout_drain = PREFIX + "rollout:drain"
    """Ids of servers asked to drain (`tandem drain`): they leave their job and take none
    until removed from this set."""

    @staticmethod
    def jobs_queued(tenant: str) -> str:
        """The tenant's PENDING job ids by submission time: its queue (`jobs.next_pending`)."""
        return f"{PREFIX}jobs:queued:{tenant}"

    @staticmethod
    def job(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}"

    @staticmethod
    def job_changed(job_id: str) -> str:
        """Pub/sub: the job's status or history changed (what its event streams wait on)."""
        return f"{PREFIX}job:{job_id}:changed"

    @staticmethod
    def tasks(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}:tasks"

    @staticmethod
    def trajectories(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}:trajectories"

    @staticmethod
    def dead(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}:dead"

    @staticmethod
    def task_errors(job_id: str) -> str:
        """Why tasks failed on rollout servers (capped stream: task, server, error), newest last:
        what the learner names when the job stops progressing."""
        return f"{PREFIX}job:{job_id}:task-errors"

    @staticmethod
    def eval_tasks(job_id: str) -> str:
        """Held-out conversations to play (EvalTask); group `rollout`, as the tasks stream."""
        return f"{PREFIX}job:{job_id}:eval:tasks"

    @staticmethod
    def eval_results(job_id: str) -> str:
        """What each held-out conversation scored (EvalResult), read by the learner from a cursor."""
        return f"{PREFIX}job:{job_id}:eval:results"

    @staticmethod
    def eval_rounds(job_id: str) -> str:
        """Evaluation round (its step) -> JSON {version, expected, dispatched}: each round dispatched once."""
        return f"{PREFIX}job:{job_id}:eval:rounds"

    @staticmethod
    def job_spend(job_id: str) -> str:
        """What the job's LLM calls cost, by role: `usd:<role>`, `tokens:<role>`, `cached:<role>`,
        `calls:<role>` (the judge proxy's `judge_proxy.spend`)."""
        return f"{PREFIX}job:{job_id}:spend"

    @staticmethod
    def cap_holds(bill: str) -> str:
        """Calls in flight holding their most against the caps of the spend hash `bill`
        (`job_spend`, `tenant_spend`): member `<id>:<usd>:<tokens>` -> when it expires."""
        return f"{bill}:holds"

    tenant_caps = PREFIX + "tenant:caps"
    """The operator's cap on each tenant's monthly spend (`usd`, `tokens`), as the API's
    settings say (`services.tenant_spend`); the judge proxy holds calls against it."""

    @staticmethod
    def tenant_spend(tenant: str, period: str) -> str:
        """What a tenant's jobs' LLM calls cost in one calendar month (`period`, `2026-11`),
        fields as in `job_spend`."""
        return f"{PREFIX}tenant:{tenant}:spend:{period}"

    @staticmethod
    def groups(job_id: str) -> str:
        """Training groups as text (GroupView), capped to the newest few hundred: the job page's browser."""
        return f"{PREFIX}job:{job_id}:groups"

    @staticmethod
    def events(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}:events"

    @staticmethod
    def weights(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}:weights"

    @staticmethod
    def history(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}:history"

    @staticmethod
    def checkpoints(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}:checkpoints"

    @staticmethod
    def servers(job_id: str) -> str:
        """The job's rollout-server membership changes, JSON records {time, servers, joined, left}."""
        return f"{PREFIX}job:{job_id}:servers"

    @staticmethod
    def datasets(job_id: str) -> str:
        """What a generate job wrote: dataset name -> JSON {path, rows, description}."""
        return f"{PREFIX}job:{job_id}:datasets"

    @staticmethod
    def judge_budget(upstream: str) -> str:
        return f"{PREFIX}judge:budget:{upstream}"

    @staticmethod
    def judge_memory(kind: str, job_id: str, digest: str) -> str:
        """A reply the judge proxy remembers: `cache` (same temperature-0 request) or
        `replay` (same idempotency key and body)."""
        return f"{PREFIX}judge:memory:{kind}:{job_id}:{digest}"

    @staticmethod
    def judge_share(model: str) -> str:
        """Each job's share of a judge model group's budget (`judge_proxy.share`); `:asked`
        beside it says when each job last asked."""
        return f"{PREFIX}judge:share:{model}"

    upstream_index = PREFIX + "judge:upstreams"
    """Judge upstream name -> the model it serves, written by every judge proxy at start-up."""

    @staticmethod
    def upstream_health(name: str) -> str:
        """A judge upstream's health and circuit (`services.upstream_health`)."""
        return f"{PREFIX}judge:upstream:{name}"

    @staticmethod
    def journal(job_id: str, task_id: int) -> str:
        """The policy turns of a task in flight, for a server that takes the task over."""
        return f"{PREFIX}job:{job_id}:journal:{task_id}"


REDIS_OUTAGE_S = 30.0
"""How long a Redis call waits out an outage by default (`TANDEM_REDIS_OUTAGE_S`)."""
SOCKET_TIMEOUT_S = 5.0
"""The longest wait for one Redis reply. Every blocking read (XREADGROUP BLOCK) blocks for
at most a second, so a reply this late means Redis hangs: the attempt fails with a timeout
(and is retried) instead of hanging the process. Set here rather than left to redis-py,
whose default has been no timeout at all in past releases."""
CONNECT_TIMEOUT_S = 5.0
HEALTH_CHECK_INTERVAL_S = 10
"""A connection idle this long is PINGed before use, so one Redis closed meanwhile is
replaced before a command is sent on it."""


class OutageRetry(Retry):
    """Retries a call that failed on a lost connection or a timeout, with exponential
    backoff (0.1 s doubling to 2 s), until `outage_s` have passed since the call began; the
    last error then goes to the caller. Bounded by time rather than by a count, because an
    attempt costs anything from nothing (connection refused) to the socket timeout (a hung
    Redis). redis-py nests a connect's retries inside a command's, so a call gives up after
    between one and about two `outage_s`."""

    def __init__(self, outage_s: float) -> None:
        super().__init__(ExponentialBackoff(cap=2.0, base=0.05), retries=-1)
        self.outage_s = outage_s

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count: bool = False):
        deadline = time.monotonic() + self.outage_s
        failures = 0
        while True:
            try:
                return await do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                await (fail(error, failures) if with_failure_count else fail(error))
                pause = self._backoff.compute(failures)
                if time.monotonic() + pause > deadline:
                    raise
                await asyncio.sleep(pause)


def connect(
    url: str, max_connections: int, wait_s: float, outage_s: float = REDIS_OUTAGE_S, **options
) -> aioredis.Redis:
    """An asyncio Redis client whose pool blocks: a caller finding all `max_connections` in
    use waits up to `wait_s` for one, instead of failing with "Too many connections" (what a
    plain pool does, capped at 100 by redis-py 8). Its calls time out (`SOCKET_TIMEOUT_S`)
    rather than hang, and wait out an outage of up to `outage_s` (Redis restarting, a network
    blip) rather than fail. `options` go to each connection and override those defaults."""
    options = {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "retry": OutageRetry(outage_s),
    } | options
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=wait_s, **options)
    return aioredis.Redis(connection_pool=pool)


REDIS_FULL_RETRY_S = 5.0
"""How often a write Redis refused at its memory cap is tried again (`when_redis_has_room`)."""


def refused_for_memory(error: BaseException) -> bool:
    """Whether Redis refused a write for being at its memory cap (`maxmemory`, nothing left
    to evict): as a command's error, or inside a script (Redis 6 wraps it in a script error)."""
    return isinstance(error, ResponseError) and "command not allowed when used memory > 'maxmemory'" in str(error)


async def when_redis_has_room(write: Callable[[], Awaitable[T]], what: str) -> T:
    """`write()`, tried again every `REDIS_FULL_RETRY_S` for as long as Redis refuses it at
    its memory cap (a refused command or script wrote nothing, so trying again is safe). For
    what a process must record before it goes on (a job's end): it waits for room, saying
    so in its log, rather than crash and be restarted into the same refusal."""
    while True:
        try:
            return await write()
        except ResponseError as error:
            if not refused_for_memory(error):
                raise
            log.error("Redis is full (maxmemory) and refused %s; trying again in %.0f s", what, REDIS_FULL_RETRY_S)
        await asyncio.sleep(REDIS_FULL_RETRY_S)


@dataclass
class Delivery(Generic[M]):
    entry_id: bytes
    message: M


Entry = tuple[Value, Mapping[Value, Value]]
"""A stream entry as a read gives it: its id and its fields."""


def _entries_read(reply: XReadGroupResponse) -> list[Entry]:
    """The entries of an XREADGROUP on one stream: in RESP2, which `connect`'s clients
    speak, `[[stream, entries]]`, or empty when none came."""
    if isinstance(reply, dict):
        raise TypeError("XREADGROUP replied in RESP3; Tandem's Redis clients speak RESP2 (`queues.connect`)")
    return reply[0][1] if reply else []


async def publish(client: aioredis.Redis, stream: str, message: msgspec.Struct, maxlen: int | None = None) -> bytes:
    """Append `message` to `stream`; with `maxlen`, the stream keeps about that many newest."""
    return raw(await client.xadd(stream, {FIELD: protocol.encode(message)}, maxlen=maxlen, approximate=True))


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise


class StreamConsumer(Generic[M]):
    """One consumer in a consumer group, decoding entries into `kind` messages."""

    def __init__(
        self,
        client: aioredis.Redis,
        stream: str,
        group: str,
        consumer: str,
        kind: type[M],
        dead_stream: str,
        max_deliveries: int = 3,
    ) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.kind = kind
        self.dead_stream = dead_stream
        self.max_deliveries = max_deliveries
        self.reclaim_cursor = "0-0"
        """Where the next `reclaim` scan of the pending list starts."""

    async def setup(self) -> StreamConsumer[M]:
        await ensure_group(self.client, self.stream, self.group)
        return self

    async def read(self, count: int, block_ms: int | None = None) -> list[Delivery[M]]:
        """New entries for this consumer; blocks up to `block_ms` when there are none
        (keep it well under the client's socket timeout, `SOCKET_TIMEOUT_S`)."""
        reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        return await self._decode(_entries_read(reply))

    async def own_pending_count(self) -> int:
        """Entries delivered to this consumer name and not acknowledged."""
        summary = await self.client.xpending(self.stream, self.group)
        return sum(c["pending"] for c in summary["consumers"] if text(c["name"]) == self.consumer)

    async def read_own_pending(self, count: int) -> list[Delivery[M]]:
        """Entries delivered to this consumer name before and never acknowledged (restart)."""
        reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=count)
        entries = _entries_read(reply)
        ids = [entry_id for entry_id, _ in entries]
        return await self._decode(await self._drop_overdelivered(entries, ids))

    async def reclaim(self, min_idle_ms: int, count: int) -> list[Delivery[M]]:
        """Take over entries other consumers left pending for at least `min_idle_ms`. Each
        call goes on where the last one stopped (Redis 7 scans at most 10 x `count` pending
        entries per call, so restarting at 0-0 would never reach idle entries queued behind
        many live ones); the scan wraps around at the end of the list."""
        reply = await self.client.xautoclaim(
            self.stream, self.group, self.consumer, min_idle_ms, start_id=self.reclaim_cursor, count=count
        )
        self.reclaim_cursor = text(reply[0])
        entries: list[Entry] = [(entry_id, fields) for entry_id, fields in reply[1] if fields]
        ids = [entry_id for entry_id, _ in entries]
        return await self._decode(await self._drop_overdelivered(entries, ids))

    async def touch(self, *entry_ids: bytes) -> None:
        """Reset the idle time of entries this consumer is still working on, so `reclaim`
        elsewhere only takes work from consumers that stopped (JUSTID: no delivery count)."""
        if entry_ids:
            await self.client.xclaim(self.stream, self.group, self.consumer, 0, list(entry_ids), justid=True)

    async def release(self, *entry_ids: bytes) -> None:
        """Hand entries this consumer holds back to the group: they stay pending, with an
        idle time so long that the next `reclaim` anywhere takes them over at once."""
        if entry_ids:
            await self.client.xclaim(
                self.stream, self.group, self.consumer, 0, list(entry_ids), idle=RELEASED_IDLE_MS, justid=True
            )

    async def ack(self, *entry_ids: bytes) -> None:
        if entry_ids:
            await self.client.xack(self.stream, self.group, *entry_ids)

    async def dead_letter(self, entry_id: bytes, data: bytes, reason: str) -> None:
        log.warning("dead-lettering %s %s: %s", self.stream, entry_id, reason)
        await self.client.xadd(
            self.dead_stream,
            {
                b"stream": self.stream,
                b"entry_id": entry_id,
                b"reason": reason[:2000],
                b"consumer": self.consumer,
                b"time": str(time.time()),
                FIELD: data,
            },
            maxlen=DEAD_MAXLEN,
            approximate=True,
        )
        await self.ack(entry_id)

    async def _decode(self, entries: list[Entry]) -> list[Delivery[M]]:
        deliveries = []
        for entry_id, fields in entries:
            data = raw(fields.get(FIELD, b""))
            try:
                deliveries.append(Delivery(raw(entry_id), protocol.decode(data, self.kind)))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
                await self.dead_letter(raw(entry_id), data, f"{type(err).__name__}: {err}")
        return deliveries

    async def _drop_overdelivered(self, entries: list[Entry], ids: list[Value]) -> list[Entry]:
        if not ids:
            return entries
        counts = await self._delivery_counts(ids)
        kept = []
        for entry_id, fields in entries:
            delivered = counts.get(entry_id, 0)
            if delivered > self.max_deliveries:
                reason = f"delivered {delivered} times without an ack (max {self.max_deliveries})"
                await self.dead_letter(raw(entry_id), raw(fields.get(FIELD, b"")), reason)
            else:
                kept.append((entry_id, fields))
        return kept

    async def _delivery_counts(self, ids: list[Value]) -> dict[Value, int]:
        async with self.client.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
            replies = await pipe.execute()
        return {p["message_id"]: p["times_delivered"] for reply in replies for p in reply}
