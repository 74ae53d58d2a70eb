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
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import msgspec
import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.routing import Match

from services import bills, jobs, preference, protocol
from services.api.events import JobChanges, StreamSlots, job_events
from services.api.page import page_router
from services.auth import match_bearer
from services.config import ApiSettings, BudgetSpec, JobSpec, ToolCatalog, ToolsSpec, file_fields, written_location
from services.metrics import metrics_router
from services.queues import FIELD, GROUPS_KEPT, Keys, connect
from services.tool_catalog import CatalogError, bind_servers, load_catalog, with_file_tools


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
    paused_reason: str | None = Field(None, description="PAUSED: what the job waits on, as the learner sees it.")
    paused_since: float | None = None
    warning: str | None = Field(
        None, description="RUNNING or PAUSED, but nothing moves it: its learner has gone silent, and why."
    )
    metrics: dict = Field(default_factory=dict, description="The latest step's metrics.")
    alerts: list[str] = Field(default_factory=list, description="Health rules that fired, oldest first.")
    held_out: dict = Field(
        default_factory=dict,
        description="The latest held-out evaluation (job spec `eval`): its step, success and the task's metrics; "
        "empty before the first.",
    )
    spend: dict = Field(
        default_factory=dict,
        description="What its LLM calls cost so far, as the judge proxy charged them: usd, tokens, cached, calls, "
        "and by_role (simulator, judge, extraction, eval); only on GET /v1/jobs/{id}.",
    )
    resumes: int = Field(0, description="Times the job was resumed after it ended (`POST /v1/jobs/{id}/resume`).")
    resumed_from: str | None = Field(None, description="The status the job had when it was last resumed.")
    resumed_error: str | None = Field(None, description="The error it had then, if any.")
    spec: JobSpec


class ResumeRequest(BaseModel):
    """What may change when an ended job is resumed."""

    model_config = ConfigDict(extra="forbid")

    budget: BudgetSpec | None = Field(
        None, description="New caps on what its LLM calls cost (a raised cap for a job a cap ended); kept when unset."
    )


class TenantSpend(bills.BillView):
    """What a tenant's jobs' LLM calls cost this calendar month (UTC), as the judge proxy
    charged them, and the operator's cap on it (`TANDEM_TENANT_BUDGET_USD`, `..._TOKENS`)."""

    period: str = Field(description="The month, `2026-11`.")
    cap: BudgetSpec


class HeldOutConversation(BaseModel):
    """One conversation of a held-out round, as a rollout server played and scored it."""

    round: int = Field(description="The step (policy version) whose round it belongs to.")
    example: int
    trial: int
    server_id: str
    metrics: dict[str, float] = Field(description="success, tokens, turns, well_formed, the task's metrics, judge.")
    versions: list[int] = Field(description="The oldest and newest weight version behind its tokens.")
    seconds: float
    conversation: list[dict[str, str]] = Field(description="role and content of each message, as played.")


class JobCreated(BaseModel):
    id: str
    status: jobs.JobStatus


class Checkpoint(BaseModel):
    step: int
    version: int
    path: str
    time: float


class Dataset(BaseModel):
    """A file a generate job wrote (it grows while the job runs)."""

    name: str
    path: str
    rows: int
    description: str


class Error(BaseModel):
    detail: str


class RolloutServerView(BaseModel):
    server_id: str
    job_id: str = Field(description='The job it serves ("" when idle).')
    version: int = Field(description="Weight version it serves; -1 before its first update.")
    capacity: int
    inflight: int
    engine: str = Field(description="The model its engine has loaded.")
    heartbeat_age_s: float
    draining: bool = Field(description="Leaving its job (SIGTERM or a drain request).")
    drain_requested: bool = Field(description="Asked to drain through this API; idles until the request is lifted.")


class Membership(BaseModel):
    """A change in the rollout servers on a job, as the learner saw it."""

    time: float
    servers: list[str]
    joined: list[str]
    left: dict[str, str] = Field(
        description="Server -> why: draining, exited (after a drain or a stop), or no heartbeat for N s."
    )


