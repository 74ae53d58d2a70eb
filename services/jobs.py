"""Job records in Redis (`job:{id}` hashes) and their lifecycle.

PENDING -> RUNNING <-> PAUSED -> SUCCEEDED | FAILED | CANCELLED. The API creates a record
and queues the id on its tenant's queue (`jobs:queued:{tenant}`, at most `max_pending` of
them); the learner picks the next job tenant by tenant (`next_pending`), claims it, moves it
to RUNNING (and into the `jobs:running` set rollout servers watch), writes progress after
every step, and ends it. A job still PENDING after `pending_ttl_s` ends FAILED, expired.
A job whose progress waits on something outside it (a judge upstream that is down, no
rollout server) is PAUSED with `paused_reason` and `paused_since` (`learner.watchdog`); it
stays in `jobs:running`, so its servers keep their tasks, and goes back to RUNNING by
itself when what it waited on is back. A FAILED or CANCELLED job that recorded a checkpoint,
or one a spend cap ended, can be resumed (`resume`, with a raised cap): PENDING again on its
tenant's queue, it is claimed like any other and continued from its newest complete
checkpoint.
"""

from __future__ import annotations

import enum
import json
import re
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.typing import ZSetRangeResponse

from services import bills, job_lease
from services.config import JOB_NAME, BudgetSpec, JobSpec, parse_job_spec_json
from services.queues import Keys
from services.redis_scripts import lua
from services.redis_values import Value, text, text_fields

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
RETENTION_S = 7 * 86400.0
"""How long an ended job's keys stay in Redis by default (`TANDEM_JOB_RETENTION_S`)."""
JOB_ID = re.compile(rf"{JOB_NAME}-[0-9a-f]{{8}}")
"""The ids `create_job` makes: the spec's name, a dash, 8 hex digits.
No ':' can occur, so an id never names a job's sub-key (`job:{id}:tasks`, ...)."""


class JobStatus(str, enum.Enum):  # noqa: UP042 (StrEnum formats differently; kept as is)
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class QueueFull(Exception):
    """The tenant has `max_pending` jobs queued already."""


class NoSuchJob(LookupError):
    """No record holds the job: it never existed, or it ended and expired after its retention."""


CREATE_LUA = lua("services", "job_create")


async def create_job(client: aioredis.Redis, spec: JobSpec, tenant: str = "", max_pending: int = sys.maxsize) -> str:
    """A new PENDING job on `tenant`'s queue; QueueFull when `max_pending` are queued there."""
    job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}"
    now = time.time()
    record: dict[str, str | float] = {
        "id": job_id,
        "name": spec.name,
        "tenant": tenant,
        "spec": spec.model_dump_json(),
        "status": JobStatus.PENDING.value,
        "created": now,
        "version": 0,
        "step": 0,
    }
    created = await client.register_script(CREATE_LUA)(
        keys=[Keys.job(job_id), Keys.jobs_index, Keys.jobs_queued(tenant), Keys.jobs_served],
        args=[job_id, now, max_pending, tenant, *[item for pair in record.items() for item in pair]],
    )
    if not created:
        raise QueueFull(f"tenant {tenant!r} has {max_pending} jobs pending already (TANDEM_MAX_PENDING_JOBS)")
    return job_id


def _members(reply: ZSetRangeResponse) -> list[str]:
    """The members of a sorted-set range read without scores, as text (redis-py types every
    range as one that may hold scores)."""
    return [text(member) for member in reply if isinstance(member, (bytes, str))]


async def expire_pending(
    client: aioredis.Redis, tenants: Iterable[str], ttl_s: float, retention_s: float = RETENTION_S
) -> None:
    """End FAILED, with the reason, each of the tenants' jobs still PENDING `ttl_s` after it
    was submitted (one the learner claimed meanwhile is left alone)."""
    reason = f"expired in the queue: still PENDING {ttl_s:.0f}s after it was submitted (TANDEM_PENDING_TTL_S)"
    for tenant in tenants:
        for job_id in _members(await client.zrangebyscore(Keys.jobs_queued(tenant), "-inf", time.time() - ttl_s)):
            await set_status(client, job_id, JobStatus.FAILED, reason, retention_s, only_from=JobStatus.PENDING)


