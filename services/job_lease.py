"""One learner per job: a lease with a fencing token, and the count of a job's restarts.

A learner holds a job while its lease `job:{id}:lease` lives (SET NX PX; the value names
the holder and its token). Its heartbeat renews the lease well inside the TTL; a learner
that dies, or stops for longer than the TTL (a stop-the-world pause, a frozen host), loses
it, and another learner may take the job over. Each acquisition takes a new fencing token
from the job record's `fence` field (HINCRBY, so it only grows and expires with the record).

Every write a learner makes that changes the job (its status, pause, step records and
progress: `services.jobs`) carries the token of the lease its task holds (`holding`), and
a Lua script refuses it when the record's `fence` is another one: a learner that lost its
lease can neither train the job on in the record nor fail it.

A learner that claims a job still RUNNING or PAUSED restarts it. `count_restart` counts
the restarts at the job's step: a learner that died at the same step again and again (an
OOM on one batch, a deterministic abort) ends the job instead of looping.
"""

from __future__ import annotations

import contextvars
import os
import socket
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from services.queues import Keys
from services.redis_scripts import lua

LEASE_TTL_S = 30.0
"""How long a lease lives unless renewed (`TANDEM_LEASE_TTL_S`)."""


class LeaseLost(Exception):
    """A write of the job was refused: another learner holds it now."""


@dataclass(frozen=True)
class Lease:
    job_id: str
    holder: str
    token: int

    @property
    def value(self) -> str:
        """What the lease key holds while this lease lives."""
        return f"{self.token} {self.holder}"


def holder_id() -> str:
    """This process, unique among learners (two on one host included)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def lease_key(job_id: str) -> str:
    return f"{Keys.job(job_id)}:lease"


ACQUIRE_LUA = lua("services", "lease_acquire")
RENEW_LUA = lua("services", "lease_renew")
RELEASE_LUA = lua("services", "lease_release")
RESTART_LUA = lua("services", "fence", "lease_restart")
"""The lease's scripts (`services/lua/lease_*.lua`); `fence.lua` is the check every write
under a lease makes (the jobs' scripts too)."""


async def acquire(client: aioredis.Redis, job_id: str, holder: str, ttl_s: float) -> Lease | None:
    """The job's lease for `holder`, with a new fencing token; None while another learner
    holds it (or there is no such job)."""
    token = await client.register_script(ACQUIRE_LUA)(
        keys=[lease_key(job_id), Keys.job(job_id)], args=[holder, int(ttl_s * 1000)]
    )
    return Lease(job_id, holder, int(token)) if token else None


def renew(client: redis.Redis, lease: Lease, ttl_s: float) -> bool:
    """Extend the lease by `ttl_s` (blocking: the heartbeat thread calls it); False when it
    is lost, another learner having taken the job."""
    renewed = client.register_script(RENEW_LUA)(
        keys=[lease_key(lease.job_id), Keys.job(lease.job_id)], args=[lease.value, int(ttl_s * 1000), lease.token]
    )
    return renewed == 1


async def release(client: aioredis.Redis, lease: Lease, stopped: bool = False) -> None:
    """Give the job up (a lease already lost stays the other learner's). `stopped`: this
    learner was asked to stop and left the job at a checkpoint, so the next claim is no
    restart after a crash."""
    await client.register_script(RELEASE_LUA)(
        keys=[lease_key(lease.job_id), Keys.job(lease.job_id)], args=[lease.value, int(stopped), lease.token]
    )


async def unheld(client: aioredis.Redis, job_ids: list[str]) -> list[str]:
    """Those of `job_ids` no learner holds: their learner died or stopped."""
    async with client.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.exists(lease_key(job_id))
        held = await pipe.execute()
    return [job_id for job_id, exists in zip(job_ids, held) if not exists]


async def count_restart(client: aioredis.Redis, job_id: str, last_exit: str) -> tuple[int, int]:
    """Count the claim of a job left RUNNING or PAUSED as a restart at its step (the last
    step it completed), keeping `last_exit` (how the last learner ended) in its record.
    Returns (restarts in a row at that step, the step); 0 restarts when the last learner
    stopped on request. LeaseLost when the lease this task holds is no longer the job's."""
    count = await client.register_script(RESTART_LUA)(keys=[Keys.job(job_id)], args=[fence_of(job_id), last_exit])
    if count == -1:
        raise LeaseLost(f"job {job_id}: another learner took it over")
    return int(count), int(await client.hget(Keys.job(job_id), "step") or 0)


_HELD: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("held_lease", default=None)


@contextmanager
def holding(lease: Lease):
    """Within this block (and the tasks it starts), the job writes of `services.jobs` for
    `lease.job_id` carry its token."""
    reset = _HELD.set(lease)
    try:
        yield
    finally:
        _HELD.reset(reset)


def fence_of(job_id: str) -> str:
    """The token a write of `job_id` carries here: that of the lease held, or ''."""
    lease = _HELD.get()
    return str(lease.token) if lease is not None and lease.job_id == job_id else ""
