"""A task's policy turns, kept in Redis while the task is in flight.

When a rollout server dies mid-task, another one takes the task over from the stream
(`StreamConsumer.reclaim`) and plays its episodes again. The policy turns it replays from
here are the ones the dead server generated, so every conversation, and with it every user
simulator and judge request, comes out the same; each of those requests carries an
idempotency key naming the task, sample, future and turn, and the judge proxy answers it
from memory without calling the provider again (`judge_proxy.memory`). A turn is recorded
before the conversation goes on, so no request is ever made for a turn the journal lacks.

Entries are named by the turn's place (`task12/s3/f1/t4`: sample 3, future 1, the turn
after 4 messages), held in one hash per task (`Keys.journal`), and deleted once the task's
group is published; `ttl_s` bounds what a task nobody finishes leaves behind.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as aioredis

from rollout.engine import Generation
from services.queues import Keys

TTL_S = 6 * 3600


class Journal:
    def __init__(self, client: aioredis.Redis, key: str, recorded: dict[bytes, bytes], ttl_s: int = TTL_S) -> None:
        self.redis, self.key, self.ttl_s = client, key, ttl_s
        self.recorded = recorded
        self.replayed = 0

    @classmethod
    async def open(cls, client: aioredis.Redis, job_id: str, task_id: int) -> Journal:
        """The task's journal, with whatever an earlier server recorded in it."""
        key = Keys.journal(job_id, task_id)
        return cls(client, key, await client.hgetall(key))

    def recall(self, name: str) -> Generation | None:
        raw = self.recorded.get(name.encode())
        if raw is None:
            return None
        self.replayed += 1
        return msgspec.json.decode(raw, type=Generation)

    async def record(self, name: str, generation: Generation) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, name, msgspec.json.encode(generation))
            pipe.expire(self.key, self.ttl_s)
            await pipe.execute()

    async def discard(self) -> None:
        await self.redis.delete(self.key)
