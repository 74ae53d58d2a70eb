"""A local OpenAI-compatible upstream for tests and benchmarks: real HTTP, its own limits.

It behaves like a provider:
- Its limits are enforced one of two ways (`limit_model`), as providers differ: continuously
  refilled buckets (tokens hold at most `tpm` and refill at `tpm / 60` per second, requests
  likewise with `rpm`), or a strict trailing window (at most `tpm` tokens and `rpm` requests
  charged in any `window_s` seconds). A request is admitted when `prompt_tokens + n *
  max_tokens` and one request fit (what OpenAI counts up front); else it gets 429 with
  `retry-after` (seconds, rounded up) and `retry-after-ms`. When the reply is ready the unused
  completion tokens go back, so in the end it charges `usage.total_tokens`.
- Its tokenizer counts words and punctuation marks (`\\w+|[^\\w\\s]`) plus the chat format's
  per-message overhead: on purpose not the proxy's characters/4 rule, so the proxy's
  estimates are off and must be reconciled. Like a provider it bills every part of a request
  it would render into the prompt, not only the content: a message's other fields (`name`,
  `tool_calls`, `tool_call_id`) and the request's tools, functions and response format, each
  counted as its JSON text. With `prompt_chars_per_token` set, prompts are
  counted at that many characters a token instead (3: a third denser than the proxy's guess).
- `stream: true` is answered with server-sent events: a role chunk, the reply a word at a
  time (paced by the latency model), a finish chunk, a `usage` chunk when
  `stream_options.include_usage` asks, then `data: [DONE]`.
- Replies: to the built-in clarify task's user-simulator and judge prompts it answers as a
  capable model would, from what the prompt says (`stand_in.py`); to anything else, filler
  words of a length uniform in [1, max_tokens] (seeded). Every reply carries
  `x-ratelimit-limit|remaining|reset-requests|tokens` and `usage`.
- Latency: with `latency` set, each call takes a lognormal time to its first token (median
  and 99th percentile settable) plus its completion tokens at `tokens_per_s`, sampled from
  the seeded generator; the budget is charged on arrival, as providers do. Without it, a
  fixed `service_ms`.
- With an API key configured, a request with another key gets 401 quoting the key it sent,
  as providers do.
- Prompt caching, with `prompt_cache` set: as providers discount a prompt whose beginning
  they saw lately, a reply's `usage.prompt_tokens_details.cached_tokens` counts the tokens of
  the longest run of leading messages (not the whole prompt) an earlier request began with.

Admin routes (no auth: a test double). `POST /admin/script {"replies": [...]}` queues replies
taken one per chat request: `{"content": "..."}` answers with that text, `{"status": 500}`
(or 429 with optional `retry_after_s` / `retry_after_ms`, or 400 with a `message` in which
`{authorization}` becomes the key received) answers that error without charging,
`{"delay_s": 1.5}` waits that long first, `{"model": ...}` names the reply's model (any JSON value, as a
hostile provider might), `{"cut_after": 2}` breaks a stream's connection
after that many content chunks (charging the whole reservation) and `{"token_delay_s": 0.1}`
paces a stream's chunks. A provider that misbehaves in its reply: `{"usage": {...}}` reports
these `usage` fields instead of its own (any JSON values; it still charges what it counted),
`{"padding_bytes": N}` adds a string of N bytes to the reply (a stream: as one event before
the first chunk), written a piece at a time so the stand-in never holds it whole
(`padded_bytes_sent` counts what went out), and `{"nesting": N}` adds a value N arrays deep.
`GET /admin/stats` gives the counters,
`GET /admin/requests` the last request bodies, `GET /admin/request-tags` how many admitted
requests came with each `X-Client-Request-Id` (the proxy sends its clients' idempotency
keys there),
`POST /admin/reset` starts afresh (no fault).

Outages: `POST /admin/fault {"mode": ...}` makes every chat call fail one way until
`{"mode": "none"}` or a reset: `drop` closes the connection without a reply, `hang` accepts
the request and answers only once the fault is cleared, `429` refuses with `retry-after`
(`retry_after_s`, default 1), `5xx` answers `status` (default 500), `garbage` answers 200
with a body that is not JSON, `unparseable` answers a well-formed completion whose text no
judge rubric reads, and `stall_stream` sends a stream's headers and first chunk, then nothing
until cleared (a call that is not a stream is answered). `--fault MODE` starts the process
with one. A refused connection is no fault of a running server: stop it (leave
`serve_in_thread`'s block), or point a client at a closed port.

Run: `python -m devtools.provider --port 9000 --tpm 60000 --rpm 600 --latency`.

What it does not model: a provider's queueing under load (latency here does not grow with
concurrency), per-model limits within one key, daily quotas, cached-prompt discounts, and any
judgement beyond the built-in clarify task.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import re
import threading
import time
import typing
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated, Literal, Protocol, runtime_checkable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, TypeAdapter, model_validator
from starlette.types import Receive, Scope, Send

from devtools.provider_replies import reply_for
from judge_proxy.upstream import (
    BILLED_REQUEST_FIELDS,
    MESSAGE_OVERHEAD_TOKENS,
    REPLY_PRIMING_TOKENS,
    format_duration,
    message_text,
)

UNPARSEABLE = "I would rather not say."
"""The `unparseable` fault's reply: no verdict, no score, no JSON."""
WORD = re.compile(r"\w+|[^\w\s]")
FILLER = ("the", "judge", "reads", "each", "turn", "and", "scores", "it", "with", "care")