ERRORS = {401: {"model": Error}, 403: {"model": Error}, 404: {"model": Error}}
REDIS_CONNECTIONS = 64
REDIS_CONNECTION_WAIT_S = 10.0
FORGET_SERVER_S = 3600.0
"""A server record this old is a dead server's (a live one rewrites it every few seconds):
the fleet listing deletes it."""


def parse_tokens(spec: str) -> dict[str, str]:
    """'token:tenant,token2:tenant2' -> {token: tenant}."""
    pairs = [item.strip().split(":", 1) for item in spec.split(",") if item.strip()]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise ValueError("TANDEM_TOKENS must look like 'token:tenant,token2:tenant2'")
    return {token: tenant for token, tenant in pairs}


def confine_paths(spec: JobSpec, roots: list[Path]) -> JobSpec:
    """`spec` with each field naming a file (`file_fields`: the model's, the task's, the
    tools' and their data files, ...) resolved, symlinks and '..' followed, as this process
    sees the files; a 422 naming every field that resolves outside `roots`. The resolved
    paths are what the job keeps, so the learner and rollout servers open what was checked,
    whatever their working directory."""
    confined, errors = spec.model_copy(deep=True), []
    for loc, owner, name in list(file_fields(confined)):
        inside = confine(getattr(owner, name), roots)
        if inside is not None:
            setattr(owner, name, inside)
        else:
            errors.append(outside_error(getattr(owner, name), roots, ("body", *loc)))
    if errors:
        raise RequestValidationError(errors)
    return confined


def check_tools(spec: JobSpec, settings: ApiSettings, catalog: ToolCatalog, roots: list[Path] | None) -> JobSpec:
    """`spec`, or a 422 naming the field: a tools file that is here and does not hold valid
    tools, an MCP server the operator's catalogue does not allow, a data file of the tools
    file's outside `roots` (None: not confined; the spec's own files are confined before,
    `confine_paths`). A tools file this process cannot see is left to the rollout servers,
    which fail the job with the same messages (the API may run on another machine)."""
    if spec.tools is None:
        return spec
    num_inline = len(spec.tools.tools)
    tools = spec.tools
    if tools.file is not None and Path(tools.file).is_file():
        tools = _resolved_tools(spec, settings.max_tools_file_bytes)
        for loc, owner, name in file_fields(tools):
            if roots is not None and loc[:1] == ("tools",) and loc[1] >= num_inline:
                confined_path(
                    getattr(owner, name),
                    roots,
                    ("body", "tools", "file"),
                    f"tool {loc[1] - num_inline} of the file: {name} ",
                )
    try:
        bind_servers(tools, catalog, settings.allow_inline_mcp)
    except CatalogError as exc:
        loc = ("body", "tools", "tools", exc.index, "server") if exc.index < num_inline else ("body", "tools", "file")
        raise RequestValidationError([{"type": "value_error", "loc": loc, "msg": str(exc)}]) from None
    return spec


def _resolved_tools(spec: JobSpec, max_bytes: int) -> ToolsSpec:
    """The spec's tools with its tools file's added, or a 422 naming `tools.file`: a file
    over `max_bytes` is not read (a large file is no tools file, and parsing it is slow)."""
    try:
        size_bytes = Path(spec.tools.file).stat().st_size
        if size_bytes > max_bytes:
            raise ValueError(
                f"tools.file is {size_bytes} bytes; a tools file is at most {max_bytes} (TANDEM_MAX_TOOLS_FILE_BYTES)"
            )
        return with_file_tools(spec.tools)
    except (OSError, ValueError) as exc:
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("body", "tools", "file"), "input": spec.tools.file, "msg": str(exc)}]
        ) from None


def confined_path(path: str, roots: list[Path], loc: tuple, what: str = "") -> str:
    """`path` resolved under `roots`, or a 422 at `loc`."""
    inside = confine(path, roots)
    if inside is None:
        raise RequestValidationError([outside_error(path, roots, loc, what)])
    return inside


def confine(path: str, roots: list[Path]) -> str | None:
    """`path` with symlinks and '..' resolved, if that lies under one of `roots`; else None."""
    resolved = resolve(path)
    if resolved is None or not any(resolved.is_relative_to(root) for root in roots):
        return None
    return str(resolved)


