"""The judge proxy's HTTP API: every LLM call of the system goes through here.

- `POST /v1/chat/completions`: OpenAI-compatible; the upstream's reply (with `usage`) is
  passed through; with `stream: true` its server-sent events are relayed as they arrive.
- `GET /v1/models` (and `/v1/models/{model}`): the model names this proxy serves.
- `POST /v1/judge`: `{rubric, messages, reference?, model?, cache?}` -> `{score, criteria,
  verdict, raw, usage, remembered}`; 404 for an unknown rubric, 502 `unparseable verdict`
  (with the raw replies) when the judge's reply cannot be read twice.
- `POST /v1/judge/group`: `{rubric, candidates: [[message...]...], reference?, model?, cache?}`
  -> `{results: [verdict...], usage, fallback, remembered}`: every candidate scored in one
  judge call where the reply allows (`judge_proxy.judge.GroupVerdicts`).
- `GET /v1/spend`: the caller's job's bill so far (`judge_proxy.spend`): usd, tokens, cached,
  calls, by role; a job's credential reads only its own job's.
- `GET /v1/budget`: limits and every part of the shared state per upstream (levels, the
  pacing bucket, leases, totals, the learned ratio and the outlier counts; never keys).
- `GET /v1/upstreams`: each upstream's circuit (state, since, failures, reason, seconds to
  the next probe) and whether each model is available, with the reason when not.
- `/metrics`, `/healthz` (always 200: `status` is `degraded`, with the reasons, while every
  upstream of some model is down).

Request headers: `Authorization: Bearer <token>` (required when `client_tokens` is set: one of
them, or a job's credential made with one, which is how the proxy knows the job a call is
charged to), `X-Tandem-Job` (jobs share a model's budget by their `judge_weight` and take
turns in the queue; with tokens it may only repeat the credential's job), `X-Tandem-Priority: judge|simulator`
(default simulator for chat; /v1/judge is
always judge), `X-Tandem-Role: simulator|judge|extraction|eval` (what the job's bill calls
the request, `judge_proxy.spend`; default its priority), `X-Request-Id` (optional) and
`Idempotency-Key` (optional: a retry with the same key and body gets the stored reply, and
no second upstream call; `judge_proxy.memory`).
Response headers: `X-Request-Id` on every response (the client's when it sent a usable one,
else a new one; log lines of the request carry it), and on chat replies `X-Tandem-Upstream`
(who answered), `X-Tandem-Remembered: true` on a reply from memory,
`Server-Timing: queue;dur=<ms>, upstream;dur=<ms>` and OpenAI's
`x-ratelimit-limit|remaining|reset-requests|tokens` for the budget the model's upstreams
share across all replicas. Errors have OpenAI's shape, `{"error": {"message", "type",
"param", "code"}}`: malformed JSON or a bad field 400 (`param` and the message name the
field), a body over `max_request_bytes` 413, a model group a job may not use
(`job_models`) 403, unknown model, rubric or route 404, no budget before the deadline 429
with `Retry-After`, failing upstreams 502 (a reply over `max_reply_bytes` or nested too deep
among the failures), every upstream of the model down 503
`upstream_unavailable` with `Retry-After` (the next probe), the budget store unreachable 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from redis.exceptions import RedisError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from judge_proxy.calls import Completion
from judge_proxy.errors import ProxyError, UpstreamClientError
from judge_proxy.gateway import Gateway
from judge_proxy.proxy import Proxy
from judge_proxy.queue import PRIORITIES
from judge_proxy.replies import joined_within
from judge_proxy.rubrics import RUBRICS, Rubric
from judge_proxy.spend import ROLE, role_of
from judge_proxy.upstream import Upstream
from services import bills
from services.auth import credential_job, match_bearer
from services.config import JudgeProxySettings
from services.judge_api import GroupJudgeRequest, GroupJudgeResult, JudgeRequest, JudgeResult
from services.logs import REQUEST_ID
from services.metrics import metrics_router
from services.queues import Keys

log = logging.getLogger(__name__)


class ContentPart(BaseModel):
    """One part of a parts-list `content`; the text of `text` parts is counted against the budget."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(min_length=1)
    text: str | None = Field(None, description="A string; required when `type` is 'text'.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _parts_are_well_formed(cls, content: str | list[dict[str, Any]] | None) -> str | list | None:
        for index, part in enumerate(content if isinstance(content, list) else []):
            try:
                parsed = ContentPart.model_validate(part)
            except ValidationError as err:
                raise ValueError(f"part {index}: {describe(err)}") from None
            if parsed.type == "text" and parsed.text is None:
                raise ValueError(f"part {index}: a 'text' part needs a string 'text'")
        return content


class ChatRequest(BaseModel):
    """The fields the proxy reads; every other field goes upstream unchanged."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class UpstreamBudget(BaseModel):
    name: str
    model: str
    tpm: int
    rpm: int
    max_concurrency: int
    weight: float
    available_tokens: float
    available_requests: float
    paused_for_s: float
    inflight: int
    used_tokens_total: int
    used_requests_total: int
    tokens_reset_s: float
    requests_reset_s: float
    limit_model: str
    prompt_ratio: float = Field(description="Learned prompt tokens the upstream counts per estimated one.")
    prompt_outliers: int = Field(0, description="Calls outside the prompt-ratio band, not learned from.")
    prompt_calls: int = Field(0, description="Calls the prompt ratio was learned from.")
    usage_outliers: int = Field(
        0, description="Replies reporting more tokens than their request could cost, charged that bound instead."
    )
    pace_tokens: float | None = Field(
        None, description="A paced window's pacing bucket: tokens it holds now (null for a bucket or no pacing)."
    )
    pace_requests: float | None = Field(None, description="Requests the pacing bucket holds now.")


class BudgetResponse(BaseModel):
    upstreams: list[UpstreamBudget]


class UpstreamState(BaseModel):
    name: str
    model: str
    state: str = Field(description="closed, open (no call is sent) or half_open (one probe call is out).")
    since: float = Field(description="Epoch seconds the current failure streak or outage began; 0 when none.")
    failures: int = Field(description="Consecutive failed calls, across replicas (429s apart).")
    reason: str = Field(description="The newest failure, e.g. `timeout (no first byte in 20 s)`.")
    next_probe_s: float = Field(description="Seconds until a call may go to it again; 0 when closed.")


class ModelState(BaseModel):
    available: bool
    reason: str = Field(description="Why not, naming each upstream; empty when available.")


class UpstreamsResponse(BaseModel):
    upstreams: list[UpstreamState]
    models: dict[str, ModelState]


class ModelCard(BaseModel):
    """OpenAI's model object."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "tandem-judge-proxy"
    structured_output: bool = Field(
        False,
        description="Its upstreams keep a reply to a JSON schema given as "
        "`response_format` (Tandem's extension of OpenAI's object).",
    )


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


def create_app(settings: JudgeProxySettings) -> FastAPI:
    proxy = Proxy.from_settings(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway = proxy.gateway
        watchers = [asyncio.create_task(gateway.watch_budgets()), asyncio.create_task(gateway.health.watch())]
        yield
        for watcher in watchers:
            watcher.cancel()
        await proxy.aclose()

    app = FastAPI(
        title="Tandem judge proxy",
        version="0.1.0",
        lifespan=lifespan,
        exception_handlers={
            ProxyError: proxy_error,
            UpstreamClientError: upstream_client_error,
            RedisError: budget_store_error,
            HTTPException: http_error,
        },
    )
    app.state.proxy = proxy
    app.include_router(metrics_router(proxy.gateway.health.report))
    app.add_middleware(RequestIdMiddleware)
    authorize = client_auth(settings.client_tokens)
    app.include_router(chat_router(proxy, authorize, settings))
    app.include_router(judge_router(proxy, authorize, settings))
    app.include_router(info_router(proxy.gateway, authorize))
    return app


def chat_router(proxy: Proxy, authorize: Callable[[Request], str], settings: JudgeProxySettings) -> APIRouter:
    """OpenAI's chat completions, through the gateway; a reply the memory keeps is settled whole."""
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        job = authorize(request)
        body = await json_object(request, settings.max_request_bytes)
        chat = validated(ChatRequest, body)
        model_for(settings, job, chat.model)
        max_tokens = chat.max_completion_tokens or chat.max_tokens or settings.default_max_tokens
        priority = priority_of(request)
        charged_as(request, priority)
        tag = request.headers.get("idempotency-key", "")
        key = proxy.chat_memory_key(body, job, tag)
        gateway = proxy.gateway
        if key is None:
            completion = await gateway.complete(body, max_tokens, chat.n, job=job, priority=priority, tag=tag)
            return await completion_response(gateway, completion, chat.model)
        content, remembered = await proxy.memory.once(
            key, job, lambda: whole_body(gateway, body, max_tokens, chat.n, job, priority, tag)
        )
        headers = await gateway.limit_headers(gateway.group(chat.model))
        if remembered:
            headers["x-tandem-remembered"] = "true"
        return Response(content, media_type="application/json", headers=headers)

    return router


async def whole_body(gateway: Gateway, body: dict, max_tokens: int, n: int, job: str, priority: str, tag: str) -> bytes:
    """A chat reply's bytes, its budget settled: what the memory stores and replays."""
    return (await gateway.settled(body, max_tokens, n, job=job, priority=priority, tag=tag)).body


def judge_router(proxy: Proxy, authorize: Callable[[Request], str], settings: JudgeProxySettings) -> APIRouter:
    """A rubric's verdict on one conversation, or on several in one judge call."""
    router = APIRouter()

    @router.post("/v1/judge", response_model=JudgeResult)
    async def judge(request: Request) -> JudgeResult:
        job = authorize(request)
        charged_as(request, "judge")
        ask = validated(JudgeRequest, await json_object(request, settings.max_request_bytes))
        rubric = rubric_for(ask.rubric, ask.reference)
        return await proxy.judge.single(
            rubric,
            [t.model_dump() for t in ask.messages],
            ask.reference,
            model_for(settings, job, ask.model or settings.judge_model),
            job,
            cache=ask.cache,
            idempotency_key=request.headers.get("idempotency-key"),
        )

    @router.post("/v1/judge/group", response_model=GroupJudgeResult)
    async def judge_group(request: Request) -> GroupJudgeResult:
        job = authorize(request)
        charged_as(request, "judge")
        ask = validated(GroupJudgeRequest, await json_object(request, settings.max_request_bytes))
        rubric = rubric_for(ask.rubric, ask.reference)
        candidates = [[t.model_dump() for t in c] for c in ask.candidates]
        return await proxy.judge.group(
            rubric,
            candidates,
            ask.reference,
            model_for(settings, job, ask.model or settings.judge_model),
            job,
            cache=ask.cache,
            idempotency_key=request.headers.get("idempotency-key"),
        )

    @router.get("/v1/spend", response_model=JobBill)
    async def spend(request: Request) -> JobBill:
        """What the caller's job (its credential's; `X-Tandem-Job` without tokens) has been
        charged so far; 400 for a caller charged to no job."""
        job = authorize(request)
        if not job:
            why = "the caller is charged to no job: send a job's credential (or X-Tandem-Job without tokens)"
            raise ProxyError(400, why, "invalid_request_error")
        return JobBill(job=job, **bills.bill_of(await proxy.redis.hgetall(Keys.job_spend(job))))

    return router


class JobBill(bills.BillView):
    """A job's bill at the proxy (`judge_proxy.spend`)."""

    job: str


def model_for(settings: JudgeProxySettings, job: str, model: str) -> str:
    """`model`, when the caller may ask for it: a call charged to a job only for a model group
    in `job_models` (when set); 403 otherwise."""
    allowed = [m.strip() for m in settings.job_models.split(",") if m.strip()]
    if job and allowed and model not in allowed:
        raise ProxyError(
            403, f"a job may not use model {model!r}; jobs may use {allowed}", "permission_denied", param="model"
        )
    return model


def rubric_for(name: str, reference: str | None) -> Rubric:
    rubric = RUBRICS.get(name)
    if rubric is None:
        raise ProxyError(404, f"unknown rubric {name!r}; known: {sorted(RUBRICS)}", "rubric_not_found", param="rubric")
    if rubric.needs_reference and reference is None:
        raise ProxyError(400, f"rubric {rubric.name!r} needs a reference", "invalid_request_error", param="reference")
    return rubric


async def completion_response(gateway: Gateway, completion: Completion, model: str) -> Response:
    """The reply to a chat request: the upstream's JSON, or its stream, with our headers."""
    try:
        headers = {**timing_headers(completion), **await gateway.limit_headers(gateway.group(model))}
    except BaseException:
        if completion.stream is not None:
            await completion.stream.aclose()  # settles its reservation
        raise
    if completion.stream is not None:
        return StreamingResponse(completion.stream, media_type="text/event-stream", headers=headers)
    return Response(
        completion.body, media_type="application/json", headers=headers, background=BackgroundTask(completion.settle)
    )


def upstream_budget(upstream: Upstream, view: object) -> UpstreamBudget:
    """One upstream's configured limits beside its shared budget state (`Budget.view`)."""
    config = upstream.config
    return UpstreamBudget(
        name=upstream.name,
        model=config.model,
        tpm=config.tpm,
        rpm=config.rpm,
        max_concurrency=config.max_concurrency,
        weight=config.weight,
        limit_model=config.limit_model,
        **vars(view),
    )


def info_router(gateway: Gateway, authorize: Callable[[Request], str]) -> APIRouter:
    """What the proxy serves: its models (OpenAI's list) and its upstreams' budgets."""
    router = APIRouter()

    @router.get("/v1/models", response_model=ModelList)
    async def models(request: Request) -> ModelList:
        authorize(request)
        return ModelList(
            data=[
                ModelCard(id=name, structured_output=group.structured) for name, group in sorted(gateway.groups.items())
            ]
        )

    @router.get("/v1/models/{model:path}", response_model=ModelCard)
    async def model(model: str, request: Request) -> ModelCard:
        authorize(request)
        group = gateway.group(model)
        return ModelCard(id=group.model, structured_output=group.structured)

    @router.get("/v1/budget", response_model=BudgetResponse)
    async def budget(request: Request) -> BudgetResponse:
        authorize(request)
        views = await asyncio.gather(*(u.budget.view() for u in gateway.upstreams))
        return BudgetResponse(upstreams=[upstream_budget(u, view) for u, view in zip(gateway.upstreams, views)])

    @router.get("/v1/upstreams", response_model=UpstreamsResponse)
    async def upstreams(request: Request) -> UpstreamsResponse:
        authorize(request)
        healths, now = await gateway.health.read()
        models = {model: gateway.health.outage(model) for model in sorted(gateway.groups)}
        return UpstreamsResponse(
            upstreams=[
                UpstreamState(
                    name=h.name,
                    model=h.model,
                    state=h.state,
                    since=h.since,
                    failures=h.failures,
                    reason=h.reason,
                    next_probe_s=h.next_probe_s(now),
                )
                for h in healths
            ],
            models={
                model: ModelState(available=outage is None, reason=outage.reason if outage else "")
                for model, outage in models.items()
            },
        )

    return router


def client_auth(tokens: str) -> Callable[[Request], str]:
    """A check of the caller's credential that returns the job the call is charged to ("" for
    none). With tokens, the job comes from the credential: a job's credential
    (`services.auth.job_credential`) charges that job, a plain token no job; an
    `X-Tandem-Job` naming another job is a 403, so no caller spends another job's share.
    Without tokens (loopback only, the operator's own machine) the header is believed."""
    allowed = [t.strip() for t in tokens.split(",") if t.strip()]

    def check(request: Request) -> str:
        claimed = request.headers.get("x-tandem-job", "")
        if not allowed:
            return claimed
        authorization = request.headers.get("authorization", "")
        job = credential_job(authorization, allowed)
        if job is None and match_bearer(authorization, allowed) is None:
            raise ProxyError(401, "missing or unknown bearer token", "unauthorized")
        job = job or ""
        if claimed and claimed != job:
            raise ProxyError(
                403,
                f"X-Tandem-Job {claimed!r} is not the job this credential was issued for ({job or 'none'})",
                "permission_denied",
            )
        return job

    return check


async def json_object(request: Request, max_bytes: int) -> dict:
    """The request's JSON object: 413 for a body over `max_bytes` (read no further), 400 for
    one that is not a JSON object or nests past the parser's recursion limit."""
    try:
        body = json.loads(await capped_body(request, max_bytes))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProxyError(400, f"malformed JSON body: {err}", "invalid_request_error") from None
    except RecursionError:
        raise ProxyError(400, "malformed JSON body: nested too deep", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "the JSON body must be an object", "invalid_request_error")
    return body


async def capped_body(request: Request, max_bytes: int) -> bytes:
    """The body, or 413 once it says or proves to be over `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if not (declared.isdigit() and int(declared) > max_bytes):
        body = await joined_within(request.stream(), max_bytes)
        if body is not None:
            return body
    raise ProxyError(413, f"the request body is over {max_bytes} bytes", "request_too_large")


def validated(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = ".".join(str(p) for p in err.errors()[0]["loc"])
        raise ProxyError(400, f"invalid request: {describe(err)}", "invalid_request_error", param=first) from None


def describe(err: ValidationError) -> str:
    """Each error as `field.path: message`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())


def priority_of(request: Request) -> str:
    priority = request.headers.get("x-tandem-priority", "simulator").lower()
    if priority not in PRIORITIES:
        raise ProxyError(
            400, f"X-Tandem-Priority must be one of {list(PRIORITIES)}, not {priority!r}", "invalid_request_error"
        )
    return priority


def charged_as(request: Request, priority: str) -> None:
    """The role this request's calls are charged to its job as (`X-Tandem-Role`, else its
    priority; `judge_proxy.spend`); 400 naming the roles for another."""
    try:
        ROLE.set(role_of(request.headers.get("x-tandem-role", ""), priority))
    except ValueError as err:
        raise ProxyError(400, str(err), "invalid_request_error") from None


def timing_headers(completion: Completion) -> dict[str, str]:
    return {
        "x-tandem-upstream": completion.upstream,
        "server-timing": f"queue;dur={completion.queue_s * 1e3:.3f}, upstream;dur={completion.upstream_s * 1e3:.3f}",
    }


async def proxy_error(request: Request, error: ProxyError) -> JSONResponse:
    headers = {"retry-after": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def budget_store_error(request: Request, error: RedisError) -> JSONResponse:
    """Redis, where the shared budget lives, failed or had no free connection: a 503 the
    client may retry (no upstream call was made without its reservation)."""
    log.warning("budget store error: %s: %s", type(error).__name__, error)
    message = f"the shared budget store is unavailable ({type(error).__name__}: {error})"
    return JSONResponse(
        ProxyError(503, message, "budget_store_unavailable").body(), status_code=503, headers={"retry-after": "1"}
    )


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    """The framework's own errors (no such route, method not allowed) in OpenAI's shape."""
    kind = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "invalid_request_error")
    message = f"{request.method} {request.url.path}: {error.detail}"
    return JSONResponse(
        ProxyError(error.status_code, message, kind).body(),
        status_code=error.status_code,
        headers=getattr(error, "headers", None),
    )


REQUEST_ID_FORM = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestIdMiddleware:
    """`x-request-id` on every response: the client's, when it sent one of a sane form, else
    a new one. It is set in `REQUEST_ID` for the request's log lines. (Plain ASGI, so
    streamed replies pass through untouched.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = sent if REQUEST_ID_FORM.match(sent) else f"req_{uuid.uuid4().hex}"
        token = REQUEST_ID.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


async def upstream_client_error(request: Request, error: UpstreamClientError) -> Response:
    return Response(error.body, status_code=error.status, media_type="application/json")