async def next_pending(client: aioredis.Redis, ttl_s: float, retention_s: float = RETENTION_S) -> str | None:
    """The PENDING job to start next, after expiring those older than `ttl_s`: the oldest job
    of the tenant the learner served least recently (never served first, then the one whose
    job waited longer). So each tenant with a job queued gets its turn, however many jobs
    another has queued."""
    served = {text(tenant): float(at) for tenant, at in (await client.hgetall(Keys.jobs_served)).items()}
    await expire_pending(client, served, ttl_s, retention_s)
    async with client.pipeline(transaction=False) as pipe:
        for tenant in served:
            pipe.zrange(Keys.jobs_queued(tenant), 0, 0, withscores=True)
        heads = await pipe.execute()
    waiting = [(at, head[0][1], text(head[0][0])) for at, head in zip(served.values(), heads) if head]
    return min(waiting)[2] if waiting else None


LEARNER_BEAT_S = 5.0
"""How often the learner running a job writes its `learner_seen`."""
LEARNER_SILENT_S = 30.0
"""A RUNNING or PAUSED job whose learner was not heard from for this long says so."""


def learner_silence(record: dict, now: float) -> str | None:
    """Why nobody moves a RUNNING or PAUSED job, when its learner has gone silent (died, or
    was never restarted: nothing else writes the record); None while it beats."""
    if record["status"] not in ("RUNNING", "PAUSED"):
        return None
    seen = float(record.get("learner_seen") or record.get("started") or now)
    if now - seen <= LEARNER_SILENT_S:
        return None
    return (
        f"the learner has not been heard from for {now - seen:.0f}s: it is down or was not restarted "
        "(`tandem learner --resume` continues the job from its last checkpoint)"
    )


def is_job_id(job_id: str) -> bool:
    return JOB_ID.fullmatch(job_id) is not None


async def get_job(client: aioredis.Redis, job_id: str) -> dict | None:
    """The job's record, or None when there is none (a hash without a spec is no job)."""
    return parse_record(await client.hgetall(Keys.job(job_id)))


def parse_record(raw: Mapping[Value, Value]) -> dict | None:
    fields = text_fields(raw)
    if "spec" not in fields:
        return None
    record: dict[str, object] = dict(fields)
    for key in ("created", "started", "finished", "paused_since", "learner_seen"):
        if key in fields:
            record[key] = float(fields[key])
    record["warning"] = learner_silence(record, time.time())
    for key in ("version", "step", "resumes"):
        record[key] = int(fields.get(key, 0))
    record["spec"] = json.loads(fields["spec"])
    record["metrics"] = json.loads(fields.get("metrics", "{}"))
    record["alerts"] = json.loads(fields.get("alerts", "[]"))
    record["held_out"] = json.loads(fields.get("held_out", "{}"))
    return record


LIST_PAGE = 200
"""Index entries read per round trip when listing one tenant's jobs."""


async def job_spend(client: aioredis.Redis, job_id: str) -> dict:
    """What the job's LLM calls have cost so far, as the judge proxy charged them
    (`judge_proxy.spend`): `usd`, `tokens`, `cached` and `calls` in all, and `by_role`."""
    return bills.bill_of(await client.hgetall(Keys.job_spend(job_id)))


async def list_jobs(client: aioredis.Redis, tenant: str, limit: int) -> list[dict]:
    """The tenant's newest `limit` job records, newest first. Pages down the index (one
    pipeline of reads per page) until `limit` are found or it ends, so other tenants' newer
    jobs do not hide older ones; an id read twice (a job created meanwhile shifts the pages)
    keeps its first place."""
    found: dict[str, dict] = {}
    start = 0
    while True:
        ids = _members(await client.zrevrange(Keys.jobs_index, start, start + LIST_PAGE - 1))
        async with client.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(Keys.job(job_id))
            records = [parse_record(raw) for raw in await pipe.execute()]
        found.update((r["id"], r) for r in records if r and r.get("tenant", "") == tenant)
        expired = [job_id for job_id, record in zip(ids, records) if record is None]
        if expired:  # an ended job's record expired after its retention: forget it here too
            await client.zrem(Keys.jobs_index, *expired)
        if len(found) >= limit or len(ids) < LIST_PAGE:
            return list(found.values())[:limit]
        start += LIST_PAGE - len(expired)