def outside_error(path: str, roots: list[Path], loc: tuple, what: str = "") -> dict:
    return {
        "type": "value_error",
        "loc": loc,
        "input": path,
        "msg": f"{what}must lie under {', '.join(map(str, roots))} (symlinks and '..' resolved)",
    }


def check_judge_weight(spec: JobSpec, settings: ApiSettings) -> None:
    """A 422 naming `judge_weight` above the operator's cap: a tenant does not choose a larger
    share of the shared judge budget than the operator allows."""
    if spec.judge_weight > settings.max_judge_weight:
        raise RequestValidationError(
            [
                {
                    "type": "less_than_equal",
                    "loc": ("body", "judge_weight"),
                    "input": spec.judge_weight,
                    "msg": f"must be at most {settings.max_judge_weight:g} on this server",
                }
            ]
        )


def check_tracking(spec: JobSpec, settings: ApiSettings) -> None:
    """A 422 naming `tracking.wandb.mode` for an online run the operator does not allow: the
    learner would send a tenant's numbers out under the operator's key."""
    wandb = spec.tracking.wandb if spec.tracking is not None else None
    if wandb is not None and wandb.mode == "online" and not settings.allow_online_tracking:
        raise RequestValidationError(
            [
                {
                    "type": "value_error",
                    "loc": ("body", "tracking", "wandb", "mode"),
                    "input": "online",
                    "msg": "online tracking is off on this server (TANDEM_ALLOW_ONLINE_TRACKING): use offline",
                }
            ]
        )


def check_spec_size(spec: JobSpec, settings: ApiSettings) -> None:
    """A 413 for a spec whose stored form (its JSON) is over `max_spec_bytes`."""
    size_bytes = len(spec.model_dump_json().encode())
    if size_bytes > settings.max_spec_bytes:
        raise HTTPException(
            413, f"the job spec is {size_bytes} bytes; at most {settings.max_spec_bytes} (TANDEM_MAX_SPEC_BYTES)"
        )


def check_pairs_file(spec: JobSpec) -> None:
    """A 422 naming `train.data` when an offline job's pairs file is here and a row of it is
    not a pair (the message names the line). As for tools, a file this process cannot see
    is checked by the learner, which fails the job with the same message."""
    if not spec.train.data or not Path(spec.train.data).is_file():  # only an offline job sets it
        return
    try:
        for _ in preference.read_pairs(spec.train.data, max_pair_tokens=spec.train.max_tokens_per_rank):
            pass  # every row checked; none kept
    except ValueError as exc:
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("body", "train", "data"), "input": spec.train.data, "msg": str(exc)}]
        ) from None


def resolve(path: str) -> Path | None:
    """The absolute path with symlinks followed; None for a name no file can have (a NUL
    byte, an unencodable character) or a symlink loop."""
    try:
        return Path(path).resolve()
    except (OSError, ValueError, RuntimeError):
        return None


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
    app.add_exception_handler(405, method_not_allowed)
    app.add_exception_handler(RequestValidationError, validation_error)
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


def tenant(request: Request) -> str:
    """The caller's tenant, from its bearer token ("" when the API has no tokens)."""
    tokens: dict[str, str] = request.app.state.tokens
    if not tokens:
        return ""
    token = match_bearer(request.headers.get("authorization", ""), tokens)
    if token is None:
        raise HTTPException(401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})
    return tokens[token]


async def expire_own(request: Request, who: str) -> None:
    """End the caller's jobs that have waited in the queue past `pending_ttl_s`, so that
    what it reads and its quota say so even while no learner looks at the queue."""
    settings = request.app.state.settings
    await jobs.expire_pending(request.app.state.redis, [who], settings.pending_ttl_s, settings.job_retention_s)


