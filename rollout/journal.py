"""A task's turns, kept in Redis while the task is in flight.

When a rollout server dies mid-task, another one takes the task over from the stream
(`StreamConsumer.reclaim`) and plays its episodes again. It takes the policy's replies and
the tools' results from here instead of generating and calling them again, so every
conversation, and with it every user simulator and judge request, comes out the same; each
of those requests carries an idempotency key naming the task, sample, future and turn, and
the judge proxy answers it from memory without calling the provider again
(`judge_proxy.memory`). A turn is recorded before the conversation goes on, so no request is
ever made for a turn the journal lacks.

Entries are named by the turn's place (`task12/s3/f1/t4`: sample 3, future 1, the turn
after 4 messages) and carry a digest of the token ids before the turn. A recorded turn is
used only where the replayed conversation reached it with the same tokens: a simulator
reply or a tool result that came out different this time (a nondeterministic tool, a
remembered reply expired or evicted) makes every later turn a miss, so the policy
generates afresh from there and trains on its own logprobs, never on another prefix's.

The entries live in one hash per task (`Keys.journal`), deleted once the task's group is
published. The hash expires `ttl_s` after its last write: the judge proxy's
`idempotency_ttl_s`, one setting read by both, so a replayed conversation does not outlive
the replies it depends on; 0 turns both off.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TypeVar

import msgspec
import redis.asyncio as aioredis

from services.queues import Keys
from services.redis_values import Value, raw, text

T = TypeVar("T")


class Entry(msgspec.Struct):
    prefix: str
    """`prefix_digest` of the token ids before the turn."""
    value: msgspec.Raw
    """The turn, JSON: a policy reply (`Generation`) or one reply's tool results."""


def prefix_digest(tokens: list[int]) -> str:
    """A digest of a sequence of token ids."""
    return hashlib.blake2b(msgspec.json.encode(tokens), digest_size=16).hexdigest()


class Journal:
    def __init__(self, client: aioredis.Redis, key: str, recorded: Mapping[Value, Value], ttl_s: float) -> None:
        self.redis, self.key, self.ttl_s = client, key, ttl_s
        self.recorded = {text(name): raw(entry) for name, entry in recorded.items()}
        """The entries an earlier server recorded (the hash as read at open), by turn name."""
        self.replayed = 0
        """Turns taken from the journal."""
        self.diverged = 0
        """Recorded turns not used because the conversation reached them with other tokens."""

    @classmethod
    async def open(cls, client: aioredis.Redis, job_id: str, task_id: int, ttl_s: float) -> Journal:
        """The task's journal, with whatever an earlier server recorded in it; one that
        keeps nothing when `ttl_s` is 0."""
        key = Keys.journal(job_id, task_id)
        return cls(client, key, await client.hgetall(key) if ttl_s > 0 else {}, ttl_s)

    def recall(self, name: str, tokens: list[int], kind: type[T]) -> T | None:
        """The turn recorded as `name` after exactly `tokens`, decoded as `kind`; None when
        there is none or it followed other tokens."""
        recorded = self.recorded.get(name)
        if recorded is None:
            return None
        entry = msgspec.json.decode(recorded, type=Entry)
        if entry.prefix != prefix_digest(tokens):
            self.diverged += 1
            return None
        self.replayed += 1
        return msgspec.json.decode(entry.value, type=kind)

    async def record(self, name: str, tokens: list[int], value: object) -> None:
        """Keep `value` as the turn `name` that followed `tokens`, replacing what was there."""
        if self.ttl_s <= 0:
            return
        entry = Entry(prefix_digest(tokens), msgspec.Raw(msgspec.json.encode(value)))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, name, msgspec.json.encode(entry))
            pipe.expire(self.key, max(1, int(self.ttl_s)))
            await pipe.execute()

    async def discard(self) -> None:
        await self.redis.delete(self.key)
