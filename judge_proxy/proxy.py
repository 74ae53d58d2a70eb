"""The proxy's core: admit a chat request into an upstream's budget, call the upstream,
settle the budget with what it charged, and retry where that helps.

Admission takes the request's cost first from its job's share of the model group
(`share.py`: jobs share a group's budget by their `judge_weight`, read from the job's record
and kept 10 s per replica; a job id with no record, or no `X-Tandem-Job`, weighs 1), then
from an upstream's budget; when no upstream has room the share gets its tokens back at
once, and a request its share holds back lets other jobs' requests go first (`queue.py`).
Settling charges the share what the upstream charged, like the budget.

One call of `complete` makes at most `max_attempts` upstream calls:
- 2xx: the reply is passed through; once it is sent, `usage.total_tokens` settles the
  reservation, `usage.prompt_tokens` teaches the upstream's prompt ratio (`budget.py`) and
  the reply's `x-ratelimit-remaining-*`/`reset-*` clamp the shared budget. A stream
  (`stream: true`) is relayed event by event as it arrives; the proxy asks the upstream for
  `usage` in its last chunk (`stream_options.include_usage`, dropped again when the client
  did not ask) and settles when the stream ends. A stream cut off midway (the upstream's
  connection or the client's) settles all it reserved, and is counted.
- 429: nothing was charged; the upstream is paused for every replica for `retry-after-ms`
  / `retry-after` (else exponential backoff with jitter), at most `max_backoff_s`, and the
  request waits in the queue again (any upstream of the group may take it).
- 5xx, 401/403, a timeout or a connection error: the reservation stays charged (the
  upstream may have counted it), the upstream is avoided by this replica for
  `failure_cooldown_s`, and the request goes to another upstream of the group.
- any other 4xx is the client's: passed through, with the API key redacted.
Waiting for budget, over all attempts, ends at `queue_deadline_s` with a 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import anyio
import msgspec
import redis.asyncio as aioredis
from multidict import CIMultiDict
from redis.exceptions import RedisError

from judge_proxy import metrics
from judge_proxy.budget import Budget, Lease, Limits
from judge_proxy.memory import Memory, Slot, digest
from judge_proxy.queue import Admitter, QueueTimeout, Tried
from judge_proxy.rubrics import (
    GroupParseError,
    Rubric,
    group_schema,
    parse_group_verdicts,
    parse_verdict,
    prompt_sha256,
    render,
    render_group,
    response_format,
    verdict_schema,
)
from judge_proxy.share import Share, Weights
from judge_proxy.upstream import (
    Reply,
    Upstream,
    UpstreamConfig,
    format_duration,
    load_upstreams,
    remaining,
    reset_s,
    retry_after_s,
    weighted_order,
)
from services.config import JudgeProxySettings
from services.judge_api import GroupJudgeResult, JudgeResult, reply_model
from services.judge_client import backoff_s
from services.queues import connect
from services.stats import TrailingRate

log = logging.getLogger(__name__)
LEASE_MARGIN_S = 10.0
"""A concurrency lease outlives its call's timeout by this much before Redis drops it."""
REDIS_CONNECTIONS = 64
"""Redis connections per replica; requests beyond that wait for one (budget scripts are short)."""
REDIS_CONNECTION_WAIT_S = 10.0
"""Longest wait for a free Redis connection before the request fails with a 503."""
BUDGET_SAMPLE_S = 5.0
"""How often the budget utilization gauge is brought up to date."""


class ProxyError(Exception):
    """An error answered to the client in OpenAI's shape, `{"error": {"message", "type",
    "param", "code"}, **extra}`: `param` names the field at fault, `code` repeats `kind`."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        *,
        retry_after_s: int | None = None,
        param: str | None = None,
        extra: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.retry_after_s = retry_after_s
        self.extra = extra or {}

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.kind},
            **self.extra,
        }


class UpstreamClientError(Exception):
    """An upstream's 4xx about the request itself, passed through (key redacted)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upstream answered {status}")
        self.status, self.body = status, body


@dataclass
class Grant:
    upstream: Upstream
    lease: Lease
    job: str
    share_tokens: int
    """Taken from the job's share of the group (settled with the lease)."""


@dataclass
class Group:
    """The upstreams clients reach under one model name, this replica's queue for them and
    the jobs' shares of their budget."""

    model: str
    upstreams: list[Upstream]
    admitter: Admitter[Grant]
    share: Share
    structured: bool
    """Its upstreams keep to a JSON schema in `response_format` (all or none of them)."""


