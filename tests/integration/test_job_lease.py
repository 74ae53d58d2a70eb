"""One learner per job, on a real Redis: the lease a learner holds on its job, the fencing
token that refuses the writes of a learner that lost it, and the count of restarts that
ends a crash loop (`services.job_lease`, `learner.driver.claim_job`)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import redis

from learner.driver import claim_job
from learner.torchrun import EXIT_FILE, NO_EXIT_RECORDED, describe_exit
from services import job_lease, jobs
from services.config import LearnerSettings, ModelSpec, RLJob
from services.queues import Keys

SHORT_TTL_S = 0.3
LAPSE_WAIT_S = 10.0
"""Redis expires a key at most ~100 ms past its TTL (active expiry runs 10 times a second);
10 s is far above that on a loaded machine."""


async def running_job(client) -> str:
    job_id = await jobs.create_job(client, RLJob(name="leased", model=ModelSpec(path="/models/none")))
    assert await jobs.set_status(client, job_id, jobs.JobStatus.RUNNING)
    return job_id


async def lapsed(client, job_id: str) -> None:
    async with asyncio.timeout(LAPSE_WAIT_S):
        while await client.exists(job_lease.lease_key(job_id)):
            await asyncio.sleep(0.05)


async def test_a_held_job_is_refused_to_a_second_learner_which_takes_it_over_once_the_lease_lapses(redis_client):
    job_id = await running_job(redis_client)

    first = await job_lease.acquire(redis_client, job_id, "learner-a", SHORT_TTL_S)
    assert first is not None and first.token == 1
    assert await job_lease.acquire(redis_client, job_id, "learner-b", 60.0) is None
    assert await job_lease.unheld(redis_client, [job_id]) == []

    await lapsed(redis_client, job_id)
    assert await job_lease.unheld(redis_client, [job_id]) == [job_id]
    second = await job_lease.acquire(redis_client, job_id, "learner-b", 60.0)
    assert second is not None and second.token == 2


async def test_a_stale_holder_can_neither_end_the_job_nor_record_a_step_and_cannot_renew(redis_client, redis_url):
    """A learner frozen past its lease (a stop-the-world pause) wakes up after another took
    the job over: its status change, pause and step record are refused, the new holder's
    pass."""
    job_id = await running_job(redis_client)
    stale = await job_lease.acquire(redis_client, job_id, "learner-a", SHORT_TTL_S)
    await lapsed(redis_client, job_id)
    fresh = await job_lease.acquire(redis_client, job_id, "learner-b", 60.0)

    with job_lease.holding(stale):
        assert not await jobs.set_status(redis_client, job_id, jobs.JobStatus.FAILED, "stale")
        assert not await jobs.pause(redis_client, job_id, "stale")
        with pytest.raises(job_lease.LeaseLost):
            await jobs.append_history(redis_client, job_id, json.dumps({"step": 9}), keep=100)
        with pytest.raises(job_lease.LeaseLost):
            await jobs.record_progress(redis_client, job_id, 9, 9, {})
    assert not job_lease.renew(redis.Redis.from_url(redis_url), stale, 60.0)
    record = await jobs.get_job(redis_client, job_id)
    assert (record["status"], record["step"], record.get("error")) == ("RUNNING", 0, None)
    assert await redis_client.llen(Keys.history(job_id)) == 0

    with job_lease.holding(fresh):
        await jobs.record_progress(redis_client, job_id, 1, 1, {})
        assert await jobs.set_status(redis_client, job_id, jobs.JobStatus.SUCCEEDED)
    assert (await jobs.get_job(redis_client, job_id))["status"] == "SUCCEEDED"


async def test_a_late_holder_renews_a_lapsed_lease_nobody_took(redis_client, redis_url):
    job_id = await running_job(redis_client)
    late = await job_lease.acquire(redis_client, job_id, "learner-a", SHORT_TTL_S)
    await lapsed(redis_client, job_id)

    assert job_lease.renew(redis.Redis.from_url(redis_url), late, 60.0)
    assert await job_lease.acquire(redis_client, job_id, "learner-b", 60.0) is None


def write_exit(settings: LearnerSettings, job_id: str, reason: str) -> None:
    """As torchrun's wrapper records a learner's exit, just now."""
    folder = Path(settings.runs_dir) / job_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXIT_FILE).write_text(json.dumps({"time": time.time(), "reason": reason}))


async def test_a_job_whose_learner_dies_three_times_after_the_same_step_fails_with_the_last_exit(
    redis_client, tmp_path
):
    """Each claim of a job left RUNNING is a restart at its step; a step completed between
    starts the count anew, a stop on request is no crash, and the third crash in a row
    after the same step fails the job with how its learner ended."""
    settings = LearnerSettings(runs_dir=str(tmp_path), resume=True, max_crashes_per_step=3)
    job_id = await running_job(redis_client)
    killed = describe_exit(1, -9)

    assert await claim_job(redis_client, job_id, settings) is not None  # crash 1 after step 0
    await jobs.record_progress(redis_client, job_id, 4, 4, {})
    assert await claim_job(redis_client, job_id, settings) is not None  # crash 1 after step 4
    await redis_client.hset(Keys.job(job_id), "learner_stopped", 1)  # as `release` after a SIGTERM
    assert await claim_job(redis_client, job_id, settings) is not None  # no crash
    write_exit(settings, job_id, "rank 0: exit 1")
    assert await claim_job(redis_client, job_id, settings) is not None  # crash 2 after step 4
    assert (await jobs.get_job(redis_client, job_id))["last_exit"] == "rank 0: exit 1"
    write_exit(settings, job_id, killed)
    assert await claim_job(redis_client, job_id, settings) is None  # crash 3 after step 4

    record = await jobs.get_job(redis_client, job_id)
    assert record["status"] == "FAILED"
    assert record["error"] == (
        "the learner died 3 times in a row after step 4 without completing another "
        f"(max_crashes_per_step=3); the last exit: {killed}"
    )
    assert killed == "rank 1: killed by signal 9 SIGKILL (exit 137; the kernel's OOM killer sends it, as does kill -9)"
    assert (record["restarts"], record["restarts_at_step"]) == ("4", "3")


async def test_an_exit_recorded_before_the_job_last_ran_is_not_its_last_exit(redis_client, tmp_path):
    settings = LearnerSettings(runs_dir=str(tmp_path), resume=True)
    job_id = await running_job(redis_client)
    folder = tmp_path / job_id
    folder.mkdir()
    (folder / EXIT_FILE).write_text(json.dumps({"time": 1.0, "reason": "rank 0: exit 1"}))  # an earlier run's

    assert await claim_job(redis_client, job_id, settings) is not None
    assert (await jobs.get_job(redis_client, job_id))["last_exit"] == NO_EXIT_RECORDED
    assert not (folder / EXIT_FILE).exists()