async def owned(request: Request, job_id: str, who: str = Depends(tenant)) -> dict:
    """The job's record, if it exists (404) and belongs to the caller (403)."""
    await expire_own(request, who)
    client = request.app.state.redis
    record = await jobs.get_job(client, job_id) if jobs.is_job_id(job_id) else None
    if record is None and jobs.is_job_id(job_id) and await client.zscore(Keys.jobs_index, job_id) is not None:
        raise HTTPException(
            404, f"job {job_id!r} ended and its record was deleted after its retention (TANDEM_JOB_RETENTION_S)"
        )
    if record is None:
        raise HTTPException(404, f"no job {job_id!r}")
    if record.get("tenant", "") != who:
        raise HTTPException(403, f"job {job_id!r} belongs to another tenant")
    return record


async def admitted(spec: JobSpec, request: Request) -> JobSpec:
    """`spec` as the API stores it, once every check of a submission passed (4xx naming the
    field otherwise): paths confined, judge weight, size, tools and pairs files."""
    settings = request.app.state.settings
    # Without tokens the API listens on loopback only: it is the operator's own (local use).
    roots = request.app.state.path_roots if request.app.state.tokens else None
    if roots is not None:
        spec = confine_paths(spec, roots)
    check_judge_weight(spec, settings)
    check_tracking(spec, settings)
    check_spec_size(spec, settings)
    # Files are read on a thread: a slow read or parse does not stall other requests.
    spec = await asyncio.to_thread(check_tools, spec, settings, request.app.state.tool_catalog, roots)
    await asyncio.to_thread(check_pairs_file, spec)
    return spec


async def month_not_spent(request: Request, who: str) -> None:
    """402 while the tenant's month has reached the operator's cap (`services.bills`): no
    call of a new job could be made before the month ends."""
    month = await bills.month(request.app.state.redis, who, request.app.state.settings.tenant_budget)
    if month.exhausted:
        raise HTTPException(
            402,
            f"tenant {who!r} has spent its cap for {month.period} (${month.spent['usd']:.4f} and "
            f"{month.spent['tokens']} tokens of {month.cap.limits}): no call of a new job could be made "
            "before the month ends (TANDEM_TENANT_BUDGET_USD, TANDEM_TENANT_BUDGET_TOKENS)",
        )


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
        return JobView(**await jobs.get_job(client, record["id"]))

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
        return JobView(**await jobs.get_job(client, record["id"]))

    return router


def job_records_router() -> APIRouter:
    """What a job recorded: history, checkpoints, datasets, rollout-server membership."""
    router = APIRouter()

    @router.get("/v1/jobs/{job_id}/history", response_model=list[dict], responses=ERRORS)
    async def history(
        request: Request, response: Response, start: int = Query(0, ge=0), record: dict = Depends(owned)
    ) -> list[dict]:
        """The step records from index `start` of the whole history on. Redis keeps a job's
        newest `TANDEM_HISTORY_KEEP` records (the learner's run folder keeps all), so the
        first one returned may come later: `X-Tandem-History-Start` gives its index."""
        first, raw = await jobs.read_history(request.app.state.redis, record["id"], start)
        response.headers["x-tandem-history-start"] = str(first)
        return [json.loads(r) for r in raw]

    @router.get("/v1/jobs/{job_id}/checkpoints", response_model=list[Checkpoint], responses=ERRORS)
    async def checkpoints(request: Request, record: dict = Depends(owned)) -> list[Checkpoint]:
        raw = await request.app.state.redis.lrange(Keys.checkpoints(record["id"]), 0, -1)
        return [Checkpoint(**json.loads(r)) for r in raw]

    @router.get("/v1/jobs/{job_id}/datasets", response_model=list[Dataset], responses=ERRORS)
    async def datasets(request: Request, record: dict = Depends(owned)) -> list[Dataset]:
        """The files a generate job wrote: `sft` (a warm start's data) and `pairs` (an
        offline job's train.data); none for other kinds."""
        raw = await request.app.state.redis.hgetall(Keys.datasets(record["id"]))
        return [Dataset(name=name.decode(), **json.loads(value)) for name, value in sorted(raw.items())]

    @router.get("/v1/jobs/{job_id}/servers", response_model=list[Membership], responses=ERRORS)
    async def servers(request: Request, record: dict = Depends(owned)) -> list[Membership]:
        """Every change in the rollout servers on the job: who joined, who left and why."""
        raw = await request.app.state.redis.lrange(Keys.servers(record["id"]), 0, -1)
        return [Membership(**json.loads(r)) for r in raw]

    return router


