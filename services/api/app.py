"""The job API: submit a JobSpec, follow it, cancel it, resume it.

`create_app(settings)` builds the app; routes are thin and the Redis client lives on
`app.state`. A spec that fails validation gets FastAPI's 422, whose `detail[].loc` names
the offending field (e.g. `["body", "train", "lr"]`).

Auth: with `settings.tokens` set ("token:tenant,..."), every /v1 route needs
`Authorization: Bearer <token>` (401 otherwise); a tenant sees and controls only its own
jobs (403 for another tenant's). Tokens are compared in constant time and never logged.
A tenant's spec may name files only under `settings.path_roots` (422 naming the field
otherwise), so it cannot train from another job's checkpoint or read the learner's files.
Bodies over `max_body_bytes` get 413, specs over `max_spec_bytes` (as stored) too.

Quotas, per tenant: at most `max_pending_jobs` PENDING jobs (429 for the next; a job still
PENDING after `pending_ttl_s` ends FAILED, expired), and `max_event_streams` event streams
open at once in this process (429). A `tools.file` is read off the event loop, and only up
to `max_tools_file_bytes` (422 naming the field above it). Money: each tenant's month is
held to `tenant_budget_usd` / `tenant_budget_tokens` (`services.bills`: the judge proxy makes
no call past it, and a new job is 402 once it is spent); `GET /v1/spend` shows the month.

The rollout-server routes act on the shared fleet, not on a tenant's job: with tokens set,
only the tenants in `settings.operators` may use them (403 for others).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.routing import Match

from services import bills, jobs
from services.api.access import expire_own, owned, parse_tokens, tenant
from services.api.admission import admitted, month_not_spent
from services.api.events import JobChanges, StreamSlots, job_events
from services.api.fleet import servers_router
from services.api.models import ERRORS, Error, JobCreated, JobView, ResumeRequest, TenantSpend
from services.api.page import page_router
from services.api.records import conversations_router, job_records_router
from services.config import ApiSettings, JobSpec, written_location
from services.metrics import metrics_router
from services.queues import connect
from services.tool_catalog import load_catalog

REDIS_CONNECTIONS = 64
REDIS_CONNECTION_WAIT_S = 10.0


class BodySizeLimit:
    """ASGI middleware: 413 for bodies over `limit` bytes, declared or streamed."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await JSONResponse({"detail": f"body over {self.limit} bytes"}, 413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"body over {self.limit} bytes")
            return message

        await self.app(scope, counted, send)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """While the API runs it keeps the operator's cap on each tenant's month in Redis, where
    the judge proxy reads it (`services.bills`)."""
    keeper = asyncio.create_task(bills.keep_caps(app.state.redis, app.state.settings.tenant_budget))
    try:
        yield
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper


