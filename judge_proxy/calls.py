"""One upstream call, the gateway's second half (`judge_proxy.gateway`): send a granted
request, read or relay the reply, and settle the budget with what the upstream charged; a
429 pauses the upstream, a failure cools it down for this replica. Every outcome is told to
the upstream's circuit (`circuit.py`): a success (an answer the client gets, a stream that
ends whole), a failure, a 429."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import anyio
import msgspec
from multidict import CIMultiDict

from judge_proxy import metrics
from judge_proxy.admission import Admission, Attempts, Grant, Group
from judge_proxy.budget import LEASE_MARGIN_S
from judge_proxy.errors import UpstreamClientError
from judge_proxy.replies import ReplyRefused, decoded, decoded_object, over_cap
from judge_proxy.spend import call_cost
from judge_proxy.upstream import Reply, Upstream, remaining, reset_s, retry_after_s
from services.config import JudgeProxySettings
from services.judge_client import backoff_s

log = logging.getLogger(__name__)


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
    stream: AsyncGenerator[bytes, None] | None = None
    """A stream's server-sent events, relayed as they arrive."""


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


class Caller:
    """Makes a granted request's upstream call (`call`) and settles what it cost."""

    def __init__(self, settings: JudgeProxySettings, rng: random.Random, admission: Admission) -> None:
        self.settings = settings
        self.rng = rng
        self.admission = admission

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
        except (TimeoutError, aiohttp.ClientError, ReplyRefused) as err:
            self.timed(upstream, attempts, started)
            outcome, detail = unanswered(err)
            await self.fail(group, grant, outcome, attempts, detail)
            return None
        if reply.events is not None:
            attempts.upstream_s += time.perf_counter() - started
            return self.relay(group, grant, reply, reply.events, attempts, client_wants_usage)
        self.timed(upstream, attempts, started)
        return await self.answered(group, grant, reply, attempt, attempts)

    def timed(self, upstream: Upstream, attempts: Attempts, started: float) -> None:
        """Count the time since `started` (`time.perf_counter()`) as the upstream's."""
        elapsed_s = time.perf_counter() - started
        attempts.upstream_s += elapsed_s
        metrics.UPSTREAM_LATENCY.labels(upstream.name).observe(elapsed_s)

    async def answered(
        self, group: Group, grant: Grant, reply: Reply, attempt: int, attempts: Attempts
    ) -> Completion | None:
        """A reply read whole, handled as its status says; None when another attempt should follow."""
        outcome = outcome_of(reply.status)
        if outcome == "ok":
            return await self.succeed(group, grant, reply, attempts)
        if outcome == "rate_limited":
            await self.back_off(group, grant, reply, attempt, attempts)
            return None
        if outcome == "client_error":  # the upstream is up: the request was at fault
            metrics.REQUESTS.labels(grant.upstream.name, outcome).inc()
            await asyncio.gather(settle(group, grant, 0, reply), grant.upstream.circuit.succeeded())
            raise UpstreamClientError(reply.status, grant.upstream.redact(reply.body))
        await self.fail(group, grant, outcome, attempts, f"HTTP {reply.status}")
        return None

    async def succeed(self, group: Group, grant: Grant, reply: Reply, attempts: Attempts) -> Completion | None:
        upstream = grant.upstream
        try:
            data = decoded_object(reply.body)
        except (msgspec.DecodeError, ReplyRefused) as err:
            detail = str(err) if isinstance(err, ReplyRefused) else "reply is not JSON"
            await self.fail(group, grant, "server_error", attempts, detail=detail)
            return None
        await upstream.circuit.succeeded()
        metrics.REQUESTS.labels(upstream.name, "ok").inc()
        settle_later = functools.partial(charge, group, grant, reply, attempts, _usage(data))
        return Completion(upstream.name, reply.body, data, settle_later, upstream_s=attempts.upstream_s)

    def relay(
        self,
        group: Group,
        grant: Grant,
        reply: Reply,
        response: aiohttp.ClientResponse,
        attempts: Attempts,
        client_wants_usage: bool,
    ) -> Completion:
        """A stream's completion (`response`: its open reply): its events pass through as
        they arrive; the budget is settled when it ends, however it ends."""
        metrics.REQUESTS.labels(grant.upstream.name, "ok").inc()
        events = relayed(group, grant, reply, response, attempts, client_wants_usage)
        return Completion(grant.upstream.name, b"", {}, _nothing, upstream_s=attempts.upstream_s, stream=events)

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
        await asyncio.gather(
            settle(group, grant, 0, reply, used_request=False, pause_s=pause_s),
            upstream.circuit.rate_limited(probe=grant.probe),
        )

    async def fail(self, group: Group, grant: Grant, outcome: str, attempts: Attempts, detail: str = "") -> None:
        upstream = grant.upstream
        metrics.REQUESTS.labels(upstream.name, outcome).inc()
        log.warning("upstream %s failed (%s %s); trying another", upstream.name, outcome, detail)
        attempts.failed[upstream.name] = f"{outcome} {detail}".strip()
        attempts.rate_limited_last = False
        self.admission.cool_down(upstream.name, self.settings.failure_cooldown_s)
        await asyncio.gather(
            settle(group, grant, grant.lease.tokens, None),
            upstream.circuit.failed(attempts.failed[upstream.name], probe=grant.probe),
        )