class Latency(BaseModel):
    """How long a hosted model takes: a lognormal wait for the first token, then decoding.

    The defaults are close to a hosted API under load: about 1 s for a short reply, a tail
    past 5 s (the 99th percentile of the first-token wait alone is 5 s)."""

    median_s: float = Field(0.6, gt=0, description="Median time to the first token.")
    p99_s: float = Field(5.0, gt=0, description="99th percentile of the time to the first token.")
    tokens_per_s: float = Field(80.0, gt=0, description="Decoding speed after the first token.")

    @model_validator(mode="after")
    def _tail_above_median(self) -> Latency:
        if self.p99_s < self.median_s:
            raise ValueError("latency.p99_s must be at least latency.median_s")
        return self

    @property
    def sigma(self) -> float:
        """The lognormal's shape: ln(p99 / median) over the normal's 99th percentile."""
        return math.log(self.p99_s / self.median_s) / Z_99

    def sample_s(self, rng: random.Random, completion_tokens: int) -> float:
        return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)) + completion_tokens / self.tokens_per_s


Z_99 = 2.3263478740408408
"""The standard normal's 99th percentile."""


class RateLimitFault(BaseModel):
    mode: Literal["429"]
    retry_after_s: float = Field(1.0, ge=0)


class ServerErrorFault(BaseModel):
    mode: Literal["5xx"]
    status: int = Field(500, ge=500, le=599)


PlainFaultMode = Literal["none", "drop", "hang", "garbage", "unparseable", "stall_stream"]


class PlainFault(BaseModel):
    mode: PlainFaultMode


Fault = Annotated[RateLimitFault | ServerErrorFault | PlainFault, Field(discriminator="mode")]
FAULT = TypeAdapter(Fault)
NO_FAULT = PlainFault(mode="none")


class LocalUpstreamConfig(BaseModel):
    tpm: int = Field(60_000, gt=0)
    rpm: int = Field(600, gt=0)
    limit_model: Literal["bucket", "window"] = "bucket"
    window_s: float = Field(60.0, gt=0, description="The trailing window of the 'window' model.")
    prompt_chars_per_token: float | None = Field(
        None, gt=0, description="Count prompts at this many characters a token (words when unset)."
    )
    models: list[str] = ["local-model"]
    service_ms: float = Field(2.0, ge=0, description="Fixed time to produce a reply (when `latency` is unset).")
    latency: Latency | None = None
    default_max_tokens: int = Field(256, ge=1)
    seed: int = 0
    api_key: str | None = None
    prompt_cache: bool = Field(False, description="Report cached prompt tokens (`prompt_tokens_details`).")
    coarse_judge_models: list[str] = Field(
        [],
        description="Models (as requests name them) that judge as a cheaper model that reads less might: "
        "interactivity's clarification by its anchors, every other criterion 5 (`provider_replies.coarse`).",
    )


@dataclass
class Charge:
    """What one admitted request was charged, and when; corrected once its reply is done."""

    at: float
    amount: float


