"""At-least-once stream consumption against a real Redis."""

from __future__ import annotations

import asyncio

from services import protocol
from services.queues import FIELD, Keys, StreamConsumer, publish


def task(task_id: int) -> protocol.Task:
    return protocol.Task(job_id="j", task_id=task_id, example=task_id, group_size=2, dispatched_version=0)


async def consumer(client, name: str, max_deliveries: int = 3) -> StreamConsumer:
    return await StreamConsumer(
        client, Keys.tasks("j"), "rollout", name, protocol.Task, Keys.dead("j"), max_deliveries=max_deliveries
    ).setup()


async def test_malformed_entries_go_to_the_dead_stream_with_the_reason(redis_client):
    reader = await consumer(redis_client, "a")
    await redis_client.xadd(Keys.tasks("j"), {FIELD: b"\x93\x01"})
    await redis_client.xadd(Keys.tasks("j"), {FIELD: protocol.encode(protocol.JobEvent(kind="stop"))})
    await publish(redis_client, Keys.tasks("j"), task(1))

    deliveries = await reader.read(10)

    assert [d.message.task_id for d in deliveries] == [1]
    dead = await redis_client.xrange(Keys.dead("j"))
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert len(reasons) == 2
    assert "Expected `object`, got `array`" in reasons[0]
    assert "unknown field `kind`" in reasons[1]
    assert dead[0][1][b"stream"] == Keys.tasks("j").encode()
    assert (await redis_client.xpending(Keys.tasks("j"), "rollout"))["pending"] == 1  # only the good one


async def test_a_task_left_pending_by_a_dead_consumer_is_reclaimed_by_another(redis_client):
    crashed, survivor = await consumer(redis_client, "crashed"), await consumer(redis_client, "survivor")
    await publish(redis_client, Keys.tasks("j"), task(7))
    assert [d.message.task_id for d in await crashed.read(1)] == [7]  # ... and never acknowledged

    assert await survivor.reclaim(min_idle_ms=60_000, count=10) == []  # not idle long enough
    await asyncio.sleep(0.05)
    reclaimed = await survivor.reclaim(min_idle_ms=20, count=10)
    assert [d.message.task_id for d in reclaimed] == [7]
    await survivor.ack(reclaimed[0].entry_id)
    assert (await redis_client.xpending(Keys.tasks("j"), "rollout"))["pending"] == 0


async def test_touch_keeps_a_live_consumers_task_from_being_reclaimed(redis_client):
    worker, other = await consumer(redis_client, "worker"), await consumer(redis_client, "other")
    await publish(redis_client, Keys.tasks("j"), task(3))
    delivery = (await worker.read(1))[0]
    await asyncio.sleep(0.06)
    await worker.touch(delivery.entry_id)

    assert await other.reclaim(min_idle_ms=50, count=10) == []


async def test_a_released_task_is_taken_over_at_once_not_after_the_idle_threshold(redis_client):
    leaving, staying = await consumer(redis_client, "leaving"), await consumer(redis_client, "staying")
    await publish(redis_client, Keys.tasks("j"), task(5))
    await publish(redis_client, Keys.tasks("j"), task(6))
    held = await leaving.read(2)
    await leaving.release(held[0].entry_id)  # a drain hands back the task it could not finish

    taken = await staying.reclaim(min_idle_ms=60_000, count=10)  # a threshold far from reached

    assert [d.message.task_id for d in taken] == [5]  # the other one is still being worked on
    pending = await redis_client.xpending_range(Keys.tasks("j"), "rollout", "-", "+", 10)
    assert {p["consumer"].decode(): p["message_id"] for p in pending} == {
        "staying": held[0].entry_id,
        "leaving": held[1].entry_id,
    }


async def test_an_entry_delivered_too_often_is_dead_lettered_instead_of_retried(redis_client):
    first, second = (
        await consumer(redis_client, "first", max_deliveries=2),
        await consumer(redis_client, "second", max_deliveries=2),
    )
    await publish(redis_client, Keys.tasks("j"), task(5))
    await first.read(1)
    await asyncio.sleep(0.02)
    assert len(await second.reclaim(min_idle_ms=10, count=10)) == 1  # second delivery
    await asyncio.sleep(0.02)

    assert await first.reclaim(min_idle_ms=10, count=10) == []  # third would exceed 2
    dead = await redis_client.xrange(Keys.dead("j"))
    assert b"delivered 3 times" in dead[0][1][b"reason"]
    assert (await redis_client.xpending(Keys.tasks("j"), "rollout"))["pending"] == 0


async def test_a_restarted_consumer_reads_its_own_pending_entries_first(redis_client):
    before = await consumer(redis_client, "rollout-a")
    await publish(redis_client, Keys.tasks("j"), task(1))
    await publish(redis_client, Keys.tasks("j"), task(2))
    await before.read(2)
    after = await consumer(redis_client, "rollout-a")  # same name, new process

    assert [d.message.task_id for d in await after.read_own_pending(10)] == [1, 2]
    assert await after.read(10, block_ms=10) == []


async def test_reclaim_goes_on_where_the_last_scan_stopped(redis_client):
    stream = "tandem:test:cursor"
    await redis_client.delete(stream)
    for task_id in range(6):
        await publish(
            redis_client,
            stream,
            protocol.Task(job_id="j", task_id=task_id, example=0, group_size=1, dispatched_version=0),
        )
    gone = await StreamConsumer(redis_client, stream, "g", "gone", protocol.Task, "tandem:test:dead").setup()
    taker = await StreamConsumer(redis_client, stream, "g", "taker", protocol.Task, "tandem:test:dead").setup()
    await gone.read(6)

    first = await taker.reclaim(0, 2)
    second = await taker.reclaim(0, 2)

    assert [d.message.task_id for d in first] == [0, 1]
    assert [d.message.task_id for d in second] == [2, 3]  # not 0, 1 again: those are idle too now
    assert taker.reclaim_cursor != "0-0"