async def relayed(
    group: Group,
    grant: Grant,
    reply: Reply,
    response: aiohttp.ClientResponse,
    attempts: Attempts,
    client_wants_usage: bool,
) -> AsyncGenerator[bytes, None]:
    """A stream's events as they arrive; an error event when it breaks off (the upstream's
    connection, a timeout, an event the proxy refuses), and the budget settled at the end:
    by its `usage` when whole, else all it reserved."""
    upstream, lease = grant.upstream, grant.lease
    usage: dict[str, int] = {}
    outcome, why = "client_closed", ""
    renewed = time.monotonic()
    try:
        async for event in sse_events(upstream.lines(response), upstream.max_reply_bytes):
            if time.monotonic() - renewed > LEASE_MARGIN_S:  # see `Budget.renew`
                hold_ttl_s = upstream.config.quiet_bound_s + LEASE_MARGIN_S
                await asyncio.gather(upstream.budget.renew(lease), group.spend.renew(grant.held, hold_ttl_s))
                renewed = time.monotonic()
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
            outcome, why = "cut", "ended before [DONE]"
            yield sse_error("the upstream's stream ended before [DONE]")
    except (aiohttp.ClientError, TimeoutError, ReplyRefused) as err:
        outcome, why = "cut", broken(err)
        log.warning("stream from %s cut off: %s", upstream.name, why)
        yield sse_error(f"the upstream's stream was cut off ({why})")
    finally:
        response.close()
        metrics.STREAMS.labels(upstream.name, outcome).inc()
        # A client that leaves cancels the response's scope, and every later await in it:
        # the settle must run shielded or the lease and reservation stay held.
        with anyio.CancelScope(shield=True):
            await asyncio.gather(
                charge(group, grant, reply, attempts, usage if outcome == "complete" else {}),
                stream_ended(grant, outcome, why),
            )


def unanswered(err: Exception) -> tuple[str, str]:
    """A call that got no reply whole: its outcome (the metric's label) and why."""
    if isinstance(err, TimeoutError):
        return "timeout", f"({err})"
    if isinstance(err, aiohttp.ClientError):
        return "connect_error", type(err).__name__
    return "server_error", str(err)


def broken(err: Exception) -> str:
    """Why a stream broke off, for its error event and the circuit."""
    if isinstance(err, TimeoutError):
        return f"timeout ({err})"
    return str(err) if isinstance(err, ReplyRefused) else type(err).__name__