async def job_spec(client: aioredis.Redis, job_id: str) -> JobSpec:
    """The job's spec; NoSuchJob without a record."""
    spec = await client.hget(Keys.job(job_id), "spec")
    if spec is None:
        raise NoSuchJob(f"no job {job_id!r}")
    return parse_job_spec_json(spec)


@dataclass(frozen=True)
class JudgeTerms:
    """What the judge proxy holds a job to."""

    weight: float
    """Its `judge_weight`: its share of a judge upstream against other jobs."""
    budget: BudgetSpec
    """Its own caps."""
    tenant: str | None
    """Whose it is (None: no job record, so no tenant's month to charge)."""
    tenant_cap: BudgetSpec
    """The operator's cap on its tenant's month (`services.bills`)."""


async def judge_terms(client: aioredis.Redis, job_id: str) -> JudgeTerms:
    """The job's terms; weight 1, no cap and no tenant for an id with no job record (tests,
    clients outside Tandem)."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.hmget(Keys.job(job_id), "spec", "tenant")
        pipe.hgetall(Keys.tenant_caps)
        (spec, tenant), caps = await pipe.execute()
    if spec is None:
        return JudgeTerms(1.0, BudgetSpec(), None, BudgetSpec())
    parsed = parse_job_spec_json(spec)
    return JudgeTerms(parsed.judge_weight, parsed.budget, text(tenant or b""), bills.cap_of(caps))


# Status changes are compare-and-set in Redis: a job that has ended (or has no record) never
# changes again, so the learner's claim (PENDING -> RUNNING) and a cancel cannot both win.
# A job leaving PENDING leaves its tenant's queue in the same script; a job's first start
# marks its tenant served. Each change is announced on the job's `changed` channel.
_ENDED = "local ended = {" + ", ".join(f"{s}=true" for s in sorted(TERMINAL)) + "}\n"
SET_STATUS_LUA = _ENDED + lua("services", "fence", "job_set_status")
CANCEL_LUA = lua("services", "job_cancel")
PAUSE_LUA = lua("services", "fence", "job_pause")


CAP_REACHED = "spend cap reached"
"""How the reason of a job that a spend cap ended (SUCCEEDED) begins (`learner.cost`)."""

RESUME_LUA = lua("services", "job_resume")


class NotResumable(Exception):
    """The job cannot be resumed; the message says why."""


def job_keys(job_id: str) -> list[str]:
    """Every key that holds a job's state (journals and judge memories expire on their own)."""
    return [
        Keys.job(job_id),
        Keys.tasks(job_id),
        Keys.trajectories(job_id),
        Keys.dead(job_id),
        Keys.task_errors(job_id),
        Keys.history(job_id),
        Keys.weights(job_id),
        Keys.checkpoints(job_id),
        Keys.servers(job_id),
        Keys.datasets(job_id),
        Keys.eval_tasks(job_id),
        Keys.eval_results(job_id),
        Keys.eval_rounds(job_id),
        Keys.groups(job_id),
        Keys.job_spend(job_id),
    ]


async def set_status(
    client: aioredis.Redis,
    job_id: str,
    status: JobStatus,
    error: str = "",
    retention_s: float = RETENTION_S,
    only_from: JobStatus | None = None,
) -> bool:
    """Move the job to `status` (RUNNING joins `jobs:running`, an end leaves it) unless it
    has already ended, or is not `only_from` when that is given, or the lease this task
    holds on it was lost (`job_lease.holding`); True when it moved. An end
    sets every key of the job to expire after `retention_s`. A learner whose claim lost to a
    cancel finds the job CANCELLED with `cancel_requested` set, so it stops at its first
    cancel check."""
    moved = await client.register_script(SET_STATUS_LUA)(
        keys=[
            Keys.job(job_id),
            Keys.jobs_running,
            await queue_of(client, job_id),
            Keys.jobs_served,
            Keys.job_changed(job_id),
            *job_keys(job_id),
        ],
        args=[
            status.value,
            time.time(),
            error[:4000],
            job_id,
            int(retention_s),
            only_from.value if only_from else "",
            job_lease.fence_of(job_id),
        ],
    )
    return moved == 1


