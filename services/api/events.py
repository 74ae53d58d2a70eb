"""A job's server-sent events, and what keeps event streams cheap for Redis.

A stream reads the job's record, history and membership list when the job announces a
change (`jobs` publishes on `job:{id}:changed` with every status change and step record)
and every `SSE_IDLE_POLL_S` besides (membership changes are not announced), instead of
polling Redis in a tight loop. One pub/sub subscription per API process (`JobChanges`)
serves every stream, and each tenant holds at most `max_event_streams` streams at once
(`StreamSlots`, 429 above it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator

import redis.asyncio as aioredis
from fastapi import HTTPException
from redis.exceptions import RedisError

from services import jobs
from services.queues import Keys
from services.redis_values import text

log = logging.getLogger(__name__)
SSE_IDLE_POLL_S = 5.0
"""How long a stream waits for an announced change before it reads the job anyway."""
SSE_KEEPALIVE_S = 15.0
RESUBSCRIBE_S = 1.0
CHANNEL_HEAD, CHANNEL_TAIL = Keys.job_changed("\0").split("\0")
"""What comes before and after the job id in a `changed` channel's name."""


class JobChanges:
    """The API process's one subscription to every job's `changed` channel, while any event
    stream is open: it wakes the streams of the job that changed. A stream that was waiting
    while the subscription was lost is woken when it is back (it may have missed a change)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.waiting: dict[str, set[asyncio.Event]] = collections.defaultdict(set)
        self.listener: asyncio.Task | None = None

    @contextlib.contextmanager
    def watch(self, job_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever `job_id` announces a change, for as long as the block runs."""
        changed = asyncio.Event()
        self.waiting[job_id].add(changed)
        if self.listener is None or self.listener.done():
            self.listener = asyncio.create_task(self.listen())
        try:
            yield changed
        finally:
            self.waiting[job_id].discard(changed)
            if not self.waiting[job_id]:
                del self.waiting[job_id]

    async def listen(self) -> None:
        """Subscribed while any stream waits (it ends within a second of the last one)."""
        while self.waiting:
            try:
                async with self.client.pubsub() as pubsub:
                    await pubsub.psubscribe(Keys.job_changed("*"))
                    self.wake_all()
                    while self.waiting:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is not None:
                            self.wake(text(message["channel"]))
            except (RedisError, OSError) as err:
                listener = asyncio.current_task()
                if listener is not None and listener.cancelling():  # a cancel that arrived as a timeout
                    raise
                log.warning("job change subscription lost (%s); streams poll until it is back", err)
                await asyncio.sleep(RESUBSCRIBE_S)

    def wake(self, channel: str) -> None:
        job_id = channel.removeprefix(CHANNEL_HEAD).removesuffix(CHANNEL_TAIL)
        for changed in self.waiting.get(job_id, ()):
            changed.set()

    def wake_all(self) -> None:
        for waiting in self.waiting.values():
            for changed in waiting:
                changed.set()


class StreamSlots:
    """The event streams each tenant holds open in this process, at most `limit` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: collections.Counter[str] = collections.Counter()

    def take(self, tenant: str) -> None:
        """One slot for `tenant`, or a 429 when it holds `limit` already."""
        if self.held[tenant] >= self.limit:
            raise HTTPException(
                429, f"tenant {tenant!r} holds {self.limit} event streams already (TANDEM_MAX_EVENT_STREAMS)"
            )
        self.held[tenant] += 1

    async def held_by(self, tenant: str, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        """`stream`, giving the tenant's slot back when it ends or its client leaves."""
        try:
            async for event in stream:
                yield event
        finally:
            self.held[tenant] -= 1


class SentHistory:
    """Where an event stream is in a job's history: the global index of the next record to
    send, and the newest records sent (`RECENT` of them), to notice a resumed learner that
    trimmed the records after its checkpoint and wrote those steps again."""

    RECENT = 256

    def __init__(self) -> None:
        self.next_index = 0
        self.recent: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=self.RECENT)

    async def new(self, client: aioredis.Redis, job_id: str) -> list[bytes]:
        """The records not sent yet. Rewritten ones are sent again, from where the history
        parts from what was sent (or from the oldest record still remembered)."""
        first, current = await jobs.read_history(client, job_id, self.recent[-1][0] if self.recent else 0)
        if self.recent and not still_there(*self.recent[-1], first, current):
            first, current = await jobs.read_history(client, job_id, self.recent[0][0])
            while self.recent and not still_there(*self.recent[-1], first, current):
                self.next_index = self.recent.pop()[0]  # rewritten: send it again
        new = [(index, raw) for index, raw in enumerate(current, first) if index >= self.next_index]
        self.recent.extend(new)
        if new:
            self.next_index = new[-1][0] + 1
        return [raw for _, raw in new]


def still_there(index: int, raw: bytes, first: int, current: list[bytes]) -> bool:
    """Whether the record sent as `index` is unchanged in `current` (the history from global
    index `first`): dropped from the head counts as unchanged, trimmed or rewritten not."""
    position = index - first
    return position < 0 or (position < len(current) and current[position] == raw)


class JobReader:
    """What one event stream has sent of a job, and the events it has not sent yet."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self.status: str | None = None
        self.history = SentHistory()
        self.memberships = 0

    async def new_events(self) -> list[str]:
        record = await jobs.get_job(self.client, self.job_id)
        if record is None:  # its retention ran out while the stream was open
            raise jobs.NoSuchJob(f"job {self.job_id!r} has no record any more")
        events = []
        for raw in await self.client.lrange(Keys.servers(self.job_id), self.memberships, -1):
            events.append(f"event: servers\ndata: {text(raw)}\n\n")
            self.memberships += 1
        for raw in await self.history.new(self.client, self.job_id):
            events.append(f"event: step\ndata: {raw.decode()}\n\n")
            for message in json.loads(raw).get("health", []):
                events.append(f"event: health\ndata: {json.dumps({'message': message})}\n\n")
        if record["status"] != self.status:
            self.status = record["status"]
            body = {k: record.get(k) for k in ("id", "status", "step", "version", "error")}
            if self.status == jobs.JobStatus.PAUSED.value:
                body["paused_reason"] = record.get("paused_reason")
            events.append(f"event: status\ndata: {json.dumps(body)}\n\n")
        return events


async def job_events(client: aioredis.Redis, job_id: str, changes: JobChanges) -> AsyncIterator[str]:
    """The event stream of one job, until its terminal status; a keep-alive comment after
    `SSE_KEEPALIVE_S` without an event."""
    reader, last_sent = JobReader(client, job_id), time.monotonic()
    with changes.watch(job_id) as changed:
        while True:
            changed.clear()  # before reading: a change announced meanwhile wakes the next wait
            for event in await reader.new_events():
                yield event
                last_sent = time.monotonic()
            if reader.status in jobs.TERMINAL:
                return
            if time.monotonic() - last_sent >= SSE_KEEPALIVE_S:
                yield ": keep-alive\n\n"
                last_sent = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), SSE_IDLE_POLL_S)