class Bucket:
    """A continuously refilled bucket: holds at most `capacity`, refills `capacity` a minute."""

    def __init__(self, capacity: float, now: float) -> None:
        self.capacity = capacity
        self.level = capacity
        self.updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60)
        self.updated = now

    def wait_s(self, amount: float) -> float:
        return max(0.0, (amount - self.level) * 60 / self.capacity)

    def take(self, amount: float) -> Charge:
        self.level -= amount
        return Charge(self.updated, amount)

    def correct(self, charge: Charge, amount: float) -> None:
        """A charge turned out to be `amount`: give back (or take) the difference."""
        self.level = min(self.capacity, self.level + charge.amount - amount)
        charge.amount = amount

    def reset_s(self) -> float:
        return (self.capacity - self.level) * 60 / self.capacity


class Window:
    """A strict trailing window: at most `capacity` charged in any `window_s` seconds."""

    def __init__(self, capacity: float, now: float, window_s: float) -> None:
        self.capacity = capacity
        self.window_s = window_s
        self.charges: deque[Charge] = deque()
        """Oldest first."""
        self.used = 0.0
        self.now = now

    @property
    def level(self) -> float:
        return self.capacity - self.used

    def refill(self, now: float) -> None:
        self.now = now
        while self.charges and self.charges[0].at + self.window_s <= now:
            self.used -= self.charges.popleft().amount

    def wait_s(self, amount: float) -> float:
        excess = self.used + amount - self.capacity
        if excess <= 0:
            return 0.0
        for charge in self.charges:  # they leave in order
            excess -= charge.amount
            if excess <= 0:
                return max(0.0, charge.at + self.window_s - self.now)
        return self.window_s

    def take(self, amount: float) -> Charge:
        charge = Charge(self.now, amount)
        self.charges.append(charge)
        self.used += amount
        return charge

    def correct(self, charge: Charge, amount: float) -> None:
        if charge.at + self.window_s > self.now:  # still in the window
            self.used += amount - charge.amount
        charge.amount = amount

    def reset_s(self) -> float:
        return self.charges[-1].at + self.window_s - self.now if self.charges else 0.0


PAD = b"x" * 65536
"""A piece of a padded reply."""


def as_reported(reply: dict, script: dict) -> dict:
    """`reply` with the `usage` fields the script has it report instead of its own."""
    return {**reply, "usage": {**reply["usage"], **script.get("usage", {})}}


def padded_json(value: dict, script: dict) -> Iterator[bytes]:
    """`value`'s JSON with a `nested` field `script["nesting"]` arrays deep and a `padding`
    string of `script["padding_bytes"]` bytes, in pieces of at most `len(PAD)` for the padding."""
    members = [json.dumps(value).encode()[1:-1]] if value else []
    depth = script.get("nesting", 0)
    if depth:
        members.append(b'"nested": ' + b"[" * depth + b"]" * depth)
    yield b"{" + b", ".join([*members, b'"padding": "'])
    left = script.get("padding_bytes", 0)
    while left > 0:
        yield PAD[: min(left, len(PAD))]
        left -= len(PAD)
    yield b'"}'


def count_tokens(text: str) -> int:
    return len(WORD.findall(text))


def count_prompt_tokens(messages: list[dict], chars_per_token: float | None = None, request: dict | None = None) -> int:
    """The prompt as a provider bills it: each message's content, and, as their JSON text,
    its other fields (`name`, `tool_calls`, `tool_call_id`, ...) and the request's billed
    fields beside the messages (`request`: the whole body; its tools, functions, response
    format), plus the chat format's overheads."""

    def count(text: str) -> int:
        return count_tokens(text) if chars_per_token is None else math.ceil(len(text) / chars_per_token)

    def hidden(fields: dict, names: Iterable[str]) -> int:
        return sum(count(json.dumps(fields[name])) for name in names if fields.get(name) is not None)

    per_message = (
        count(message_text(m.get("content"))) + hidden(m, m.keys() - {"role", "content"}) + MESSAGE_OVERHEAD_TOKENS
        for m in messages
    )
    return sum(per_message) + hidden(request or {}, BILLED_REQUEST_FIELDS) + REPLY_PRIMING_TOKENS


PREFIXES_KEPT = 100_000
"""Leading-message runs the prompt cache remembers before it starts afresh."""


