"""The job API: submit a JobSpec, follow it, cancel it.

`create_app(settings)` builds the app; routes are thin and the Redis client lives on
`app.state`. A spec that fails validation gets FastAPI's 422, whose `detail[].loc` names
the offending field (e.g. `["body", "train", "lr"]`).
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis
from fastapi import FastAPI, HTTPException, Query, Request
from pydantic import BaseModel, Field

from services import jobs
from services.config import ApiSettings, JobSpec
from services.metrics import metrics_router
from services.queues import Keys


class JobView(BaseModel):
    id: str
    name: str
    status: jobs.JobStatus
    created: float
    started: float | None = None
    finished: float | None = None
    version: int = Field(0, description="Policy version (learner steps published).")
    step: int = 0
    error: str | None = None
    metrics: dict = Field(default_factory=dict, description="The latest step's metrics.")
    spec: JobSpec


class JobCreated(BaseModel):
    id: str
    status: jobs.JobStatus


def create_app(settings: ApiSettings) -> FastAPI:
    app = FastAPI(title="Tandem job API", version="0.1.0")
    app.state.settings = settings
    app.state.redis = aioredis.from_url(settings.redis_url)
    app.include_router(metrics_router())

    async def load(request: Request, job_id: str) -> dict:
        record = await jobs.get_job(request.app.state.redis, job_id)
        if record is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return record

    @app.post("/v1/jobs", status_code=201, response_model=JobCreated)
    async def submit(spec: JobSpec, request: Request) -> JobCreated:
        job_id = await jobs.create_job(request.app.state.redis, spec)
        return JobCreated(id=job_id, status=jobs.JobStatus.PENDING)

    @app.get("/v1/jobs", response_model=list[JobView])
    async def list_jobs(request: Request, limit: int = Query(100, ge=1, le=1000)) -> list[JobView]:
        client = request.app.state.redis
        records = [await jobs.get_job(client, i) for i in await jobs.list_job_ids(client, limit)]
        return [JobView(**r) for r in records if r]

    @app.get("/v1/jobs/{job_id}", response_model=JobView)
    async def get(job_id: str, request: Request) -> JobView:
        return JobView(**await load(request, job_id))

    @app.get("/v1/jobs/{job_id}/history", response_model=list[dict])
    async def history(job_id: str, request: Request, start: int = Query(0, ge=0)) -> list[dict]:
        await load(request, job_id)
        raw = await request.app.state.redis.lrange(Keys.history(job_id), start, -1)
        return [json.loads(r) for r in raw]

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobView)
    async def cancel(job_id: str, request: Request) -> JobView:
        record = await load(request, job_id)
        client = request.app.state.redis
        if record["status"] == jobs.JobStatus.PENDING.value:
            await jobs.set_status(client, job_id, jobs.JobStatus.CANCELLED)
        elif record["status"] == jobs.JobStatus.RUNNING.value:
            await jobs.request_cancel(client, job_id)
        return JobView(**await load(request, job_id))

    return app
