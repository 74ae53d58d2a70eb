"""The async client rollout servers use to reach the judge proxy.

It speaks only the proxy's HTTP API (`POST /v1/chat/completions`, `POST /v1/judge`), so
rollout never imports `judge_proxy`. One pooled aiohttp session per `JudgeClient`, opened
on first use in the running event loop (aiohttp, not httpx: a rollout server makes dozens
of these calls a second, and httpx's pool bookkeeping took most of the server's CPU in a
py-spy profile of bench/async_speedup.py). A 429 is
retried after its `Retry-After`; a 502/503/504 or a connection failure after exponential
backoff with jitter; at most `max_retries` times, each wait at most `max_retry_wait_s`.
Then, or at once for any other error, it raises `JudgeError`.

A 503 `upstream_unavailable` is different: the proxy says every upstream of the model is
down (its circuits are open) and when it will probe again. Failing the call would fail the
task, and a few deliveries later throw it away, for an outage no retry of the task can
fix; so the call waits, retrying at each probe, for up to `outage_wait_s`, and the client
says meanwhile what it waits on (`waiting_on`): the rollout server puts that in its
heartbeat and the learner pauses the job with it. When the upstream answers again, every
waiting call goes on where it stood.

Every call may carry an idempotency key (the proxy then sends it upstream at most once,
`judge_proxy.memory`). What the calls cost is added to the `Spend` in `SPEND`, if a caller
set one: a rollout sample sets its own, and every call made under it (its futures' user
turns, its judge calls) adds the tokens the upstream charged; a reply from the proxy's
memory cost nothing and is counted as remembered.
"""

from __future__ import annotations

import asyncio
import random
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

import aiohttp
import msgspec

from services.auth import job_credential
from services.judge_api import GroupJudgeRequest, GroupJudgeResult, JudgeRequest, JudgeResult, reply_model

RETRIED_STATUSES = (0, 429, 502, 503, 504)
"""Unreachable, over budget, upstreams failing: worth another try."""
BACKOFF_BASE_S = 0.5
UPSTREAM_UNAVAILABLE = "upstream_unavailable"
"""The proxy's error type when every upstream of a model is down (503, `retry-after`: the next probe)."""
OUTAGE_POLL_S = (1.0, 10.0)
"""Bounds on the wait between two tries during an outage, whatever `retry-after` says."""