@dataclass
class Completion:
    upstream: str
    body: bytes
    """The upstream's JSON reply, passed through unchanged (empty for a stream)."""
    data: dict
    settle: Callable[[], Awaitable[None]]
    """Reconciles the budget with this reply's usage. Call it once, after replying: the
    client need not wait for the bookkeeping (the reservation holds until then). A stream
    settles itself when it ends; its `settle` does nothing."""
    queue_s: float = 0.0
    upstream_s: float = 0.0
    """Until the reply (for a stream: until its headers)."""
    stream: AsyncIterator[bytes] | None = None
    """A stream's server-sent events, relayed as they arrive."""


@dataclass
class Attempts:
    """What one request's attempts have met so far."""

    job: str
    priority: str
    tag: str = ""
    """Sent upstream as `X-Client-Request-Id` (the client's idempotency key, if any)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Upstream name -> why it failed (5xx, timeout, ...)."""
    rate_limited_last: bool = False
    last_pause_s: float = 0.0
    queue_s: float = 0.0
    upstream_s: float = 0.0


def outcome_of(status: int) -> str:
    """How an upstream's HTTP status is handled (also the `outcome` label of its metric)."""
    if 200 <= status < 300:
        return "ok"
    if status == 429:
        return "rate_limited"
    if status in (401, 403):
        return "auth_error"
    if status == 408:
        return "timeout"
    return "server_error" if status >= 500 else "client_error"


def pin_output_cap(body: dict, max_tokens: int) -> dict:
    """`body` as sent upstream: the reservation holds only if the upstream cannot write more
    than `max_tokens`, so a missing or null cap becomes `max_tokens: max_tokens` (a set
    `max_completion_tokens` is the cap the proxy reserved, and takes precedence upstream)."""
    if body.get("max_completion_tokens") is not None:
        return body
    return {**{k: v for k, v in body.items() if k != "max_completion_tokens"}, "max_tokens": max_tokens}