class LocalUpstream:
    def __init__(
        self,
        config: LocalUpstreamConfig,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = config
        self.clock = clock
        """Seconds, monotonic; the buckets refill by it (tests pass a clock they move)."""
        self.sleep = sleep
        self.cleared = asyncio.Event()
        self.reset()

    def reset(self) -> None:
        """Full buckets, no script, zero counters: as just started."""
        now = self.clock()
        self.tokens = self.limit(self.config.tpm, now)
        self.requests = self.limit(self.config.rpm, now)
        self.rng = random.Random(self.config.seed)
        self.script: deque[dict] = deque()
        self.recent: deque[dict] = deque(maxlen=100)
        self.request_tags: Counter[str] = Counter()
        self.prefixes: set[str] = set()
        """Digests of every run of leading messages a request began with (`prompt_cache`)."""
        self.stats = {
            "requests": 0,
            "accepted": 0,
            "rejected_429": 0,
            "scripted_errors": 0,
            "streams_cut": 0,
            "padded_bytes_sent": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "tokens_accepted": 0,
            "cached_tokens": 0,
            "recognised": 0,
            "faulted": 0,
            "latency_s_total": 0.0,
        }
        self.started = now
        self.set_fault(NO_FAULT)

    def limit(self, per_minute: float, now: float) -> Bucket | Window:
        """A limit of `per_minute`, kept as the configured `limit_model` keeps it."""
        if self.config.limit_model == "window":
            return Window(per_minute, now, self.config.window_s)
        return Bucket(per_minute, now)

    def set_fault(self, fault: Fault) -> None:
        """Every chat call fails as `fault` says from now on; calls the last one holds
        (`hang`, `stall_stream`) go on."""
        self.cleared.set()
        self.fault = fault
        self.cleared = asyncio.Event()
        """Set when the fault is replaced: what a hung call waits for."""

    def limit_headers(self) -> dict[str, str]:
        now = self.clock()
        self.tokens.refill(now)
        self.requests.refill(now)
        return {
            "x-ratelimit-limit-requests": str(self.config.rpm),
            "x-ratelimit-limit-tokens": str(self.config.tpm),
            "x-ratelimit-remaining-requests": str(max(0, math.floor(self.requests.level))),
            "x-ratelimit-remaining-tokens": str(max(0, math.floor(self.tokens.level))),
            "x-ratelimit-reset-requests": format_duration(self.requests.reset_s()),
            "x-ratelimit-reset-tokens": format_duration(self.tokens.reset_s()),
        }

    def error(self, status: int, message: str, kind: str, extra_headers: dict | None = None) -> JSONResponse:
        headers = {**self.limit_headers(), **(extra_headers or {})}
        return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)

    def admit(self, cost: int) -> tuple[Charge | None, float]:
        """Charge `cost` tokens and one request (the token charge, 0), or (None, the
        seconds until they fit)."""
        now = self.clock()
        self.tokens.refill(now)
        self.requests.refill(now)
        wait_s = max(self.tokens.wait_s(cost), self.requests.wait_s(1))
        if wait_s > 0:
            return None, wait_s
        self.requests.take(1)
        return self.tokens.take(cost), 0.0

    def charge(self, charge: Charge, used: int) -> None:
        """The reply is done: the charge becomes what it used."""
        self.tokens.refill(self.clock())
        self.tokens.correct(charge, used)

    def rate_limited(self, wait_s: float) -> JSONResponse:
        self.stats["rejected_429"] += 1
        headers = {"retry-after": str(math.ceil(wait_s)), "retry-after-ms": str(math.ceil(wait_s * 1000))}
        return self.error(429, "rate limit reached: tokens or requests per minute", "rate_limit_exceeded", headers)

    def scripted_error(self, script: dict, authorization: str) -> JSONResponse:
        self.stats["scripted_errors"] += 1
        headers = {}
        if "retry_after_s" in script:
            headers["retry-after"] = str(script["retry_after_s"])
        if "retry_after_ms" in script:
            headers["retry-after-ms"] = str(script["retry_after_ms"])
        message = script.get("message", "scripted error").replace("{authorization}", authorization)
        return self.error(script["status"], message, "scripted", headers)

    def filler(self, num_words: int) -> str:
        return " ".join(self.rng.choice(FILLER) for _ in range(num_words))

    def completion(self, body: dict, prompt_tokens: int, max_tokens: int, content: str | None) -> dict:
        """The reply: `content` (scripted), else the stand-in's answer to a prompt it knows,
        else filler; cut at `max_tokens` (finish_reason `length`)."""
        if content is None:
            content = reply_for(body.get("messages", []), coarse=body.get("model") in self.config.coarse_judge_models)
            self.stats["recognised"] += content is not None
        choices, completion_tokens = [], 0
        for index in range(body.get("n", 1)):
            text = content if content is not None else self.filler(self.rng.randint(1, max_tokens))
            finish = "stop"
            if count_tokens(text) > max_tokens:
                text, finish = " ".join(WORD.findall(text)[:max_tokens]), "length"
            completion_tokens += count_tokens(text)
            choices.append({"index": index, "finish_reason": finish, "message": {"role": "assistant", "content": text}})
        usage: dict[str, int | dict[str, int]] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.config.prompt_cache:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens(body.get("messages", []))}
        return {
            "id": f"local-{self.stats['requests']}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": choices,
            "usage": usage,
        }

    def cached_tokens(self, messages: list[dict]) -> int:
        """The tokens of the longest run of leading messages, short of the whole prompt, that
        an earlier request began with; this request's runs are remembered for later ones."""
        digest, cached = hashlib.sha256(), 0
        for end, message in enumerate(messages, 1):
            digest.update(json.dumps(message, sort_keys=True).encode())
            seen = digest.hexdigest()
            if end < len(messages) and seen in self.prefixes:
                cached = count_prompt_tokens(messages[:end], self.config.prompt_chars_per_token) - REPLY_PRIMING_TOKENS
            self.prefixes.add(seen)
        if len(self.prefixes) > PREFIXES_KEPT:  # a provider's cache forgets too
            self.prefixes.clear()
        return cached

    async def chat(self, request: Request) -> Response:
        self.stats["requests"] += 1
        authorization = request.headers.get("authorization", "").removeprefix("Bearer ")
        if self.config.api_key is not None and authorization != self.config.api_key:
            return self.error(401, f"Incorrect API key provided: {authorization}", "invalid_api_key")
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as err:
            return self.error(400, f"malformed JSON: {err}", "invalid_request_error")
        self.recent.append(body)
        script = self.script.popleft() if self.script else {}
        if self.fault.mode != "none":
            self.stats["faulted"] += 1
            faulted = await self.faulted(script)
            if faulted is not None:
                return faulted
        if script.get("delay_s"):
            await asyncio.sleep(script["delay_s"])
        if "status" in script:
            return self.scripted_error(script, authorization)
        if body.get("model") not in self.config.models:
            return self.error(404, f"The model `{body.get('model')}` does not exist", "model_not_found")
        return await self.answer(body, script, request.headers.get("x-client-request-id", ""))

    async def faulted(self, script: dict) -> Response | None:
        """The fault's answer to a chat call, or None when it goes on (to `script`, which
        `unparseable` and `stall_stream` amend) after a `hang` is cleared or for a fault
        that only shapes the reply."""
        fault = self.fault
        if fault.mode == "429":
            retry_after_s = fault.retry_after_s
            headers = {"retry-after": str(math.ceil(retry_after_s)), "retry-after-ms": str(round(retry_after_s * 1000))}
            return self.error(429, "fault: rate limit reached", "rate_limit_exceeded", headers)
        if fault.mode == "5xx":
            return self.error(fault.status, "fault: the server had an error", "server_error")
        if fault.mode == "garbage":
            return Response(b"<html><body>502 Bad Gateway</body></html>", media_type="text/html")
        if fault.mode == "unparseable":
            script["content"] = UNPARSEABLE
        elif fault.mode == "stall_stream":
            script["stall"] = self.cleared
        elif fault.mode == "hang":
            await self.cleared.wait()
        return None

    async def answer(self, body: dict, script: dict, tag: str = "") -> Response:
        prompt_tokens = count_prompt_tokens(body.get("messages", []), self.config.prompt_chars_per_token, body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.config.default_max_tokens
        reserved = prompt_tokens + body.get("n", 1) * max_tokens
        if reserved > self.config.tpm:
            return self.error(
                400,
                f"request needs {reserved} tokens, more than the {self.config.tpm} TPM limit",
                "invalid_request_error",
            )
        charge, wait_s = self.admit(reserved)
        if charge is None:
            return self.rate_limited(wait_s)
        if tag:
            self.request_tags[tag] += 1
        reply = self.completion(body, prompt_tokens, max_tokens, script.get("content"))
        reply["model"] = script.get("model", reply["model"])
        if body.get("stream"):
            return StreamingResponse(
                self.stream(body, reply, charge, script), media_type="text/event-stream", headers=self.limit_headers()
            )
        latency_s = self.latency_s(reply["usage"]["completion_tokens"])
        if latency_s:
            await self.sleep(latency_s)
        self.stats["latency_s_total"] += latency_s
        self.done(reply, charge)
        sent = as_reported(reply, script)
        if script.get("padding_bytes") or script.get("nesting"):
            pieces = self.counted(padded_json(sent, script))
            return StreamingResponse(pieces, media_type="application/json", headers=self.limit_headers())
        return JSONResponse(sent, headers=self.limit_headers())

    async def counted(self, pieces: Iterable[bytes]) -> AsyncIterator[bytes]:
        """`pieces` as they are written, counted in `padded_bytes_sent`. Each waits a turn of
        the event loop: once the client has gone, uvicorn drops a write without one, and the
        disconnect would end the reply only after all of it was counted."""
        for piece in pieces:
            self.stats["padded_bytes_sent"] += len(piece)
            yield piece
            await asyncio.sleep(0)

    def done(self, reply: dict, charge: Charge) -> None:
        usage = reply["usage"]
        self.charge(charge, usage["total_tokens"])
        self.stats["accepted"] += 1
        self.stats["prompt_tokens"] += usage["prompt_tokens"]
        self.stats["completion_tokens"] += usage["completion_tokens"]
        self.stats["tokens_accepted"] += usage["total_tokens"]
        self.stats["cached_tokens"] += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)

    async def stream(self, body: dict, reply: dict, charge: Charge, script: dict) -> AsyncIterator[bytes]:
        """The reply as server-sent events, a word per chunk, paced like the plain reply."""
        base = {
            "id": reply["id"],
            "object": "chat.completion.chunk",
            "created": reply["created"],
            "model": reply["model"],
        }
        include_usage = (body.get("stream_options") or {}).get("include_usage") is True

        def event(choices: list, **extra) -> bytes:
            return b"data: " + json.dumps({**base, "choices": choices, **extra}).encode() + b"\n\n"

        first_token_s = self.latency_s(0)
        per_token_s = 0.0 if self.config.latency is None else 1 / self.config.latency.tokens_per_s
        per_token_s = script.get("token_delay_s", per_token_s)
        cut_after = script.get("cut_after")
        await self.sleep(first_token_s)
        if script.get("padding_bytes") or script.get("nesting"):
            async for piece in self.counted([b"data: ", *padded_json({}, script), b"\n\n"]):
                yield piece
        sent = 0
        for choice in reply["choices"]:
            index = choice["index"]
            yield event([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            if "stall" in script:
                await script.pop("stall").wait()
            words = choice["message"]["content"].split(" ")
            for position, word in enumerate(words):
                if cut_after is not None and sent >= cut_after:
                    self.stats["streams_cut"] += 1
                    raise ConnectionAbortedError("scripted: the stream breaks off")  # charge stays whole
                text = word if position == 0 else " " + word
                yield event([{"index": index, "delta": {"content": text}, "finish_reason": None}])
                sent += 1
                if per_token_s:
                    await self.sleep(per_token_s)
            yield event([{"index": index, "delta": {}, "finish_reason": choice["finish_reason"]}])
        if include_usage:
            yield event([], usage=as_reported(reply, script)["usage"])
        yield b"data: [DONE]\n\n"
        self.done(reply, charge)

    def latency_s(self, completion_tokens: int) -> float:
        """How long this reply takes: sampled from the latency model, or `service_ms`."""
        if self.config.latency is None:
            return self.config.service_ms / 1000
        return self.config.latency.sample_s(self.rng, completion_tokens)

    def snapshot(self) -> dict:
        self.limit_headers()  # refills both buckets to now
        return {
            **self.stats,
            "tpm": self.config.tpm,
            "rpm": self.config.rpm,
            "tokens_level": self.tokens.level,
            "requests_level": self.requests.level,
            "uptime_s": self.clock() - self.started,
        }


class StandInApp(FastAPI):
    """The stand-in's app: with the `drop` fault, a chat call's connection is closed before
    any reply (no route can do that: an ASGI app that does not answer gets a 500 sent)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        upstream: LocalUpstream = self.state.upstream
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions") and upstream.fault.mode == "drop":
            upstream.stats["requests"] += 1
            upstream.stats["faulted"] += 1
            await drop_connection(receive, send)
            return
        await super().__call__(scope, receive, send)


@runtime_checkable
class RequestCycle(Protocol):
    """What `drop_connection` uses of uvicorn's request cycle (either HTTP implementation's)."""

    transport: asyncio.Transport
    disconnected: bool


DRAIN_S = 5.0
"""How long `drop_connection` waits for the rest of a request's body before closing anyway."""


async def drop_connection(receive: Receive, send: Send) -> None:
    """Close the connection of the request `send` answers, sending nothing. The body is read
    first: a socket closed with bytes unread is reset (RST), which a client sees as a read
    error rather than a server that closed without a reply, and which of the two it saw
    would depend on how the body's packets raced the close. Under uvicorn, `send` is a
    method of the request's cycle, which holds the connection's transport; the cycle sees
    the connection lost (a loop turn or two later) and sends no 500 of its own."""
    cycle = getattr(send, "__self__", None)
    if not isinstance(cycle, RequestCycle):
        raise TypeError("only uvicorn's requests can have their connection dropped")
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_S):
            while (message := await receive())["type"] == "http.request" and message.get("more_body"):
                pass
    cycle.transport.close()
    while not cycle.disconnected:
        await asyncio.sleep(0)