class JudgeError(Exception):
    def __init__(self, status: int, message: str, kind: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(f"judge proxy answered {status}: {message}" if status else message)
        self.status = status
        """HTTP status; 0 when the proxy could not be reached."""
        self.kind = kind
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ChatResult:
    content: str
    usage: dict[str, int]
    remembered: bool = False
    model: str = ""
    """The model as the upstream named it in its reply."""


@dataclass
class Spend:
    """What the calls made under one `SPEND` cost."""

    judge_tokens: int = 0
    simulator_tokens: int = 0
    calls: int = 0
    remembered_calls: int = 0
    """Calls the proxy answered from memory (cache or replay): no upstream tokens."""
    budget_left: float | None = None
    """The share of the judge budget left, as the last chat reply's rate-limit headers said."""
    source: dict[str, str] = field(default_factory=dict)
    """What answered: `judge_model`, `simulator_model` (as the upstreams named themselves),
    `rubric_sha256`; a key that saw several values holds them all, sorted, comma-joined."""
    role: str = ""
    """The role every call made under it is charged as on the job's bill (`eval` for a
    held-out conversation's); unset: each call's own."""

    def note(self, **source: str) -> None:
        for key, value in source.items():
            if value:
                seen = set(self.source[key].split(",")) if key in self.source else set()
                self.source[key] = ",".join(sorted(seen | {value}))

    def add(self, priority: str, tokens: int, remembered: bool) -> None:
        self.calls += 1
        self.remembered_calls += remembered
        if priority == "judge":
            self.judge_tokens += tokens
        else:
            self.simulator_tokens += tokens


SPEND: ContextVar[Spend | None] = ContextVar("tandem_judge_spend", default=None)


def backoff_s(attempt: int, cap_s: float, rng: random.Random) -> float:
    """Exponential backoff with jitter: attempt 0 waits 0.25-0.5 s, each further attempt
    doubles it, never past `cap_s`."""
    return min(cap_s, BACKOFF_BASE_S * 2**attempt) * rng.uniform(0.5, 1.0)


class JudgeClient:
    def __init__(
        self,
        base_url: str,
        token: str = "",
        timeout_s: float = 120.0,
        max_connections: int = 64,
        max_retries: int = 2,
        max_retry_wait_s: float = 60.0,
        outage_wait_s: float = 1860.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {token}"} if token else {})
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_connections = max_connections
        self.session: aiohttp.ClientSession | None = None
        self.max_retries = max_retries
        self.max_retry_wait_s = max_retry_wait_s
        self.outage_wait_s = outage_wait_s
        self.outage_waits: dict[int, tuple[float, str]] = {}
        """Calls waiting out an outage: id -> (Unix time its wait began, the proxy's reason)."""
        self.rng = random.Random()
        self.structured: dict[str, bool] = {}
        """Per model: whether its upstreams take a JSON schema (`structured_output`)."""

    async def chat(
        self,
        messages: list[dict],
        *,
        model: str,
        max_tokens: int,
        temperature: float = 1.0,
        job: str = "",
        priority: str = "simulator",
        idempotency_key: str = "",
        response_format: dict | None = None,
        seed: int | None = None,
        role: str = "",
    ) -> ChatResult:
        """A chat completion; `role` names it on the job's bill (`judge_proxy.spend`; its
        priority when unset, and `eval` for every call under an evaluation's `Spend`)."""
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        body |= {"response_format": response_format} if response_format else {}
        body |= {"seed": seed} if seed is not None else {}
        reply, headers = await self._post("/v1/chat/completions", body, job, priority, idempotency_key, role)
        remembered = headers.get("x-tandem-remembered") == "true"
        usage = reply.get("usage", {})
        self._spent(priority, usage, remembered)
        self._note_budget(headers)
        answered_by = reply_model(reply)
        self._noted(**{f"{priority}_model": answered_by})
        return ChatResult(reply["choices"][0]["message"]["content"] or "", usage, remembered, answered_by)

    async def structured_output(self, model: str) -> bool:
        """Whether the proxy's upstreams of `model` keep a reply to a JSON schema given as
        `response_format` (`GET /v1/models/{model}`); asked once per model."""
        if model not in self.structured:
            reply = await self._try("GET", f"/v1/models/{model}", None, {})
            if isinstance(reply, JudgeError):
                raise reply
            self.structured[model] = bool(reply[0].get("structured_output", False))
        return self.structured[model]

    async def judge(
        self,
        rubric: str,
        messages: list[dict],
        reference: str | None = None,
        *,
        job: str = "",
        model: str | None = None,
        cache: bool = True,
        idempotency_key: str = "",
    ) -> JudgeResult:
        body = JudgeRequest(
            rubric=rubric, messages=messages, reference=reference, model=model, cache=cache
        ).model_dump()
        reply, _ = await self._post("/v1/judge", body, job, "judge", idempotency_key)
        result = JudgeResult.model_validate(reply)
        self._spent("judge", result.usage, result.remembered)
        self._noted(judge_model=result.model, rubric_sha256=result.rubric_sha256)
        return result

    async def judge_group(
        self,
        rubric: str,
        candidates: list[list[dict]],
        reference: str | None = None,
        *,
        job: str = "",
        model: str | None = None,
        cache: bool = True,
        idempotency_key: str = "",
    ) -> GroupJudgeResult:
        """One verdict per candidate, in order (`POST /v1/judge/group`)."""
        body = GroupJudgeRequest(
            rubric=rubric, candidates=candidates, reference=reference, model=model, cache=cache
        ).model_dump()
        reply, _ = await self._post("/v1/judge/group", body, job, "judge", idempotency_key)
        result = GroupJudgeResult.model_validate(reply)
        self._spent("judge", result.usage, result.remembered or not result.usage)
        for one in result.results:
            self._noted(judge_model=one.model, rubric_sha256=one.rubric_sha256)
        return result

    @staticmethod
    def _spent(priority: str, usage: dict[str, int], remembered: bool) -> None:
        spend = SPEND.get()
        if spend is not None:
            spend.add(priority, 0 if remembered else usage.get("total_tokens", 0), remembered)

    @staticmethod
    def _noted(**source: str) -> None:
        spend = SPEND.get()
        if spend is not None:
            spend.note(**source)

    @staticmethod
    def _note_budget(headers: dict[str, str]) -> None:
        limit, left = headers.get("x-ratelimit-limit-tokens", ""), headers.get("x-ratelimit-remaining-tokens", "")
        spend = SPEND.get()
        if spend is not None and limit.isdigit() and left.isdigit() and int(limit) > 0:
            spend.budget_left = int(left) / int(limit)

    def waiting_on(self) -> tuple[str, float]:
        """The reason of the oldest outage a call waits on now, and since when ("" and 0.0: none)."""
        if not self.outage_waits:
            return "", 0.0
        since, reason = min(self.outage_waits.values())
        return reason, since

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None or self.session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections)
            self.session = aiohttp.ClientSession(headers=self.headers, timeout=self.timeout, connector=connector)
        return self.session

    async def bill(self, job: str) -> dict:
        """What the proxy has charged `job` so far (`GET /v1/spend`): usd, tokens, cached,
        calls, by_role."""
        headers = {"x-tandem-job": job}
        if self.token:
            headers["authorization"] = f"Bearer {job_credential(self.token, job)}"
        reply = await self._try("GET", "/v1/spend", None, headers)
        if isinstance(reply, JudgeError):
            raise reply
        return reply[0]

    async def _post(
        self, path: str, body: dict, job: str, priority: str, idempotency_key: str = "", role: str = ""
    ) -> tuple[dict, dict[str, str]]:
        """The reply's JSON and headers, after retries."""
        headers = {"x-tandem-job": job, "x-tandem-priority": priority}
        spend = SPEND.get()
        role = (spend.role if spend is not None else "") or role
        if role:
            headers["x-tandem-role"] = role
        if self.token and job:  # the proxy charges a job only for calls made with its credential
            headers["authorization"] = f"Bearer {job_credential(self.token, job)}"
        if idempotency_key:
            headers["idempotency-key"] = idempotency_key
        attempt, outage_since, key = 0, 0.0, object()
        try:
            while True:
                reply = await self._try("POST", path, body, headers)
                if isinstance(reply, tuple):
                    return reply
                if reply.kind == UPSTREAM_UNAVAILABLE:
                    outage_since = outage_since or time.time()
                    if time.time() - outage_since > self.outage_wait_s:
                        raise reply
                    self.outage_waits[id(key)] = (outage_since, str(reply))
                    await asyncio.sleep(min(max(reply.retry_after_s or 0.0, OUTAGE_POLL_S[0]), OUTAGE_POLL_S[1]))
                    continue
                self.outage_waits.pop(id(key), None)
                if not _retried(reply) or attempt == self.max_retries:
                    raise reply
                wait_s = reply.retry_after_s
                if wait_s is None:
                    wait_s = backoff_s(attempt, self.max_retry_wait_s, self.rng)
                await asyncio.sleep(min(wait_s, self.max_retry_wait_s))
                attempt += 1
        finally:
            self.outage_waits.pop(id(key), None)

    async def _try(
        self, method: str, path: str, body: dict | None, headers: dict
    ) -> tuple[dict, dict[str, str]] | JudgeError:
        data = None if body is None else msgspec.json.encode(body)
        try:
            async with self._session().request(method, self.base_url + path, data=data, headers=headers) as response:
                status, content = response.status, await response.read()
                reply_headers = {k.lower(): v for k, v in response.headers.items()}
        except (TimeoutError, aiohttp.ClientError) as err:
            return JudgeError(0, f"judge proxy unreachable: {type(err).__name__}: {err}")
        if status != 200:
            return _error(status, content, reply_headers.get("retry-after", ""))
        return msgspec.json.decode(content), reply_headers


def _retried(error: JudgeError) -> bool:
    # The proxy already asked the judge twice for a readable verdict; asking again won't help.
    return error.status in RETRIED_STATUSES and error.kind != "unparseable_verdict"


def _error(status: int, content: bytes, retry_after: str) -> JudgeError:
    """The proxy's `{"error": {"message", "type"}}`, or the body's text for anything else."""
    try:
        payload = msgspec.json.decode(content)
    except msgspec.DecodeError:
        payload = None
    detail = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(detail, dict):
        detail = {"message": content[:500].decode(errors="replace")}
    retry_after_s = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None
    return JudgeError(status, detail.get("message", ""), detail.get("type", ""), retry_after_s)