async def queue_of(client: aioredis.Redis, job_id: str) -> str:
    """The queue of the job's tenant (a job's tenant never changes)."""
    return Keys.jobs_queued(text(await client.hget(Keys.job(job_id), "tenant") or b""))


async def pause(client: aioredis.Redis, job_id: str, reason: str) -> bool:
    """A RUNNING job waits on something outside it: PAUSED with `reason`, since now (a job
    PAUSED already keeps its `paused_since` and takes the newer reason). False when the job
    is neither (it ended, or a cancel ended it first). `set_status(RUNNING)` lifts it."""
    paused = await client.register_script(PAUSE_LUA)(
        keys=[Keys.job(job_id), Keys.job_changed(job_id)], args=[reason[:4000], time.time(), job_lease.fence_of(job_id)]
    )
    return paused == 1


async def cancel(client: aioredis.Redis, job_id: str, retention_s: float = RETENTION_S) -> str | None:
    """Cancel atomically against the learner's claim: a PENDING job ends CANCELLED (its keys
    then expire after `retention_s`), a RUNNING one gets `cancel_requested` (the learner ends
    it CANCELLED at its next check), an ended one is left alone. Returns the status it leaves
    (None without a record)."""
    status = await client.register_script(CANCEL_LUA)(
        keys=[await queue_of(client, job_id), Keys.job_changed(job_id), *job_keys(job_id)],
        args=[time.time(), int(retention_s), job_id],
    )
    return text(status) if status else None


async def resume(
    client: aioredis.Redis, job_id: str, max_pending: int = sys.maxsize, budget: BudgetSpec | None = None
) -> None:
    """Queue an ended job again, PENDING, for a learner to continue from its newest complete
    checkpoint; its keys no longer expire. A FAILED or CANCELLED job resumes, and one a spend
    cap ended, with its `budget` replaced when one is given. NotResumable (saying why) when
    it has no record, has not ended, SUCCEEDED otherwise, or recorded no checkpoint;
    BudgetTooLow when `budget` leaves nothing above what the job spent; QueueFull when its
    tenant has `max_pending` jobs queued already. Whether the checkpoint still loads only
    the learner, which holds the runs folder, can tell: if none does, it fails the job again."""
    spec = ""
    if budget is not None:
        stored = await client.hget(Keys.job(job_id), "spec")
        if stored is None:
            raise NotResumable(not_resumable_reason(job_id, None))
        await check_raised(client, job_id, budget)
        spec = parse_job_spec_json(stored).model_copy(update={"budget": budget}).model_dump_json()
    answer = await client.register_script(RESUME_LUA)(
        keys=[
            await queue_of(client, job_id),
            Keys.job_changed(job_id),
            Keys.checkpoints(job_id),
            Keys.job_spend(job_id),
            *job_keys(job_id),
        ],
        args=[time.time(), job_id, max_pending, spec, CAP_REACHED],
    )
    answer = text(answer) if answer else None
    if answer == "RESUMED":
        return
    if answer == "QUEUE_FULL":
        raise QueueFull(f"the job's tenant has {max_pending} jobs pending already (TANDEM_MAX_PENDING_JOBS)")
    raise NotResumable(not_resumable_reason(job_id, answer))


