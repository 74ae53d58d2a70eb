"""Job status changes against a real Redis: the learner's claim and a cancel race, and
exactly one of them wins, whichever order their reads and writes interleave in."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from services import jobs
from services.config import parse_job_spec
from services.queues import Keys

SPEC = parse_job_spec({"name": "t", "model": {"path": "/models/tiny"}})


async def state(client: aioredis.Redis, job_id: str) -> tuple[str, bool, bool]:
    """(status, cancel requested, in jobs:running)."""
    record = await jobs.get_job(client, job_id)
    return (record["status"], await jobs.cancel_requested(client, job_id), job_id in await jobs.running_jobs(client))


async def test_a_cancel_landing_between_the_learners_read_and_claim_wins_and_the_claim_is_refused(redis_client):
    job_id = await jobs.create_job(redis_client, SPEC)
    assert (await jobs.get_job(redis_client, job_id))["status"] == "PENDING"  # the learner's read

    assert await jobs.cancel(redis_client, job_id) == "CANCELLED"
    assert await jobs.set_status(redis_client, job_id, jobs.JobStatus.RUNNING) is False

    # Not running, and flagged: a learner that goes on regardless stops at its first cancel check.
    assert await state(redis_client, job_id) == ("CANCELLED", True, False)
    assert await jobs.set_status(redis_client, job_id, jobs.JobStatus.CANCELLED) is False


async def test_a_claim_landing_between_the_apis_read_and_cancel_wins_and_the_cancel_becomes_a_request(redis_client):
    job_id = await jobs.create_job(redis_client, SPEC)
    assert (await jobs.get_job(redis_client, job_id))["status"] == "PENDING"  # the API's read

    assert await jobs.set_status(redis_client, job_id, jobs.JobStatus.RUNNING) is True
    assert await jobs.cancel(redis_client, job_id) == "RUNNING"
    assert await state(redis_client, job_id) == ("RUNNING", True, True)

    assert await jobs.set_status(redis_client, job_id, jobs.JobStatus.CANCELLED) is True  # the learner honours it
    assert await state(redis_client, job_id) == ("CANCELLED", True, False)


async def test_an_ended_job_keeps_its_status_and_a_missing_one_gets_no_record(redis_client):
    job_id = await jobs.create_job(redis_client, SPEC)
    assert await jobs.set_status(redis_client, job_id, jobs.JobStatus.FAILED, "boom") is True

    assert await jobs.cancel(redis_client, job_id) == "FAILED"
    assert await jobs.set_status(redis_client, job_id, jobs.JobStatus.SUCCEEDED) is False
    record = await jobs.get_job(redis_client, job_id)
    assert (record["status"], record["error"]) == ("FAILED", "boom")
    assert await state(redis_client, job_id) == ("FAILED", False, False)

    assert await jobs.cancel(redis_client, "t-00000000") is None
    assert await jobs.set_status(redis_client, "t-00000000", jobs.JobStatus.RUNNING) is False
    assert not await redis_client.exists(Keys.job("t-00000000"))


async def test_concurrent_claims_and_cancels_never_both_win(redis_url, redis_client):
    learner, api = aioredis.from_url(redis_url), aioredis.from_url(redis_url)
    try:
        for _ in range(50):
            job_id = await jobs.create_job(redis_client, SPEC)
            claimed, cancelled = await asyncio.gather(
                jobs.set_status(learner, job_id, jobs.JobStatus.RUNNING), jobs.cancel(api, job_id)
            )
            expected = ("RUNNING", True, True) if claimed else ("CANCELLED", True, False)
            assert cancelled == ("RUNNING" if claimed else "CANCELLED")
            assert await state(redis_client, job_id) == expected
    finally:
        await learner.aclose()
        await api.aclose()