def conversations_router() -> APIRouter:
    """What a job's conversations were: its held-out rounds and its recent training groups."""
    router = APIRouter()

    @router.get("/v1/jobs/{job_id}/conversations", response_model=list[HeldOutConversation], responses=ERRORS)
    async def conversations(
        request: Request,
        step: int | None = Query(None, ge=0, description="The round (its step); the newest when left out."),
        order: Literal["example", "lowest", "highest"] = Query("example", description="By example, or by success."),
        only: Literal["all", "malformed", "asked", "not_asked"] = Query("all"),
        limit: int = Query(100, ge=1, le=1000),
        record: dict = Depends(owned),
    ) -> list[HeldOutConversation]:
        """The conversations of one held-out round (`eval` in the spec): what the policy said,
        what the user answered, and how each was scored."""
        found = await held_out_conversations(request.app.state.redis, record["id"], step)
        found = [c for c in found if METRIC_FILTERS[only](c.metrics)]
        if order != "example":
            found.sort(key=lambda c: (c.metrics.get("success", 0.0), c.example, c.trial), reverse=order == "highest")
        return found[:limit]

    @router.get("/v1/jobs/{job_id}/groups", response_model=list[dict], responses=ERRORS)
    async def groups(
        request: Request,
        response: Response,
        version: int | None = Query(None, ge=0, description="Only groups whose newest tokens are of this version."),
        order: Literal["recent", "lowest", "highest"] = Query(
            "recent", description="Newest first, or by the group's lowest (highest) response reward."
        ),
        only: Literal["all", "malformed", "asked", "not_asked"] = Query("all"),
        limit: int = Query(50, ge=1, le=GROUPS_KEPT),
        record: dict = Depends(owned),
    ) -> list[dict]:
        """Recent training groups as text (`protocol.GroupView`, about the newest
        `GROUPS_KEPT`): the context, each response with its reward, advantage and the parts
        of R*, and each response's futures with the judge's verdict. `X-Tandem-Group-Versions`
        lists the versions the recorded groups came from, newest first (what `version` takes)."""
        found = await training_groups(request.app.state.redis, record["id"])
        versions = sorted({g.versions[-1] for g in found if g.versions}, reverse=True)
        response.headers["x-tandem-group-versions"] = ",".join(map(str, versions))
        if version is not None:
            found = [g for g in found if g.versions and g.versions[-1] == version]
        found = [g for g in found if GROUP_FILTERS[only](g)]
        if order != "recent":
            found.sort(key=lambda g: min(r.reward for r in g.responses), reverse=order == "highest")
        return [msgspec.to_builtins(g) for g in found[:limit]]

    return router


RESULTS_PAGE = 1000
"""Held-out results read per round trip."""


async def held_out_conversations(client, job_id: str, step: int | None) -> list[HeldOutConversation]:
    """The held-out round `step`'s conversations (the newest round's when None), by example
    and trial; a result played twice counts once, one that does not decode is skipped."""
    by_round: dict[int, dict[tuple[int, int], HeldOutConversation]] = {}
    cursor = "-"
    while entries := await client.xrange(Keys.eval_results(job_id), min=cursor, count=RESULTS_PAGE):
        for _, fields in entries:
            try:
                result = protocol.decode(fields.get(FIELD, b""), protocol.EvalResult)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                continue
            if step is None or result.round == step:
                by_round.setdefault(result.round, {})[(result.example, result.trial)] = HeldOutConversation(
                    round=result.round,
                    example=result.example,
                    trial=result.trial,
                    server_id=result.server_id,
                    metrics=result.metrics,
                    versions=result.versions,
                    seconds=result.elapsed_s,
                    conversation=result.conversation,
                )
        cursor = "(" + entries[-1][0].decode()
    if not by_round:
        return []
    chosen = by_round[step if step is not None else max(by_round)]
    return [chosen[key] for key in sorted(chosen)]