async def charge(group: Group, grant: Grant, reply: Reply, attempts: Attempts, usage: dict[str, int]) -> None:
    """Settle a call the upstream answered with what its `usage` reports, bounded by what
    the request could cost (`Budget.billed`): no report, all that was reserved. The job is
    charged its cost (`judge_proxy.spend`) with the budget."""
    upstream, lease = grant.upstream, grant.lease
    used, outlier = upstream.budget.billed(lease, usage.get("total_tokens"))
    if outlier:
        log.warning(
            "upstream %s reported %d tokens, over the %d its request could cost",
            upstream.name,
            usage["total_tokens"],
            used,
        )
    _record_usage(upstream.name, lease.tokens, used)
    metrics.JOB_TOKENS.labels(attempts.job, attempts.priority).inc(used)
    cost = call_cost(upstream.config.prices, usage, used)
    await asyncio.gather(
        settle(group, grant, used, reply, prompt_tokens=usage.get("prompt_tokens"), usage_outlier=outlier),
        group.spend.charge(attempts.job, grant.bills, attempts.role or attempts.priority, cost),
    )


async def settle(
    group: Group,
    grant: Grant,
    used_tokens: int,
    reply: Reply | None,
    *,
    used_request: bool = True,
    pause_s: float = 0.0,
    prompt_tokens: int | None = None,
    usage_outlier: bool = False,
) -> None:
    """Charge what the upstream charged (`used_tokens`), in its budget and in the job's
    share (whatever either reserved beyond it goes back), and let the queue try again."""
    headers = reply.headers if reply is not None else CIMultiDict()
    await asyncio.gather(
        grant.upstream.budget.settle(
            grant.lease,
            used_tokens,
            used_request=used_request,
            usage_outlier=usage_outlier,
            pause_s=pause_s,
            prompt_tokens=prompt_tokens,
            remaining_tokens=remaining(headers, "tokens"),
            remaining_requests=remaining(headers, "requests"),
            reset_tokens_s=reset_s(headers, "tokens"),
            reset_requests_s=reset_s(headers, "requests"),
        ),
        group.share.refund(grant.job, grant.share_tokens - used_tokens),
        group.spend.release(grant.held),
    )
    grant.held = None  # released once, however many settles follow
    group.admitter.wake()


async def stream_ended(grant: Grant, outcome: str, why: str) -> None:
    """A stream's outcome for the circuit: whole, a success; cut by the upstream, a
    failure; left by its client, neither (a probe's lease goes back)."""
    circuit = grant.upstream.circuit
    if outcome == "complete":
        await circuit.succeeded()
    elif outcome == "cut":
        await circuit.failed(f"stream_cut {why}", probe=grant.probe)
    elif grant.probe:
        await circuit.release_probe()


async def sse_events(lines: AsyncIterator[bytes], max_bytes: int) -> AsyncIterator[bytes]:
    """Server-sent events, each with the blank line that ends it, from a stream of lines;
    `ReplyRefused` for an event over `max_bytes`."""
    event: list[bytes] = []
    size = 0
    async for line in lines:
        event.append(line)
        size += len(line)
        if size > max_bytes:
            raise over_cap(max_bytes)
        if not line.strip():
            size = 0
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
    """An event's JSON object, or {}; `ReplyRefused` when it nests too deep."""
    try:
        value = decoded(data)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(data: dict) -> dict[str, int]:
    """The reply's `usage` counts (only the integer ones), with the prompt's cached tokens
    (`prompt_tokens_details.cached_tokens`) as `cached_tokens`; empty when it has none."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return {}
    counts = {k: v for k, v in usage.items() if _integer(v)}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and _integer(details.get("cached_tokens")):
        counts["cached_tokens"] = details["cached_tokens"]
    return counts


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def _nothing() -> None:
    return None


def _record_usage(upstream: str, reserved: int, actual: int) -> None:
    metrics.TOKENS.labels(upstream, "reserved").inc(reserved)
    metrics.TOKENS.labels(upstream, "actual").inc(actual)
    metrics.TOKENS.labels(upstream, "refunded").inc(max(reserved - actual, 0))
    metrics.TOKENS.labels(upstream, "charged").inc(max(actual - reserved, 0))
    metrics.RECONCILIATION_ERROR.labels(upstream).observe(reserved - actual)
    metrics.RECONCILIATION_MEAN.labels(upstream).observe(reserved - actual)
