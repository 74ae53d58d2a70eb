"""What the judge proxy remembers, in Redis, so that a call is paid for once.

Two kinds of entry, each under `Keys.judge_memory(kind, job, digest)`:
- `cache`: within a job, a request identical to an earlier one at temperature 0 (every
  verdict; chat requests that set temperature 0) gets the earlier reply. Kept
  `cache_ttl_s`; a request may opt out.
- `replay`: a request carrying `Idempotency-Key` gets the reply stored under that key and
  the body's digest, kept `idempotency_ttl_s`. Rollout servers key each simulator and judge
  call by the task, sample, future and turn it belongs to, so a server that takes over the
  episode of a killed one gets those replies again without a call upstream. The body's
  digest is in the key: a request that differs is a new call, never an old reply.

Each key is filled once across replicas: the first request marks it pending (`SET NX` with
a lease), makes the call in a task of its own and stores the reply; others wait for the
reply, or take over when the lease lapses (the replica that held it died). The call's task
outlives a client that goes away, so a reply the killed server was waiting for is still
stored for the one that takes over.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import msgspec
import redis.asyncio as aioredis

from judge_proxy import metrics
from services.queues import Keys
from services.redis_values import Value, raw

log = logging.getLogger(__name__)

PENDING = b"\x00pending"
POLL_S = 0.05
"""How often a request waiting on another's call looks for its reply."""


def digest(*parts: object) -> str:
    """A stable hash of JSON-able parts (dict keys sorted)."""
    return hashlib.sha256(msgspec.json.encode(parts, order="sorted")).hexdigest()[:40]


def _reply(value: Value | None) -> bytes | None:
    """A stored reply, or None where the entry is absent or still pending."""
    stored = None if value is None else raw(value)
    return None if stored == PENDING else stored


class Slot(NamedTuple):
    """Where one reply is remembered, and which kind of entry it is (its TTL)."""

    kind: str
    key: str


class Memory:
    def __init__(
        self, client: aioredis.Redis, cache_ttl_s: float, idempotency_ttl_s: float, pending_ttl_s: float
    ) -> None:
        self.redis = client
        self.ttl_s = {"cache": cache_ttl_s, "replay": idempotency_ttl_s}
        self.pending_ms = int(pending_ttl_s * 1000)
        self.filling: set[asyncio.Task] = set()

    def key(self, kind: str, job: str, *parts: object) -> Slot | None:
        """The entry for a request, or None when `kind` is switched off."""
        return Slot(kind, Keys.judge_memory(kind, job, digest(*parts))) if self.ttl_s[kind] > 0 else None

    def replay(self, job: str, idempotency_key: str | None, *parts: object) -> Slot | None:
        """The entry a request with an `Idempotency-Key` is replayed from (None without one)."""
        return self.key("replay", job, idempotency_key, *parts) if idempotency_key else None

    async def once(self, slot: Slot | None, job: str, compute: Callable[[], Awaitable[bytes]]) -> tuple[bytes, bool]:
        """The reply in `slot` (True: remembered), or `compute`'s, then stored."""
        if slot is None:
            return await compute(), False
        kind, key = slot
        while True:
            if await self.redis.set(key, PENDING, nx=True, px=self.pending_ms):
                metrics.MEMORY.labels(job, kind, "miss").inc()
                task = asyncio.create_task(self._fill(key, self.ttl_s[kind], compute))
                self.filling.add(task)
                task.add_done_callback(self._filled)
                return await asyncio.shield(task), False
            value = await self.redis.get(key)
            reply = _reply(value)
            if reply is not None:
                metrics.MEMORY.labels(job, kind, "hit").inc()
                return reply, True
            if value is not None:  # pending: another request is making the call
                await asyncio.sleep(POLL_S)

    async def lookup(self, slots: list[Slot]) -> list[bytes | None]:
        """Stored replies (None where absent or still pending), without waiting."""
        values = await self.redis.mget([s.key for s in slots]) if slots else []
        return [_reply(v) for v in values]

    async def store(self, items: dict[Slot, bytes]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for slot, value in items.items():
                pipe.set(slot.key, value, ex=max(1, int(self.ttl_s[slot.kind])))
            await pipe.execute()

    async def _fill(self, key: str, ttl_s: float, compute: Callable[[], Awaitable[bytes]]) -> bytes:
        try:
            value = await compute()
        except BaseException:
            await self.redis.delete(key)  # the next request for it makes the call
            raise
        await self.redis.set(key, value, ex=max(1, int(ttl_s)))
        return value

    def _filled(self, task: asyncio.Task) -> None:
        self.filling.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a remembered call failed: %s", task.exception())