def content_of(data: dict) -> str:
    try:
        return data["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise ProxyError(502, "upstream reply has no choices[0].message.content", "bad_upstream_reply") from None


class Proxy:
    def __init__(self, settings: JudgeProxySettings, configs: list[UpstreamConfig], redis: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.rng = random.Random()
        self.cooldown_until: dict[str, float] = {}
        self.groups: dict[str, Group] = {}
        self.weights = Weights(redis)
        self.setup_groups(configs)
        longest_call_s = max((c.timeout_s for c in configs), default=60.0) * settings.max_attempts
        self.memory = Memory(
            redis,
            settings.cache_ttl_s,
            settings.idempotency_ttl_s,
            pending_ttl_s=settings.queue_deadline_s + longest_call_s + LEASE_MARGIN_S,
        )

    @classmethod
    def from_settings(cls, settings: JudgeProxySettings) -> Proxy:
        # A blocking pool: a burst of requests waits for a free Redis connection instead of
        # failing with "Too many connections" (500s to clients) once all are in use.
        return cls(
            settings,
            load_upstreams(settings.upstreams),
            connect(settings.redis_url, REDIS_CONNECTIONS, REDIS_CONNECTION_WAIT_S, outage_s=settings.redis_outage_s),
        )

    def setup_groups(self, configs: list[UpstreamConfig]) -> None:
        for config in configs:
            limits = Limits(
                config.tpm,
                config.rpm,
                config.max_concurrency,
                config.timeout_s + LEASE_MARGIN_S,
                model=config.limit_model,
                window_s=config.window_s,
                pace_s=config.pace_s,
                prompt_margin=config.prompt_margin,
                prompt_ratio_band=config.prompt_ratio_band,
            )
            upstream = Upstream(config, Budget(self.redis, config.name, limits))
            if config.model not in self.groups:
                admitter = Admitter(self.settings.judge_priority_weight, tokens_per_s=0.0, release=self.release)
                self.groups[config.model] = Group(
                    config.model, [], admitter, Share(self.redis, config.model), config.structured_output
                )
            group = self.groups[config.model]
            group.upstreams.append(upstream)
            group.admitter.tokens_per_s += config.tpm / 60
            group.share.add_upstream(config)
            metrics.BUDGET_TPM.labels(config.name).set(config.tpm)
            metrics.BUDGET_RPM.labels(config.name).set(config.rpm)

    def group(self, model: str) -> Group:
        group = self.groups.get(model)
        if group is None:
            raise ProxyError(
                404, f"unknown model {model!r}; this proxy serves {sorted(self.groups)}", "model_not_found"
            )
        return group

    @property
    def upstreams(self) -> list[Upstream]:
        return [u for g in self.groups.values() for u in g.upstreams]

    async def complete(
        self, body: dict, max_tokens: int, n: int, *, job: str, priority: str, tag: str = ""
    ) -> Completion:
        """Send one chat request (`body`, already validated) through the budget."""
        group = self.group(body["model"])
        need = Need(n * max_tokens, {u.name: u.prompt_estimate(body["messages"], body) for u in group.upstreams})
        self.check_fits(group, need)
        payload = upstream_body(body, max_tokens)
        deadline = time.monotonic() + self.settings.queue_deadline_s
        attempts = Attempts(job, priority, tag)
        for attempt in range(self.settings.max_attempts):
            grant = await self.admit(group, need, attempts, deadline, job, priority)
            upstream_payload = msgspec.json.encode(
                {**payload, "model": grant.upstream.config.upstream_model or group.model}
            )
            completion = await self.call(
                group,
                grant,
                upstream_payload,
                attempt,
                attempts,
                stream=bool(body.get("stream")),
                client_wants_usage=wants_usage(body),
            )
            if completion is not None:
                completion.queue_s = attempts.queue_s
                return completion
        raise self.exhausted(group, attempts, priority)

    def check_fits(self, group: Group, need: Need) -> None:
        """Refuse, before it touches any shared state, a request larger than every upstream's
        limit at the ratio this replica last saw."""
        if all(need.cost(u) > u.config.tpm for u in group.upstreams):
            raise too_large(group.model, min(need.cost(u) for u in group.upstreams))

    async def admit(
        self, group: Group, need: Need, attempts: Attempts, deadline: float, job: str, priority: str
    ) -> Grant:
        """A grant from the job's share and an upstream's budget, waiting in the queue for it."""
        candidates = [u for u in group.upstreams if u.name not in attempts.failed and need.cost(u) <= u.config.tpm]
        if not candidates:
            raise self.exhausted(group, attempts, priority)
        try_admit = self.admission(group, candidates, need, job, await self.weights.of(job))
        try:
            grant, waited_s = await group.admitter.admit(
                job, priority, min(need.cost(u) for u in candidates), deadline - time.monotonic(), try_admit
            )
        except QueueTimeout as timeout:
            metrics.REJECTED.labels(priority).inc()
            raise ProxyError(
                429,
                f"no budget for model {group.model!r} within the queue deadline",
                "rate_limited",
                retry_after_s=timeout.retry_after_s,
            ) from None
        attempts.queue_s += waited_s
        return grant

    def admission(
        self, group: Group, candidates: list[Upstream], need: Need, job: str, weight: float
    ) -> Callable[[], Awaitable[Tried[Grant]]]:
        """One request's reservation attempt: its cost from the job's share first (a refusal
        there lets other jobs go first), then from an upstream's budget; the share is
        refunded at once when no upstream has room."""
        share_tokens = max(need.cost(u) for u in candidates)
        held_back = False

        async def try_admit() -> Tried[Grant]:
            nonlocal held_back
            held = await group.share.reserve(job, weight, share_tokens)
            metrics.JOB_SHARE.labels(group.model, job).set(held.share)
            if not held.admitted:
                if not held_back:
                    metrics.SHARE_WAITS.labels(group.model, job).inc()
                    held_back = True
                return Tried(None, held.wait_s, by_share=True)
            upstream, lease, wait_s = None, None, math.inf
            try:
                upstream, lease, wait_s = await self.reserve_upstream(candidates, need)
            finally:
                if lease is None:
                    await group.share.refund(job, share_tokens)
            return Tried(None, wait_s) if lease is None else Tried(Grant(upstream, lease, job, share_tokens), 0.0)

        return try_admit

    async def reserve_upstream(
        self, candidates: list[Upstream], need: Need
    ) -> tuple[Upstream | None, Lease | None, float]:
        """A lease from the first upstream, in order of preference, with room for `need`;
        else no lease and the seconds until the soonest could have room. A request that no
        upstream could ever admit at the ratio learned by now (`check_fits` read an older
        one) is refused alone, so it does not hold the queue's head until its deadline."""
        wait_s, costs = math.inf, []
        for upstream in self.preference(candidates):
            admission = await upstream.budget.reserve(need.fixed_tokens, need.prompt_estimates[upstream.name])
            if admission.lease is not None:
                return upstream, admission.lease, 0.0
            wait_s = min(wait_s, admission.wait_s)
            costs.append(admission.cost)
        if math.isinf(wait_s):
            raise too_large(candidates[0].config.model, min(costs))
        return None, None, wait_s

    async def release(self, grant: Grant) -> None:
        """Give back a grant whose request left the queue before using it."""
        await self.settle(self.groups[grant.upstream.config.model], grant, 0, None, used_request=False)

    def preference(self, candidates: list[Upstream]) -> list[Upstream]:
        """By weight, upstreams that failed here recently last."""
        now = time.monotonic()
        ordered = weighted_order(candidates, self.rng)
        return sorted(ordered, key=lambda u: self.cooldown_until.get(u.name, 0.0) > now)

    async def call(
        self,
        group: Group,
        grant: Grant,
        payload: bytes,
        attempt: int,
        attempts: Attempts,
        *,
        stream: bool = False,
        client_wants_usage: bool = False,
    ) -> Completion | None:
        """One upstream call; None when another attempt should follow. A failure settles the
        budget here, a success once its reply has been sent (`Completion.settle`)."""
        upstream = grant.upstream
        await upstream.budget.sent(grant.lease)
        started = time.perf_counter()
        try:
            reply = await upstream.post(payload, stream=stream, tag=attempts.tag)
            if reply.events is not None:
                attempts.upstream_s += time.perf_counter() - started
                return self.relay(group, grant, reply, attempts, client_wants_usage)
        except TimeoutError:
            reply, outcome, detail = None, "timeout", ""
        except aiohttp.ClientError as err:
            reply, outcome, detail = None, "connect_error", type(err).__name__
        else:
            outcome, detail = outcome_of(reply.status), f"HTTP {reply.status}"
        elapsed_s = time.perf_counter() - started
        attempts.upstream_s += elapsed_s
        metrics.UPSTREAM_LATENCY.labels(upstream.name).observe(elapsed_s)
        if outcome == "ok":
            return await self.succeed(group, grant, reply, attempts)
        if outcome == "rate_limited":
            await self.back_off(group, grant, reply, attempt, attempts)
            return None
        if outcome == "client_error":
            metrics.REQUESTS.labels(upstream.name, outcome).inc()
            await self.settle(group, grant, 0, reply)
            raise UpstreamClientError(reply.status, upstream.redact(reply.body))
        await self.fail(group, grant, outcome, attempts, detail)
        return None

    async def succeed(self, group: Group, grant: Grant, reply: Reply, attempts: Attempts) -> Completion | None:
        upstream, lease = grant.upstream, grant.lease
        try:
            data = msgspec.json.decode(reply.body)
        except msgspec.DecodeError:
            await self.fail(group, grant, "server_error", attempts, detail="reply is not JSON")
            return None
        usage = _usage(data)
        used = usage.get("total_tokens", lease.tokens)  # no usage: it may have charged all we reserved
        metrics.REQUESTS.labels(upstream.name, "ok").inc()
        _record_usage(upstream.name, lease.tokens, used)
        metrics.JOB_TOKENS.labels(attempts.job, attempts.priority).inc(used)
        settle = functools.partial(self.settle, group, grant, used, reply, prompt_tokens=usage.get("prompt_tokens"))
        return Completion(upstream.name, reply.body, data, settle, upstream_s=attempts.upstream_s)

    def relay(
        self, group: Group, grant: Grant, reply: Reply, attempts: Attempts, client_wants_usage: bool
    ) -> Completion:
        """A stream's completion: its events pass through as they arrive; the budget is
        settled when it ends, however it ends."""
        upstream, lease = grant.upstream, grant.lease
        metrics.REQUESTS.labels(upstream.name, "ok").inc()

        async def events() -> AsyncIterator[bytes]:
            usage: dict[str, int] = {}
            outcome = "client_closed"
            try:
                async for event in sse_events(reply.events.content):
                    data = sse_data(event)
                    if data == "[DONE]":
                        outcome = "complete"
                    elif data:
                        chunk = _json_or_none(data)
                        usage = _usage(chunk) or usage
                        if usage and not client_wants_usage and chunk.get("choices") == []:
                            continue  # the usage chunk the proxy asked for, not the client
                    yield event
                if outcome != "complete":
                    outcome = "cut"
                    yield sse_error("the upstream's stream ended before [DONE]")
            except (aiohttp.ClientError, TimeoutError) as err:
                outcome = "cut"
                log.warning("stream from %s cut off: %s", upstream.name, type(err).__name__)
                yield sse_error(f"the upstream's stream was cut off ({type(err).__name__})")
            finally:
                reply.events.close()
                complete = outcome == "complete" and "total_tokens" in usage
                used = usage["total_tokens"] if complete else lease.tokens
                metrics.STREAMS.labels(upstream.name, outcome).inc()
                _record_usage(upstream.name, lease.tokens, used)
                metrics.JOB_TOKENS.labels(attempts.job, attempts.priority).inc(used)
                # A client that leaves cancels the response's scope, and every later await
                # in it: the settle must run shielded or the lease and reservation stay held.
                with anyio.CancelScope(shield=True):
                    await self.settle(group, grant, used, reply, prompt_tokens=usage.get("prompt_tokens"))

        return Completion(upstream.name, b"", {}, _nothing, upstream_s=attempts.upstream_s, stream=events())

    async def back_off(self, group: Group, grant: Grant, reply: Reply, attempt: int, attempts: Attempts) -> None:
        upstream = grant.upstream
        requested = retry_after_s(reply.headers)
        pause_s = min(
            self.settings.max_backoff_s,
            backoff_s(attempt, self.settings.max_backoff_s, self.rng) if requested is None else requested,
        )
        attempts.rate_limited_last, attempts.last_pause_s = True, pause_s
        metrics.UPSTREAM_429.labels(upstream.name).inc()
        metrics.REQUESTS.labels(upstream.name, "rate_limited").inc()
        log.warning("upstream %s answered 429; pausing it for %.3f s", upstream.name, pause_s)
        await self.settle(group, grant, 0, reply, used_request=False, pause_s=pause_s)

    async def fail(self, group: Group, grant: Grant, outcome: str, attempts: Attempts, detail: str = "") -> None:
        upstream = grant.upstream
        metrics.REQUESTS.labels(upstream.name, outcome).inc()
        log.warning("upstream %s failed (%s %s); trying another", upstream.name, outcome, detail)
        attempts.failed[upstream.name] = f"{outcome} {detail}".strip()
        attempts.rate_limited_last = False
        self.cooldown_until[upstream.name] = time.monotonic() + self.settings.failure_cooldown_s
        await self.settle(group, grant, grant.lease.tokens, None)

    async def settle(
        self,
        group: Group,
        grant: Grant,
        used_tokens: int,
        reply: Reply | None,
        *,
        used_request: bool = True,
        pause_s: float = 0.0,
        prompt_tokens: int | None = None,
    ) -> None:
        """Charge what the upstream charged (`used_tokens`), in its budget and in the job's
        share (whatever either reserved beyond it goes back), and let the queue try again."""
        headers = reply.headers if reply is not None else CIMultiDict()
        await asyncio.gather(
            grant.upstream.budget.settle(
                grant.lease,
                used_tokens,
                used_request=used_request,
                pause_s=pause_s,
                prompt_tokens=prompt_tokens,
                remaining_tokens=remaining(headers, "tokens"),
                remaining_requests=remaining(headers, "requests"),
                reset_tokens_s=reset_s(headers, "tokens"),
                reset_requests_s=reset_s(headers, "requests"),
            ),
            group.share.refund(grant.job, grant.share_tokens - used_tokens),
        )
        group.admitter.wake()

    async def limit_headers(self, group: Group) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for the budget a group's upstreams share across
        replicas: limits and what remains summed, resets the longest. What remains is as this
        replica last saw it, at its last reservation (Redis is asked only for an upstream it
        has not seen yet), so the headers cost no extra round trip per request."""
        unseen = [u.budget.view() for u in group.upstreams if u.budget.seen is None]
        await asyncio.gather(*unseen)
        now = time.monotonic()
        seen = [u.budget.seen for u in group.upstreams]
        configs = [u.config for u in group.upstreams]
        return {
            "x-ratelimit-limit-requests": str(sum(c.rpm for c in configs)),
            "x-ratelimit-limit-tokens": str(sum(c.tpm for c in configs)),
            "x-ratelimit-remaining-requests": str(sum(max(0, math.floor(s.requests)) for s in seen)),
            "x-ratelimit-remaining-tokens": str(sum(max(0, math.floor(s.tokens)) for s in seen)),
            "x-ratelimit-reset-requests": format_duration(
                max(max(0.0, s.requests_reset_s - (now - s.at)) for s in seen)
            ),
            "x-ratelimit-reset-tokens": format_duration(max(max(0.0, s.tokens_reset_s - (now - s.at)) for s in seen)),
        }

    def exhausted(self, group: Group, attempts: Attempts, priority: str) -> ProxyError:
        """The error once no attempt is left: the last upstream's 429, or every failure."""
        if attempts.rate_limited_last:
            metrics.REJECTED.labels(priority).inc()
            return ProxyError(
                429,
                f"upstreams of {group.model!r} kept answering 429",
                "rate_limited",
                retry_after_s=max(1, math.ceil(attempts.last_pause_s)),
            )
        reasons = "; ".join(f"{name}: {why}" for name, why in attempts.failed.items())
        return ProxyError(502, f"upstreams of {group.model!r} failed ({reasons})", "upstream_error")

    def replay_key(self, job: str, idempotency_key: str | None, *parts: object) -> Slot | None:
        return self.memory.key("replay", job, idempotency_key, *parts) if idempotency_key else None

    def chat_memory_key(self, body: dict, job: str, idempotency_key: str | None) -> Slot | None:
        """Where a chat reply is remembered: a temperature-0 request by its content, any
        other by its idempotency key; a stream is never remembered."""
        if body.get("stream"):
            return None
        if body.get("temperature") == 0 and body.get("n", 1) == 1:
            return self.memory.key("cache", job, body)
        return self.replay_key(job, idempotency_key, body)

    async def complete_whole(
        self, body: dict, max_tokens: int, n: int, *, job: str, priority: str, tag: str = ""
    ) -> bytes:
        """A chat reply as bytes, its budget settled (for a reply to be remembered)."""
        completion = await self.complete(body, max_tokens, n, job=job, priority=priority, tag=tag)
        await completion.settle()
        return completion.body

    async def judge(
        self,
        rubric: Rubric,
        messages: list[dict],
        reference: str | None,
        model: str,
        job: str,
        *,
        cache: bool = True,
        idempotency_key: str | None = None,
    ) -> JudgeResult:
        """A verdict: the job's earlier one on the same conversation (`cache`), the one
        stored under `idempotency_key`, or a new one."""
        parts = (model, rubric.name, messages, reference)
        key = self.memory.key("cache", job, *parts) if cache else None
        key = key or self.replay_key(job, idempotency_key, *parts)
        raw, remembered = await self.memory.once(
            key, job, lambda: self.verdict(rubric, messages, reference, model, job, idempotency_key or "")
        )
        return JudgeResult.model_validate_json(raw).model_copy(update={"remembered": remembered})

    async def verdict(
        self, rubric: Rubric, messages: list[dict], reference: str | None, model: str, job: str, tag: str = ""
    ) -> bytes:
        """Ask for a verdict; ask once more, strictly, when the first cannot be read."""
        raws: list[str] = []
        usage: dict[str, int] = {}
        structured = self.group(model).structured
        for strict in (False, True):
            prompt = render(
                rubric,
                messages,
                reference,
                strict=strict,
                previous_reply=raws[-1] if raws else "",
                structured=structured,
            )
            body = {"model": model, "messages": prompt, "temperature": 0.0}
            if structured:
                body["response_format"] = response_format(rubric, verdict_schema(rubric))
            completion = await self.complete(
                body, rubric.max_tokens, 1, job=job, priority="judge", tag=tag and tag + "/strict" * strict
            )
            await completion.settle()
            raws.append(content_of(completion.data))
            add_usage(usage, completion.data.get("usage"))
            verdict = parse_verdict(rubric, raws[-1])
            if verdict is not None:
                metrics.VERDICTS.labels(rubric.name, "parsed_on_retry" if strict else "parsed").inc()
                return (
                    JudgeResult(
                        score=verdict.score,
                        criteria=verdict.criteria,
                        verdict=verdict.verdict,
                        raw=raws[-1],
                        usage=usage,
                        model=reply_model(completion.data),
                        rubric_sha256=prompt_sha256(rubric, structured=structured),
                    )
                    .model_dump_json()
                    .encode()
                )
        metrics.VERDICTS.labels(rubric.name, "unparseable").inc()
        raise ProxyError(502, "unparseable verdict", "unparseable_verdict", extra={"raw": raws, "usage": usage})

    async def judge_group(
        self,
        rubric: Rubric,
        candidates: list[list[dict]],
        reference: str | None,
        model: str,
        job: str,
        *,
        cache: bool = True,
        idempotency_key: str | None = None,
    ) -> GroupJudgeResult:
        """One verdict per candidate, from as few judge calls as possible: candidates the
        job's cache knows cost nothing, identical ones are judged once, the rest together
        in one call (`GroupVerdicts`)."""
        key = self.replay_key(job, idempotency_key, model, rubric.name, candidates, reference)
        verdicts = GroupVerdicts(self, rubric, candidates, reference, model, job, cache, idempotency_key or "")
        raw, remembered = await self.memory.once(key, job, verdicts.reply)
        return GroupJudgeResult.model_validate_json(raw).model_copy(update={"remembered": remembered})

    async def watch_budgets(self, every_s: float = BUDGET_SAMPLE_S) -> None:
        """Keep `tandem_judge_budget_utilization` current: per upstream, the tokens every
        replica used over the last minute (the shared total in Redis) over its TPM; and the
        learned prompt ratio (its gauge, and the copy `check_fits` reads)."""
        rates = {u.name: TrailingRate(window_s=60.0) for u in self.upstreams}
        while True:
            for upstream in self.upstreams:
                with contextlib.suppress(RedisError):
                    view = await upstream.budget.view()
                    tokens_per_s = rates[upstream.name].add(time.monotonic(), view.used_tokens_total)
                    metrics.BUDGET_UTILIZATION.labels(upstream.name).set(tokens_per_s * 60 / upstream.config.tpm)
                    metrics.PROMPT_RATIO.labels(upstream.name).set(view.prompt_ratio)
                    metrics.PROMPT_OUTLIERS.labels(upstream.name).set(view.prompt_outliers)
            await asyncio.sleep(every_s)

    def health(self) -> tuple[bool, dict]:
        return True, {"models": sorted(self.groups), "upstreams": [u.name for u in self.upstreams]}

    async def aclose(self) -> None:
        for upstream in self.upstreams:
            await upstream.aclose()
        await self.redis.aclose()


@dataclass
class GroupVerdicts:
    """One group verdict request being answered."""

    proxy: Proxy
    rubric: Rubric
    candidates: list[list[dict]]
    reference: str | None
    model: str
    job: str
    cache: bool
    tag: str = ""
    """The request's idempotency key, sent upstream to name its calls."""

    async def reply(self) -> bytes:
        """Cached candidates first; the distinct rest in one group call, or one by one when
        its reply is unusable (counted by reason)."""
        slots = [self.cache_slot(c) for c in self.candidates]
        stored = await self.proxy.memory.lookup([s for s in slots if s])
        results: list[JudgeResult | None] = [None] * len(self.candidates)
        for index, raw in zip((i for i, s in enumerate(slots) if s), stored):
            if raw is not None:
                results[index] = JudgeResult.model_validate_json(raw).model_copy(update={"remembered": True})
        todo: dict[str, list[int]] = {}
        for index, candidate in enumerate(self.candidates):
            if results[index] is None:
                todo.setdefault(digest(candidate), []).append(index)
        self.count("cached", sum(r is not None for r in results))
        self.count("duplicate", sum(len(same) - 1 for same in todo.values()))
        usage: dict[str, int] = {}
        fallback = None
        if todo:
            firsts = [same[0] for same in todo.values()]
            verdicts, fallback = await self.judge(
                [self.candidates[i] for i in firsts], [slots[i] for i in firsts], usage
            )
            for same, verdict in zip(todo.values(), verdicts):
                for index in same:
                    results[index] = verdict
        return GroupJudgeResult(results=results, usage=usage, fallback=fallback).model_dump_json().encode()

    async def judge(
        self, distinct: list[list[dict]], slots: list[Slot | None], usage: dict[str, int]
    ) -> tuple[list[JudgeResult], str | None]:
        """Verdicts on distinct candidates (`slots`: where each is cached, if it is)."""
        if len(distinct) > 1:
            try:
                verdicts = await self.group_call(distinct, slots, usage)
                self.count("group", len(distinct))
                return verdicts, None
            except GroupParseError as err:
                reason = err.reason
                metrics.GROUP_FALLBACKS.labels(self.rubric.name, reason).inc()
                log.warning("group verdict unusable (%s); judging %d candidates one by one", err, len(distinct))
        else:
            reason = None
        singles = await asyncio.gather(
            *(
                self.proxy.judge(
                    self.rubric,
                    c,
                    self.reference,
                    self.model,
                    self.job,
                    cache=self.cache,
                    idempotency_key=self.tag and f"{self.tag}/c{index}",
                )
                for index, c in enumerate(distinct)
            )
        )
        for single in singles:
            add_usage(usage, single.usage if not single.remembered else {})
        self.count("fallback" if reason else "alone", len(distinct))
        return list(singles), reason

    async def group_call(
        self, distinct: list[list[dict]], slots: list[Slot | None], usage: dict[str, int]
    ) -> list[JudgeResult]:
        structured = self.proxy.group(self.model).structured
        prompt = render_group(self.rubric, distinct, self.reference, structured=structured)
        body = {"model": self.model, "messages": prompt, "temperature": 0.0}
        if structured:
            body["response_format"] = response_format(self.rubric, group_schema(self.rubric, len(distinct)))
        completion = await self.proxy.complete(
            body, self.rubric.group_max_tokens(len(distinct)), 1, job=self.job, priority="judge", tag=self.tag
        )
        await completion.settle()
        add_usage(usage, completion.data.get("usage"))
        text = content_of(completion.data)
        provenance = {
            "model": reply_model(completion.data),
            "rubric_sha256": prompt_sha256(self.rubric, group=True, structured=structured),
        }
        verdicts = [
            JudgeResult(score=v.score, criteria=v.criteria, verdict=v.verdict, raw=text, usage={}, **provenance)
            for v in parse_group_verdicts(self.rubric, text, len(distinct))
        ]
        await self.proxy.memory.store({slot: v.model_dump_json().encode() for slot, v in zip(slots, verdicts) if slot})
        return verdicts

    def cache_slot(self, candidate: list[dict]) -> Slot | None:
        """The same entry a single verdict on this conversation is cached under."""
        if not self.cache:
            return None
        return self.proxy.memory.key("cache", self.job, self.model, self.rubric.name, candidate, self.reference)

    def count(self, outcome: str, number: int) -> None:
        if number:
            metrics.GROUP_CANDIDATES.labels(self.rubric.name, outcome).inc(number)


def too_large(model: str, cost_tokens: int) -> ProxyError:
    return ProxyError(
        400,
        f"the request needs {cost_tokens} tokens (estimated prompt + n * max_tokens), more "
        f"than any upstream of {model!r} allows per minute",
        "request_too_large",
        param="max_tokens",
    )


def add_usage(total: dict[str, int], usage: object) -> None:
    """Add a reply's integer usage counts into `total`."""
    for key, value in (usage or {}).items() if isinstance(usage, dict) else ():
        if isinstance(value, int) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value


@dataclass(frozen=True)
class Need:
    """What one request asks of an upstream's budget."""

    fixed_tokens: int
    """Every completion at its maximum (`n * max_tokens`)."""
    prompt_estimates: dict[str, int]
    """Upstream name -> the prompt's local estimate (the budget scales it by the learned ratio)."""

    def cost(self, upstream: Upstream) -> int:
        return upstream.budget.cost(self.fixed_tokens, self.prompt_estimates[upstream.name])


def upstream_body(body: dict, max_tokens: int) -> dict:
    """The request as sent upstream: the output cap pinned, and a stream asked to end
    with its `usage` (the proxy settles with it)."""
    payload = pin_output_cap(body, max_tokens)
    if payload.get("stream"):
        payload["stream_options"] = {**(payload.get("stream_options") or {}), "include_usage": True}
    return payload


def wants_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


async def sse_events(lines: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Server-sent events, each with the blank line that ends it, from a stream of lines."""
    event: list[bytes] = []
    async for line in lines:
        event.append(line)
        if not line.strip():
            if len(event) > 1:
                yield b"".join(event)
            event = []
    if any(line.strip() for line in event):
        yield b"".join(event) + b"\n"


def sse_data(event: bytes) -> str:
    """The event's `data:` lines, joined (the SSE rule); empty for comments and keep-alives."""
    lines = event.decode("utf-8", "replace").splitlines()
    return "\n".join(line[5:].removeprefix(" ") for line in lines if line.startswith("data:"))


def sse_error(message: str) -> bytes:
    """An error event in the shape OpenAI's SDKs raise on mid-stream."""
    error = {"error": {"message": message, "type": "upstream_error", "param": None, "code": "stream_cut"}}
    return b"data: " + msgspec.json.encode(error) + b"\n\n"


def _json_or_none(data: str) -> dict:
    try:
        decoded = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


def _usage(data: dict) -> dict[str, int]:
    """The reply's `usage` counts (only the integer ones), empty when it has none."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return {}
    return {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}


async def _nothing() -> None:
    return None


def _record_usage(upstream: str, reserved: int, actual: int) -> None:
    metrics.TOKENS.labels(upstream, "reserved").inc(reserved)
    metrics.TOKENS.labels(upstream, "actual").inc(actual)
    metrics.TOKENS.labels(upstream, "refunded").inc(max(reserved - actual, 0))
    metrics.TOKENS.labels(upstream, "charged").inc(max(actual - reserved, 0))
    metrics.RECONCILIATION_ERROR.labels(upstream).observe(reserved - actual)
    metrics.RECONCILIATION_MEAN.labels(upstream).observe(reserved - actual)