def create_app(settings: ApiSettings) -> FastAPI:
    app = FastAPI(
        title="Tandem job API",
        version="0.1.0",
        description="Submit asynchronous RL jobs, follow their progress, cancel and resume them.",
        lifespan=lifespan,
        exception_handlers={405: method_not_allowed, RequestValidationError: validation_error},
    )
    app.state.settings = settings
    # The same client as every other process: calls time out, wait out a short Redis outage
    # (TANDEM_REDIS_OUTAGE_S) and queue for a free connection instead of failing.
    app.state.redis = connect(
        settings.redis_url, REDIS_CONNECTIONS, REDIS_CONNECTION_WAIT_S, outage_s=settings.redis_outage_s
    )
    app.state.tokens = parse_tokens(settings.tokens)
    app.state.path_roots = [Path(root.strip()).resolve() for root in settings.path_roots.split(",") if root.strip()]
    app.state.tool_catalog = load_catalog(settings.tool_catalog)
    app.state.job_changes = JobChanges(app.state.redis)
    app.state.stream_slots = StreamSlots(settings.max_event_streams)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    app.include_router(metrics_router())
    app.state.operators = {name.strip() for name in settings.operators.split(",") if name.strip()}
    app.include_router(jobs_router())
    app.include_router(job_control_router())
    app.include_router(job_records_router())
    app.include_router(conversations_router())
    app.include_router(servers_router())
    app.include_router(page_router())
    return app


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A 422 as FastAPI writes it, each location naming the field as the spec is written
    (`services.config.written_location`: without the tags of the models pydantic picked)."""
    errors = []
    for error in exc.errors():
        loc = tuple(error.get("loc", ()))
        if loc[:1] == ("body",):
            loc = ("body", *written_location(loc[1:], error.get("type", "")))
        errors.append({**error, "loc": loc})
    return await request_validation_exception_handler(request, RequestValidationError(errors))


def jobs_router() -> APIRouter:
    """The job routes: submit, list, read, events."""
    router = APIRouter()

    @router.post(
        "/v1/jobs",
        status_code=201,
        response_model=JobCreated,
        responses={status: {"model": Error} for status in (400, 401, 402, 413, 429)},
    )
    async def submit(spec: JobSpec, request: Request, who: str = Depends(tenant)) -> JobCreated:
        settings = request.app.state.settings
        spec = await admitted(spec, request)
        await expire_own(request, who)
        await month_not_spent(request, who)
        try:
            job_id = await jobs.create_job(request.app.state.redis, spec, who, settings.max_pending_jobs)
        except jobs.QueueFull as exc:
            raise HTTPException(429, str(exc)) from None
        return JobCreated(id=job_id, status=jobs.JobStatus.PENDING)

    @router.get("/v1/spend", response_model=TenantSpend, responses={401: {"model": Error}})
    async def spend(request: Request, who: str = Depends(tenant)) -> TenantSpend:
        """What the tenant's jobs' LLM calls cost this month, and the operator's cap on it."""
        month = await bills.month(request.app.state.redis, who, request.app.state.settings.tenant_budget)
        return TenantSpend(**month.view())

    @router.get("/v1/jobs", response_model=list[JobView], responses={401: {"model": Error}})
    async def list_jobs(
        request: Request, limit: int = Query(100, ge=1, le=1000), who: str = Depends(tenant)
    ) -> list[JobView]:
        await expire_own(request, who)
        return [JobView(**r) for r in await jobs.list_jobs(request.app.state.redis, who, limit)]

    @router.get("/v1/jobs/{job_id}", response_model=JobView, responses=ERRORS)
    async def get(request: Request, record: dict = Depends(owned)) -> JobView:
        return JobView(**record, spend=await jobs.job_spend(request.app.state.redis, record["id"]))

    @router.get(
        "/v1/jobs/{job_id}/events",
        responses=ERRORS | {429: {"model": Error}, 200: {"content": {"text/event-stream": {}}}},
    )
    async def events(request: Request, record: dict = Depends(owned), who: str = Depends(tenant)) -> StreamingResponse:
        """Server-sent events: `status` on every status change, `step` for every SFT/RL step
        record, `health` for every health rule that fired, `servers` for every change in the
        rollout servers on the job, until the job ends. A tenant holds at most
        `max_event_streams` at once (429)."""
        slots: StreamSlots = request.app.state.stream_slots
        slots.take(who)
        stream = job_events(request.app.state.redis, record["id"], request.app.state.job_changes)
        return StreamingResponse(slots.held_by(who, stream), media_type="text/event-stream")

    return router


def job_control_router() -> APIRouter:
    """The routes that change a job's course: cancel, resume."""
    router = APIRouter()

    @router.post("/v1/jobs/{job_id}/cancel", response_model=JobView, responses=ERRORS)
    async def cancel(request: Request, record: dict = Depends(owned)) -> JobView:
        """A pending job ends CANCELLED; a running one is asked to stop (the learner ends it
        CANCELLED at its next step); an ended one is left as it is."""
        client = request.app.state.redis
        await jobs.cancel(client, record["id"], request.app.state.settings.job_retention_s)
        return await job_view(client, record["id"])

    @router.post(
        "/v1/jobs/{job_id}/resume",
        response_model=JobView,
        responses=ERRORS | {400: {"model": Error}, 409: {"model": Error}, 429: {"model": Error}},
    )
    async def resume(request: Request, body: ResumeRequest | None = None, record: dict = Depends(owned)) -> JobView:
        """A FAILED or CANCELLED job, or one a spend cap ended, is queued again (PENDING) and a
        learner continues it from its newest complete checkpoint; its keys are kept again.
        `budget` replaces the job's caps (each above what it spent, else 422 naming the
        field). 409 says why not: it has not ended, it SUCCEEDED otherwise, or it recorded no
        checkpoint. 429: the tenant's queue is full."""
        client = request.app.state.redis
        budget = body.budget if body is not None else None
        try:
            await jobs.resume(client, record["id"], request.app.state.settings.max_pending_jobs, budget)
        except jobs.BudgetTooLow as exc:
            raise HTTPException(422, [{"loc": ["body", "budget", exc.field], "msg": str(exc)}]) from None
        except jobs.NotResumable as exc:
            raise HTTPException(409, str(exc)) from None
        except jobs.QueueFull as exc:
            raise HTTPException(429, str(exc)) from None
        return await job_view(client, record["id"])

    return router


async def job_view(client: aioredis.Redis, job_id: str) -> JobView:
    """The job as it is now; 404 when its record is gone (its retention ran out meanwhile)."""
    record = await jobs.get_job(client, job_id)
    if record is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return JobView(**record)


async def method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
    """405 whose `Allow` lists every method of the path (Starlette names only the first
    route that matched it, e.g. POST for /v1/jobs, which also has GET)."""
    allowed = {
        method
        for route in request.app.routes
        if isinstance(route, APIRoute) and route.matches(request.scope)[0] != Match.NONE
        for method in route.methods
    }
    return JSONResponse({"detail": "Method Not Allowed"}, 405, headers={"Allow": ", ".join(sorted(allowed))})