class BudgetTooLow(ValueError):
    """A new budget that leaves nothing above what the job spent; `field` names the cap."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


async def check_raised(client: aioredis.Redis, job_id: str, budget: BudgetSpec) -> None:
    """BudgetTooLow when a cap of `budget` is not above what the job has spent."""
    spent = await job_spend(client, job_id)
    for field, cap in budget.limits.items():
        if cap <= spent[field]:
            raise BudgetTooLow(
                field, f"budget.{field} {cap} is not above what job {job_id} has spent ({spent[field]:g} {field})"
            )


def not_resumable_reason(job_id: str, answer: str | None) -> str:
    if answer is None:
        return f"no job {job_id!r}"
    if answer == "NO_CHECKPOINT":
        return (
            f"job {job_id} recorded no checkpoint to resume from (train.checkpoint_every and checkpoint_every_s "
            "were 0 and no SIGTERM wrote one): submit it again"
        )
    if answer == JobStatus.SUCCEEDED.value:
        return f"job {job_id} SUCCEEDED: it has nothing left to train"
    return f"job {job_id} is {answer}, not ended: only a FAILED or CANCELLED job, or one a spend cap ended, resumes"


RECORD_PROGRESS_LUA = lua("services", "fence", "job_record_progress")


async def record_progress(
    client: aioredis.Redis, job_id: str, step: int, version: int, metrics: dict[str, float]
) -> None:
    """The job's step, version and last step's numbers; LeaseLost when the lease this
    task holds on the job was lost."""
    written = await client.register_script(RECORD_PROGRESS_LUA)(
        keys=[Keys.job(job_id)], args=[step, version, json.dumps(metrics), time.time(), job_lease.fence_of(job_id)]
    )
    if not written:
        raise job_lease.LeaseLost(f"job {job_id}: another learner took it over; step {step} is not recorded")


RECORD_HELD_OUT_LUA = lua("services", "fence", "job_record_held_out")


async def record_held_out(client: aioredis.Redis, job_id: str, summary: dict) -> None:
    """The job's latest held-out evaluation (`learner.evaluation`); LeaseLost as `record_progress`."""
    written = await client.register_script(RECORD_HELD_OUT_LUA)(
        keys=[Keys.job(job_id)], args=[json.dumps(summary), job_lease.fence_of(job_id)]
    )
    if not written:
        raise job_lease.LeaseLost(f"job {job_id}: another learner took it over; its evaluation is not recorded")


async def add_alert(client: aioredis.Redis, job_id: str, message: str) -> None:
    """Append a fired health rule's message to the job's `alerts` (the learner is the only
    writer of a running job's record fields)."""
    alerts = json.loads(await client.hget(Keys.job(job_id), "alerts") or "[]")
    await client.hset(Keys.job(job_id), "alerts", json.dumps(alerts + [message]))


async def cancel_requested(client: aioredis.Redis, job_id: str) -> bool:
    return await client.hget(Keys.job(job_id), "cancel_requested") == b"1"


async def running_jobs(client: aioredis.Redis) -> list[str]:
    return sorted(text(i) for i in await client.smembers(Keys.jobs_running))


APPEND_HISTORY_LUA = lua("services", "fence", "history_append")


READ_HISTORY_LUA = lua("services", "history_read")


async def append_history(client: aioredis.Redis, job_id: str, record: str, keep: int) -> None:
    """Append a step record, keeping the newest `keep` in Redis; LeaseLost when the lease
    this task holds on the job was lost."""
    appended = await client.register_script(APPEND_HISTORY_LUA)(
        keys=[Keys.history(job_id), Keys.job(job_id), Keys.job_changed(job_id)],
        args=[record, keep, job_lease.fence_of(job_id)],
    )
    if not appended:
        raise job_lease.LeaseLost(f"job {job_id}: another learner took it over; its step record is not kept")


async def history_dropped(client: aioredis.Redis, job_id: str) -> int:
    return int(await client.hget(Keys.job(job_id), "history_dropped") or 0)


async def history_length(client: aioredis.Redis, job_id: str) -> int:
    """Records in the whole history, dropped ones included."""
    return await history_dropped(client, job_id) + await client.llen(Keys.history(job_id))


async def trim_history(client: aioredis.Redis, job_id: str, length: int) -> None:
    """Keep the first `length` records of the whole history (what a checkpoint covers)."""
    kept = length - await history_dropped(client, job_id)
    if kept > 0:
        await client.ltrim(Keys.history(job_id), 0, kept - 1)
    else:  # every record the checkpoint covers was dropped already (LTRIM 0 -1 would keep all)
        async with client.pipeline(transaction=True) as pipe:
            pipe.delete(Keys.history(job_id))
            pipe.hset(Keys.job(job_id), "history_dropped", length)
            await pipe.execute()


async def read_history(client: aioredis.Redis, job_id: str, start: int) -> tuple[int, list[bytes]]:
    """The records from global index `start` on, or from the oldest kept when that was
    dropped; and the global index of the first one returned."""
    first, records = await client.register_script(READ_HISTORY_LUA)(
        keys=[Keys.history(job_id), Keys.job(job_id)], args=[start]
    )
    return int(first), records
