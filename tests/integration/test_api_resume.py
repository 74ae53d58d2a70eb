"""Resuming an ended job through the API, against a real Redis (in-process, httpx ASGI
transport): what it refuses and why, and what a learner's claim then sees."""

from __future__ import annotations

import json

import httpx
import pytest

from learner.driver import claim_job
from services import jobs
from services.api.app import create_app
from services.config import ApiSettings, LearnerSettings
from services.queues import Keys

SPEC = {"name": "t", "model": {"path": "/models/tiny"}}
TOKENS = "alpha-token-0123456789:alpha,beta-token-9876543210:beta"
ALPHA = {"Authorization": "Bearer alpha-token-0123456789"}
BETA = {"Authorization": "Bearer beta-token-9876543210"}
RETENTION_S = 3600


@pytest.fixture
async def api(redis_url, redis_client):
    app = create_app(ApiSettings(redis_url=redis_url, tokens=TOKENS, job_retention_s=RETENTION_S))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        yield client


async def ended_job(api, redis_client, status: jobs.JobStatus, checkpoints: int = 1) -> str:
    """Alpha's job, claimed, with `checkpoints` recorded, then ended `status` as a learner
    ends it (its keys set to expire)."""
    job_id = (await api.post("/v1/jobs", json=SPEC, headers=ALPHA)).json()["id"]
    assert await claim_job(redis_client, job_id, LearnerSettings()) is not None
    for step in range(checkpoints):
        await redis_client.rpush(
            Keys.checkpoints(job_id), json.dumps({"step": step, "version": step, "path": "/x", "time": 0.0})
        )
    if status == jobs.JobStatus.CANCELLED:
        assert await jobs.cancel(redis_client, job_id) == "RUNNING"  # the request the learner ends it on
    await jobs.set_status(redis_client, job_id, status, "disk full" if status == "FAILED" else "", RETENTION_S)
    return job_id


@pytest.mark.parametrize("status", [jobs.JobStatus.FAILED, jobs.JobStatus.CANCELLED])
async def test_a_failed_or_cancelled_job_is_queued_again_kept_and_claimed_as_a_resume(api, redis_client, status):
    job_id = await ended_job(api, redis_client, status)
    assert 0 < await redis_client.ttl(Keys.job(job_id)) <= RETENTION_S

    response = await api.post(f"/v1/jobs/{job_id}/resume", headers=ALPHA)

    assert response.status_code == 200, response.text
    job = response.json()
    assert (job["status"], job["resumes"], job["resumed_from"]) == ("PENDING", 1, status.value)
    assert (job["error"], job["finished"]) == (None, None)
    assert job["resumed_error"] == ("disk full" if status == "FAILED" else "")
    for key in (Keys.job(job_id), Keys.checkpoints(job_id)):
        assert await redis_client.ttl(key) == -1  # kept: no longer expires after its retention
    assert await redis_client.zrange(Keys.jobs_queued("alpha"), 0, -1) == [job_id.encode()]
    assert not await jobs.cancel_requested(redis_client, job_id)  # a cancelled one does not stop at once
    # A learner started without --resume still takes it, as a resume of its checkpoint.
    assert await jobs.next_pending(redis_client, LearnerSettings().pending_ttl_s) == job_id
    claimed = await claim_job(redis_client, job_id, LearnerSettings(resume=False))
    assert claimed is not None and claimed[1] is True
    assert (await jobs.get_job(redis_client, job_id))["status"] == "RUNNING"


async def test_a_job_resumed_twice_counts_both_and_keeps_the_last_end(api, redis_client):
    job_id = await ended_job(api, redis_client, jobs.JobStatus.FAILED)
    await api.post(f"/v1/jobs/{job_id}/resume", headers=ALPHA)
    await claim_job(redis_client, job_id, LearnerSettings())
    await jobs.set_status(redis_client, job_id, jobs.JobStatus.CANCELLED, "", RETENTION_S)

    job = (await api.post(f"/v1/jobs/{job_id}/resume", headers=ALPHA)).json()

    assert (job["status"], job["resumes"], job["resumed_from"], job["resumed_error"]) == ("PENDING", 2, "CANCELLED", "")


@pytest.mark.parametrize(
    "end, checkpoints, says",
    [
        (None, 1, "is PENDING, not ended"),
        (jobs.JobStatus.RUNNING, 1, "is RUNNING, not ended"),
        (jobs.JobStatus.SUCCEEDED, 1, "SUCCEEDED: it has nothing left to train"),
        (jobs.JobStatus.FAILED, 0, "recorded no checkpoint to resume from"),
    ],
)
async def test_a_job_that_is_not_ended_succeeded_or_has_no_checkpoint_gets_409_saying_why(
    api, redis_client, end, checkpoints, says
):
    job_id = (await api.post("/v1/jobs", json=SPEC, headers=ALPHA)).json()["id"]
    for _ in range(checkpoints):
        await redis_client.rpush(Keys.checkpoints(job_id), "{}")
    if end is not None:
        await claim_job(redis_client, job_id, LearnerSettings())
        await jobs.set_status(redis_client, job_id, end, "", RETENTION_S)
    before = await jobs.get_job(redis_client, job_id)

    response = await api.post(f"/v1/jobs/{job_id}/resume", headers=ALPHA)

    assert response.status_code == 409 and says in response.json()["detail"], response.text
    assert await jobs.get_job(redis_client, job_id) == before | {"warning": None}