METRIC_FILTERS = {
    "all": lambda metrics: True,
    "malformed": lambda metrics: metrics.get("well_formed", 1.0) < 1.0,
    "asked": lambda metrics: metrics.get("asked", 0.0) > 0.0,
    "not_asked": lambda metrics: metrics.get("asked", 0.0) == 0.0,
}
"""Which held-out conversations `GET /v1/jobs/{id}/conversations?only=` keeps, by their metrics."""


def asked(view: protocol.GroupView) -> bool:
    return any(r.metrics.get("asked", 0.0) > 0.0 for r in view.responses)


GROUP_FILTERS = {
    "all": lambda view: True,
    "malformed": lambda view: any(r.malformed or any(f.malformed for f in r.futures) for r in view.responses),
    "asked": asked,
    "not_asked": lambda view: not asked(view),
}
"""Which groups `GET /v1/jobs/{id}/groups?only=` keeps: `malformed` has a malformed response
or future; `asked` has a response whose conversations asked the user (clarify's `asked`),
`not_asked` none."""


async def training_groups(client, job_id: str) -> list[protocol.GroupView]:
    """The job's recorded training groups, newest first; an entry that does not decode as a
    view is skipped (the stream is capped, so this reads at most about `GROUPS_KEPT`)."""
    views = []
    for _, fields in await client.xrevrange(Keys.groups(job_id), count=GROUPS_KEPT + 100):
        try:
            views.append(protocol.decode(fields.get(FIELD, b""), protocol.GroupView))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            continue
    return views


async def operator(request: Request, who: str = Depends(tenant)) -> str:
    """The caller, if it may act on the fleet: anyone without tokens, else `operators` (403)."""
    if request.app.state.tokens and who not in request.app.state.operators:
        raise HTTPException(403, f"tenant {who!r} is not an operator (TANDEM_OPERATORS)")
    return who


def servers_router() -> APIRouter:
    """The fleet routes: list rollout servers, drain one, lift a drain."""
    router = APIRouter(dependencies=[Depends(operator)])

    async def server_views(client: aioredis.Redis) -> dict[str, RolloutServerView]:
        drained = {member.decode() for member in await client.smembers(Keys.rollout_drain)}
        now, views = time.time(), {}
        infos, _ = protocol.decode_fleet(await client.hgetall(Keys.rollout_servers))
        for info in infos:
            if now - info.heartbeat > FORGET_SERVER_S:  # a live server rewrites it every few seconds
                await client.hdel(Keys.rollout_servers, info.server_id)
                continue
            views[info.server_id] = RolloutServerView(
                server_id=info.server_id,
                job_id=info.job_id,
                version=info.version,
                capacity=info.capacity,
                inflight=info.inflight,
                engine=info.engine,
                heartbeat_age_s=round(now - info.heartbeat, 1),
                draining=info.draining,
                drain_requested=info.server_id in drained,
            )
        return views

    @router.get("/v1/rollout-servers", response_model=list[RolloutServerView], responses=ERRORS)
    async def list_servers(request: Request) -> list[RolloutServerView]:
        """Every rollout server that has reported (a stopped one leaves; a killed one stays,
        its heartbeat ageing, for FORGET_SERVER_S)."""
        views = await server_views(request.app.state.redis)
        return [views[server] for server in sorted(views)]

    @router.post("/v1/rollout-servers/{server_id}/drain", response_model=RolloutServerView, responses=ERRORS)
    async def drain(request: Request, server_id: str) -> RolloutServerView:
        """The server finishes its tasks (handing back what is left after its drain timeout),
        leaves its job and takes no job until the drain is lifted."""
        return await set_drain(request.app.state.redis, server_id, True)

    @router.delete("/v1/rollout-servers/{server_id}/drain", response_model=RolloutServerView, responses=ERRORS)
    async def lift_drain(request: Request, server_id: str) -> RolloutServerView:
        """The server takes jobs again."""
        return await set_drain(request.app.state.redis, server_id, False)

    async def set_drain(client: aioredis.Redis, server_id: str, drained: bool) -> RolloutServerView:
        if server_id not in await server_views(client):
            raise HTTPException(404, f"no rollout server {server_id!r}")
        await (client.sadd if drained else client.srem)(Keys.rollout_drain, server_id)
        return (await server_views(client))[server_id]

    return router


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