def create_app(config: LocalUpstreamConfig) -> FastAPI:
    upstream = LocalUpstream(config)
    app = StandInApp(title="Tandem local upstream")
    app.state.upstream = upstream
    app.add_api_route("/v1/chat/completions", upstream.chat, methods=["POST"])

    @app.post("/admin/script")
    async def script(request: Request) -> dict:
        replies = (await request.json())["replies"]
        upstream.script.extend(replies)
        return {"queued": len(upstream.script)}

    @app.post("/admin/reset")
    async def reset() -> dict:
        upstream.reset()
        return {"reset": True}

    @app.post("/admin/fault")
    async def fault(request: Request) -> dict:
        upstream.set_fault(FAULT.validate_python(await request.json()))
        return {"fault": upstream.fault.mode}

    @app.get("/admin/stats")
    async def stats() -> dict:
        return upstream.snapshot()

    @app.get("/admin/request-tags")
    async def request_tags() -> dict[str, int]:
        return dict(upstream.request_tags)

    @app.get("/admin/requests")
    async def requests() -> list[dict]:
        return list(upstream.recent)

    return app


@contextlib.contextmanager
def serve_in_thread(app, port: int, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a daemon thread for the block; yields its base URL."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--tpm", type=int, default=60_000)
    parser.add_argument("--rpm", type=int, default=600)
    parser.add_argument(
        "--limit-model",
        choices=["bucket", "window"],
        default="bucket",
        help="continuous refill, or a strict trailing window of --window-s",
    )
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument(
        "--prompt-chars-per-token", type=float, help="count prompts at this many characters a token (default: words)"
    )
    parser.add_argument("--model", action="append", dest="models", help="a model it serves (repeatable)")
    parser.add_argument("--service-ms", type=float, default=2.0, help="fixed reply time without --latency")
    parser.add_argument("--latency", action="store_true", help="a hosted API's latency: the three options below")
    parser.add_argument("--latency-median-s", type=float, default=Latency().median_s)
    parser.add_argument("--latency-p99-s", type=float, default=Latency().p99_s)
    parser.add_argument("--tokens-per-s", type=float, default=Latency().tokens_per_s)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-cache", action="store_true", help="report cached prompt tokens, as providers do")
    parser.add_argument("--api-key-env", help="environment variable holding the key clients must send")
    parser.add_argument(
        "--fault",
        choices=[*typing.get_args(PlainFaultMode), "429", "5xx"],
        default="none",
        help="fail every chat call this way (as POST /admin/fault)",
    )
    args = parser.parse_args(argv)
    latency = (
        Latency(median_s=args.latency_median_s, p99_s=args.latency_p99_s, tokens_per_s=args.tokens_per_s)
        if args.latency
        else None
    )
    config = LocalUpstreamConfig(
        tpm=args.tpm,
        rpm=args.rpm,
        limit_model=args.limit_model,
        window_s=args.window_s,
        prompt_chars_per_token=args.prompt_chars_per_token,
        models=args.models or ["local-model"],
        service_ms=args.service_ms,
        latency=latency,
        seed=args.seed,
        api_key=os.environ[args.api_key_env] if args.api_key_env else None,
        prompt_cache=args.prompt_cache,
    )
    app = create_app(config)
    app.state.upstream.set_fault(FAULT.validate_python({"mode": args.fault}))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
