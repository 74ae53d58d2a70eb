"""Redis keeps what a run still needs and no more: acknowledged stream entries are trimmed,
an ended job's keys expire, and the job index forgets expired jobs (real Redis)."""

from __future__ import annotations

from services import jobs, retention
from services.config import ModelSpec, RLJob
from services.queues import Keys

STREAM = "tandem:test:retention"


async def add(client, count: int) -> list[bytes]:
    return [await client.xadd(STREAM, {b"m": f"entry {i}".encode()}) for i in range(count)]


async def remaining(client) -> list[bytes]:
    return [entry_id for entry_id, _ in await client.xrange(STREAM)]


async def test_entries_every_group_acknowledged_are_trimmed_pending_and_unread_ones_kept(redis_client):
    await redis_client.delete(STREAM)
    ids = await add(redis_client, 10)
    await redis_client.xgroup_create(STREAM, "a", id="0")
    await redis_client.xgroup_create(STREAM, "b", id="0")
    await redis_client.xreadgroup("a", "c", {STREAM: ">"}, count=8)  # a: 0-7 delivered
    await redis_client.xack(STREAM, "a", *ids[:3], *ids[4:8])  # a: 3 still pending
    await redis_client.xreadgroup("b", "c", {STREAM: ">"}, count=6)  # b: 0-5 delivered
    await redis_client.xack(STREAM, "b", *ids[:6])  # b: all acked, 6.. unread

    deleted = await retention.trim_acked(redis_client, STREAM)

    assert deleted == 3 and await remaining(redis_client) == ids[3:]  # a's pending entry 3 holds the rest


async def test_a_fully_acknowledged_stream_keeps_only_its_newest_entry(redis_client):
    await redis_client.delete(STREAM)
    ids = await add(redis_client, 5)
    await redis_client.xgroup_create(STREAM, "a", id="0")
    await redis_client.xreadgroup("a", "c", {STREAM: ">"})
    await redis_client.xack(STREAM, "a", *ids)

    assert await retention.trim_acked(redis_client, STREAM) == 4
    assert await remaining(redis_client) == ids[-1:]
    assert await retention.trim_acked(redis_client, STREAM) == 0


async def test_a_group_that_acks_after_its_info_was_read_does_not_fail_the_trim(redis_client):
    """The trim reads XINFO GROUPS, then each group's pending summary: an ack in between
    leaves the info saying "pending" and the summary empty."""
    await redis_client.delete(STREAM)
    ids = await add(redis_client, 4)
    await redis_client.xgroup_create(STREAM, "a", id="0")
    await redis_client.xreadgroup("a", "c", {STREAM: ">"}, count=2)  # 0-1 delivered, pending
    stale = (await redis_client.xinfo_groups(STREAM))[0]
    await redis_client.xack(STREAM, "a", *ids[:2])

    assert stale["pending"] == 2
    # The entry after the last delivered one: ids[2] itself when both share a millisecond,
    # else an id between the two; either way a trim there drops exactly the acked two.
    needed = await retention._first_needed(redis_client, STREAM, stale)
    assert retention.parse_id(ids[1]) < needed <= retention.parse_id(ids[2])


async def test_a_stream_without_groups_is_left_alone(redis_client):
    await redis_client.delete(STREAM)
    await add(redis_client, 3)

    assert await retention.trim_acked(redis_client, STREAM) == 0
    assert len(await remaining(redis_client)) == 3


async def test_an_empty_stream_its_group_created_and_a_missing_one_are_left_alone(redis_client):
    await redis_client.delete(STREAM)
    assert await retention.trim_acked(redis_client, STREAM) == 0
    await redis_client.xgroup_create(STREAM, "g", id="0", mkstream=True)  # as ensure_group makes it

    assert await retention.trim_acked(redis_client, STREAM) == 0
    assert await redis_client.exists(STREAM) == 1


async def test_an_ended_jobs_keys_expire_after_the_retention(redis_client):
    job_id = await jobs.create_job(redis_client, RLJob(model=ModelSpec(path="/models/tiny")))
    await jobs.set_status(redis_client, job_id, jobs.JobStatus.RUNNING)
    await redis_client.xadd(Keys.trajectories(job_id), {b"m": b"x"})
    await redis_client.rpush(Keys.history(job_id), b"{}")
    assert await redis_client.ttl(Keys.job(job_id)) == -1  # a running job's keys stay

    await jobs.set_status(redis_client, job_id, jobs.JobStatus.SUCCEEDED, retention_s=600)

    for key in (Keys.job(job_id), Keys.trajectories(job_id), Keys.history(job_id)):
        assert 590 <= await redis_client.ttl(key) <= 600, key


async def test_a_cancelled_pending_job_expires_and_the_index_forgets_it(redis_client):
    job_id = await jobs.create_job(redis_client, RLJob(model=ModelSpec(path="/models/tiny")), tenant="t")
    assert await jobs.cancel(redis_client, job_id, retention_s=600) == "CANCELLED"
    assert 590 <= await redis_client.ttl(Keys.job(job_id)) <= 600

    await redis_client.delete(Keys.job(job_id))  # what the expiry does after 600 s
    assert job_id not in [r["id"] for r in await jobs.list_jobs(redis_client, "t", 100)]
    assert await redis_client.zscore(Keys.jobs_index, job_id) is None


async def test_a_dead_stream_keeps_only_about_its_newest_entries(redis_client, monkeypatch):
    from services import protocol, queues

    monkeypatch.setattr(queues, "DEAD_MAXLEN", 10)
    await redis_client.delete(STREAM, "tandem:test:dead")
    consumer = await queues.StreamConsumer(redis_client, STREAM, "g", "c", protocol.Task, "tandem:test:dead").setup()
    for i in range(300):
        await consumer.dead_letter(f"{i + 1}-0".encode(), b"garbage", "does not decode")

    assert 10 <= await redis_client.xlen("tandem:test:dead") < 300


async def test_redis_keeps_the_newest_history_records_and_counts_the_dropped_ones(redis_client):
    job_id = await jobs.create_job(redis_client, RLJob(model=ModelSpec(path="/models/tiny")))
    for step in range(15):
        await jobs.append_history(redis_client, job_id, f'{{"step": {step}}}', keep=10)

    assert await redis_client.llen(Keys.history(job_id)) == 10
    assert await jobs.history_length(redis_client, job_id) == 15
    assert await jobs.read_history(redis_client, job_id, 0) == (5, [f'{{"step": {s}}}'.encode() for s in range(5, 15)])
    assert await jobs.read_history(redis_client, job_id, 13) == (13, [b'{"step": 13}', b'{"step": 14}'])

    await jobs.trim_history(redis_client, job_id, 12)  # a resume to a checkpoint at record 12
    assert await jobs.history_length(redis_client, job_id) == 12
    await jobs.trim_history(redis_client, job_id, 3)  # one older than every record kept
    assert await jobs.history_length(redis_client, job_id) == 3
    await jobs.append_history(redis_client, job_id, '{"step": 3}', keep=10)
    assert await jobs.read_history(redis_client, job_id, 0) == (3, [b'{"step": 3}'])