async def test_another_tenants_job_is_not_resumed(api, redis_client):
    job_id = await ended_job(api, redis_client, jobs.JobStatus.FAILED)

    response = await api.post(f"/v1/jobs/{job_id}/resume", headers=BETA)

    assert response.status_code == 403 and "another tenant" in response.json()["detail"]
    assert (await jobs.get_job(redis_client, job_id))["status"] == "FAILED"


async def test_a_job_whose_record_expired_after_its_retention_gets_404_saying_so(api, redis_client):
    job_id = await ended_job(api, redis_client, jobs.JobStatus.FAILED)
    await redis_client.delete(*jobs.job_keys(job_id))  # what the retention's expiry does

    response = await api.post(f"/v1/jobs/{job_id}/resume", headers=ALPHA)

    assert response.status_code == 404 and "deleted after its retention" in response.json()["detail"]


async def test_a_resume_past_the_tenants_pending_quota_gets_429(redis_url, redis_client):
    app = create_app(ApiSettings(redis_url=redis_url, tokens=TOKENS, max_pending_jobs=1))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as api:
        job_id = await ended_job(api, redis_client, jobs.JobStatus.FAILED)
        await api.post("/v1/jobs", json=SPEC, headers=ALPHA)  # takes the one place

        response = await api.post(f"/v1/jobs/{job_id}/resume", headers=ALPHA)

    assert response.status_code == 429
    assert (await jobs.get_job(redis_client, job_id))["status"] == "FAILED"


async def test_a_job_a_spend_cap_ended_resumes_with_a_raised_cap_and_its_refusal_cleared(api, redis_client):
    job_id = (await api.post("/v1/jobs", json={**SPEC, "budget": {"usd": 0.5}}, headers=ALPHA)).json()["id"]
    assert await claim_job(redis_client, job_id, LearnerSettings()) is not None
    await redis_client.rpush(Keys.checkpoints(job_id), json.dumps({"step": 4, "version": 4, "path": "/x", "time": 0}))
    spend = Keys.job_spend(job_id)
    await redis_client.hset(spend, mapping={"usd:judge": 0.48, "tokens:judge": 9000, "refused": 2, "refused_by": "x"})
    reason = f"{jobs.CAP_REACHED} at step 4 of 30: $0.4800 and 9000 tokens spent; the job's spend cap (usd 0.5) ..."
    await jobs.set_status(redis_client, job_id, jobs.JobStatus.SUCCEEDED, reason, RETENTION_S)
    resume = f"/v1/jobs/{job_id}/resume"

    low = await api.post(resume, json={"budget": {"usd": 0.4}}, headers=ALPHA)  # below what it spent
    unknown = await api.post(resume, json={"budget": {"usd": 1.0}, "spec": {}}, headers=ALPHA)
    negative = await api.post(resume, json={"budget": {"usd": -1}}, headers=ALPHA)
    assert low.status_code == 422 and low.json()["detail"][0]["loc"] == ["body", "budget", "usd"]
    assert "not above what job" in low.text
    assert unknown.status_code == 422 and ["body", "spec"] in [e["loc"] for e in unknown.json()["detail"]]
    assert negative.status_code == 422
    assert (await jobs.get_job(redis_client, job_id))["status"] == "SUCCEEDED"  # nothing changed

    raised = await api.post(resume, json={"budget": {"usd": 1.0}}, headers=ALPHA)
    assert raised.status_code == 200, raised.text
    job = raised.json()
    assert (job["status"], job["resumed_from"], job["resumed_error"]) == ("PENDING", "SUCCEEDED", reason)
    assert job["spec"]["budget"] == {"usd": 1.0, "tokens": None}
    assert await redis_client.hmget(spend, "refused", "refused_by") == [None, None]
    assert float(await redis_client.hget(spend, "usd:judge")) == 0.48  # the bill so far stays
    claimed = await claim_job(redis_client, job_id, LearnerSettings())
    assert claimed is not None and claimed[1] and claimed[0].budget.usd == 1.0  # a resume, at the new cap


async def test_a_job_that_succeeded_at_its_steps_does_not_resume_even_with_a_budget(api, redis_client):
    job_id = await ended_job(api, redis_client, jobs.JobStatus.SUCCEEDED)
    response = await api.post(f"/v1/jobs/{job_id}/resume", json={"budget": {"usd": 5.0}}, headers=ALPHA)
    assert response.status_code == 409 and "nothing left to train" in response.text
    assert (await jobs.get_job(redis_client, job_id))["spec"]["budget"] == {"usd": None, "tokens": None}
