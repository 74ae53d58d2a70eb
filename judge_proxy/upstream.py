"""Upstreams: their configuration, the cost of a request, the HTTP call, and what their
rate-limit headers say.

An upstream is one OpenAI-compatible endpoint with its own key and budget. Upstreams that
list the same `model` (the name clients ask for) form a group that shares the load and
fails over. API keys are read from the environment variable the config names and live in
a `SecretStr`: they are sent upstream and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import os
import random
import re
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml
from aiohttp.http_exceptions import LineTooLong
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from judge_proxy.budget import PROMPT_RATIO_BAND, Budget, LimitModel
from judge_proxy.circuit import Circuit
from judge_proxy.replies import over_cap, read_capped
from judge_proxy.spend import Prices

MESSAGE_OVERHEAD_TOKENS = 4
"""Tokens the chat format adds per message (role, separators), as OpenAI's counting guide."""
REPLY_PRIMING_TOKENS = 3
"""Tokens of the assistant header every reply starts with."""


class UpstreamConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Label in metrics, logs, /v1/budget, Redis keys.")
    model: str = Field(min_length=1, description="The model name clients ask for; upstreams sharing it share the load.")
    upstream_model: str | None = Field(None, description="The model name sent upstream; `model` when unset.")
    base_url: str = Field(pattern=r"^https?://", description="Up to and including /v1.")
    api_key_env: str | None = Field(None, description="Environment variable holding the API key.")
    tpm: int = Field(gt=0, description="Tokens per minute (prompt + completion).")
    rpm: int = Field(gt=0, description="Requests per minute.")
    max_concurrency: int = Field(16, ge=1, description="Calls in flight at once, across all replicas.")
    weight: float = Field(1.0, gt=0, description="Share of the group's load when several have budget.")
    timeout_s: float = Field(60.0, gt=0, description="Longest a whole call that is not a stream may take.")
    first_byte_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest wait for the reply's headers: a hung upstream fails by it. A reply that is not "
        "a stream sends its headers when done, so for it this is a cap beside timeout_s.",
    )
    idle_timeout_s: float = Field(
        30.0, gt=0, description="Longest a stream may go without a byte; a stream still arriving is never cut."
    )
    tokenizer: str | None = Field(None, description="Local tokenizer.json for prompt estimates; chars/4 when unset.")
    structured_output: bool = Field(
        False,
        description="The upstream constrains a reply to a JSON schema given as `response_format` (vLLM's "
        "structured outputs, OpenAI's json_schema): verdicts are asked for that way. Upstreams "
        "of one `model` must agree.",
    )
    limit_model: LimitModel = Field(
        "window",
        description="How the provider enforces tpm/rpm: 'window' (a strict trailing window; "
        "the safe choice, a bucket accepts whatever a window does) or 'bucket' "
        "(continuous refill, a minute's burst allowed).",
    )
    window_s: float = Field(60.0, gt=0, description="The provider's trailing window ('window' only).")
    pace_s: float = Field(
        6.0,
        ge=0,
        description="'window' only: admissions paced at tpm/60 a second, at most "
        "this many seconds' worth at once (0: no pacing).",
    )
    prompt_margin: float = Field(
        0.05, ge=0, le=1, description="Reserve this share above the learned prompt token count."
    )
    prices: Prices | None = Field(
        None,
        description="USD per million tokens, for what each job's calls cost (`judge_proxy.spend`); none: tokens only.",
    )
    prompt_ratio_band: tuple[float, float] = Field(
        PROMPT_RATIO_BAND,
        description="[low, high] around 1: the learned ratio of the upstream's prompt count "
        "to the local estimate stays inside; a call whose own ratio lies outside "
        "teaches nothing and is counted as an outlier.",
    )

    @property
    def quiet_bound_s(self) -> float:
        """The longest a call goes on with nothing arriving, or a call that is not a stream
        takes in all: what a concurrency lease or a probe outlasts (a stream renews its lease)."""
        return max(self.timeout_s, self.first_byte_timeout_s, self.idle_timeout_s)

    @field_validator("prompt_ratio_band")
    @classmethod
    def _band_holds_one(cls, band: tuple[float, float]) -> tuple[float, float]:
        if not 0 < band[0] <= 1 <= band[1]:
            raise ValueError(f"prompt_ratio_band must be [low, high] with 0 < low <= 1 <= high; got {list(band)}")
        return band


class UpstreamsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    upstreams: list[UpstreamConfig]

    @field_validator("upstreams")
    @classmethod
    def _unique_names(cls, upstreams: list[UpstreamConfig]) -> list[UpstreamConfig]:
        names = [u.name for u in upstreams]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"upstream names must be unique; repeated: {duplicates}")
        return upstreams

    @field_validator("upstreams")
    @classmethod
    def _groups_agree_on_structured_output(cls, upstreams: list[UpstreamConfig]) -> list[UpstreamConfig]:
        """A verdict's prompt and format must not depend on which upstream of a model answers."""
        for model in {u.model for u in upstreams}:
            if len({u.structured_output for u in upstreams if u.model == model}) > 1:
                raise ValueError(f"upstreams of model {model!r} disagree on structured_output")
        return upstreams


def load_upstreams(path: str) -> list[UpstreamConfig]:
    """The upstreams listed in a YAML (or JSON) file; none when `path` is empty."""
    if not path:
        return []
    return UpstreamsFile.model_validate(yaml.safe_load(Path(path).read_text())).upstreams


def api_key(config: UpstreamConfig) -> SecretStr | None:
    if config.api_key_env is None:
        return None
    value = os.environ.get(config.api_key_env)
    if not value:
        raise ValueError(f"upstream {config.name!r}: environment variable {config.api_key_env} is not set")
    return SecretStr(value)


def chars_over_4(text: str) -> int:
    """The documented fallback estimate: one token per four characters, rounded up."""
    return -(-len(text) // 4)


def tokenizer_counter(path: str) -> Callable[[str], int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def message_text(content: str | list | None) -> str:
    """The text of a message's `content`: a string, or the text parts of a parts list."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def json_texts(value: object) -> Iterator[str]:
    """The strings of a JSON value, object keys included, numbers and booleans as written:
    what a provider renders into the prompt of a tool call or a schema (its punctuation aside)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from json_texts(item)
    elif isinstance(value, list):
        for item in value:
            yield from json_texts(item)
    elif value is not None:
        yield json.dumps(value)


def message_texts(message: Mapping) -> Iterator[str]:
    """The billed text of one message: its content's text, and every other field but `role`
    (`name`, `tool_calls` with their function names and arguments, `function_call`,
    `tool_call_id`, ...). Providers bill all of it; a count of the content alone let a request
    hide any amount of prompt from the estimate."""
    yield message_text(message.get("content"))
    for field, value in message.items():
        if field not in ("role", "content"):
            yield from json_texts(value)


BILLED_REQUEST_FIELDS = ("tools", "functions", "tool_choice", "function_call", "response_format")
"""Fields beside `messages` that providers render into the prompt and bill as prompt tokens."""


def request_texts(request: Mapping) -> Iterator[str]:
    """The billed text of a request outside its messages: tool and function schemas, a
    forced tool choice, a response format's JSON schema."""
    for field in BILLED_REQUEST_FIELDS:
        yield from json_texts(request.get(field))


def estimate_prompt_tokens(
    messages: list[dict], count_tokens: Callable[[str], int] = chars_over_4, request: Mapping | None = None
) -> int:
    """The prompt tokens of `messages` (and of `request`'s billed fields, `request` being
    the whole body) by `count_tokens`: each text counted on its own, plus the chat format's
    overheads."""
    texts = (t for m in messages for t in message_texts(m))
    counted = sum(map(count_tokens, texts)) + sum(map(count_tokens, request_texts(request or {})))
    return counted + MESSAGE_OVERHEAD_TOKENS * len(messages) + REPLY_PRIMING_TOKENS


@dataclass
class Reply:
    status: int
    body: bytes
    headers: Mapping[str, str]
    """Case-insensitive (aiohttp's CIMultiDictProxy)."""
    events: aiohttp.ClientResponse | None = None
    """A stream's open response (2xx to `stream: true`), its body unread; the reader closes it."""


class UpstreamTimeout(TimeoutError):
    """A call cut by one of its upstream's timeouts; the message says which."""


@contextlib.asynccontextmanager
async def cut_at(deadline: float, what: str) -> AsyncIterator[None]:
    """The block, cut with `UpstreamTimeout(what)` at `deadline` (the event loop's clock)."""
    try:
        async with asyncio.timeout_at(deadline):
            yield
    except TimeoutError:
        raise UpstreamTimeout(what) from None


class Upstream:
    def __init__(self, config: UpstreamConfig, budget: Budget, circuit: Circuit, max_reply_bytes: int) -> None:
        self.config = config
        self.max_reply_bytes = max_reply_bytes
        """The most of a reply (of a stream: of one line) read (`judge_proxy.replies`)."""
        self.name = config.name
        self.budget = budget
        self.circuit = circuit
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        self._key = api_key(config)
        self.count_tokens = tokenizer_counter(config.tokenizer) if config.tokenizer else chars_over_4
        self.http: aiohttp.ClientSession | None = None
        """One pool per upstream, so a dead upstream's sockets stay out of the others' way;
        opened on the first call, in the serving event loop. aiohttp, not httpx: httpx's
        pool bookkeeping took half the proxy's CPU at a few dozen calls a second (py-spy,
        bench/async_speedup.py)."""

    def __repr__(self) -> str:
        return f"Upstream({self.name!r}, {self.url!r})"

    def prompt_estimate(self, messages: list[dict], request: Mapping | None = None) -> int:
        """The prompt's tokens by the local count, with `request`'s billed fields beside the
        messages (the budget scales it by the learned ratio)."""
        return estimate_prompt_tokens(messages, self.count_tokens, request)

    async def post(self, payload: bytes, *, stream: bool = False, tag: str = "") -> Reply:
        """POST a chat request. A stream that the upstream accepts comes back open, in
        `Reply.events`; anything else is read whole. `tag` names the call to the upstream
        (`X-Client-Request-Id`, which OpenAI's API echoes in its logs)."""
        headers = {"content-type": "application/json"}
        if tag:
            headers["x-client-request-id"] = tag
        if self._key is not None:
            headers["authorization"] = f"Bearer {self._key.get_secret_value()}"
        http = self.session()
        try:
            return await self._post_once(http, payload, headers, stream)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as err:
            # A pooled keep-alive connection the server had just closed (uvicorn closes idle
            # ones after 5 s, aiohttp keeps them 15 s), seen as a disconnect or a reset:
            # nothing was answered, so once more on a fresh connection. Under load it
            # otherwise cost a 502 (bench/judge_proxy.py). Other errors are the upstream's.
            if isinstance(err, aiohttp.ClientOSError) and err.errno not in (errno.ECONNRESET, errno.EPIPE):
                raise
            return await self._post_once(http, payload, headers, stream)

    def session(self) -> aiohttp.ClientSession:
        """The upstream's pool (`http`), opened on the first call and again once closed."""
        if self.http is None or self.http.closed:
            # No timeout of aiohttp's: a total one cuts a stream still arriving, and its read
            # timeout also bounds the wait for headers. `_post_once` and `lines` set their own.
            self.http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None),
                connector=aiohttp.TCPConnector(limit=self.config.max_concurrency),
            )
        return self.http

    async def _post_once(
        self, http: aiohttp.ClientSession, payload: bytes, headers: dict[str, str], stream: bool
    ) -> Reply:
        """Headers within `first_byte_timeout_s`; a whole reply that is not a stream within
        `timeout_s` of the start, and `ReplyRefused` past `max_reply_bytes` of it."""
        config = self.config
        now = asyncio.get_running_loop().time()
        first_byte_s = config.first_byte_timeout_s if stream else min(config.first_byte_timeout_s, config.timeout_s)
        async with cut_at(now + first_byte_s, f"no first byte in {first_byte_s:g} s"):
            response = await http.post(self.url, data=payload, headers=headers)
        if stream and 200 <= response.status < 300:
            return Reply(response.status, b"", response.headers, events=response)
        async with response, cut_at(now + config.timeout_s, f"reply not whole in {config.timeout_s:g} s"):
            return Reply(response.status, await read_capped(response, self.max_reply_bytes), response.headers)

    async def lines(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """A stream's lines as they arrive, cut when none comes for `idle_timeout_s`;
        `ReplyRefused` for a line over `max_reply_bytes`."""
        idle_s = self.config.idle_timeout_s
        while True:
            async with cut_at(asyncio.get_running_loop().time() + idle_s, f"no byte in {idle_s:g} s"):
                try:
                    line = await response.content.readline(max_line_length=self.max_reply_bytes)
                except LineTooLong:
                    raise over_cap(self.max_reply_bytes) from None
            if not line:
                return
            yield line

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.close()

    def redact(self, body: bytes) -> bytes:
        """`body` without the API key (providers echo a rejected key in their error text)."""
        if self._key is None:
            return body
        return body.replace(self._key.get_secret_value().encode(), b"[redacted]")


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The upstream's requested pause: `retry-after-ms` when given, else `retry-after` seconds."""
    for name, per_second in (("retry-after-ms", 1000), ("retry-after", 1)):
        value = _number(headers.get(name))
        if value is not None and value >= 0:
            return value / per_second
    return None


def remaining(headers: Mapping[str, str], limit: str) -> float | None:
    """`x-ratelimit-remaining-tokens` or `-requests` (`limit`), when the upstream sends it."""
    return _number(headers.get(f"x-ratelimit-remaining-{limit}"))


def reset_s(headers: Mapping[str, str], limit: str) -> float | None:
    """`x-ratelimit-reset-tokens` or `-requests` in seconds, when sent (`1s`, `6m0s`, `20ms`, `0.5`)."""
    return parse_duration(headers.get(f"x-ratelimit-reset-{limit}"))


DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_duration(text: str | None) -> float | None:
    """OpenAI's duration format (`1h2m3.5s`, `20ms`), or plain seconds; None when unreadable."""
    if text is None:
        return None
    text = text.strip()
    plain = _number(text)
    if plain is not None:
        return plain if plain >= 0 else None
    parts = DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * UNIT_S[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    """Seconds in OpenAI's format: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{rest:.3g}s"


def weighted_order(upstreams: list[Upstream], rng: random.Random) -> list[Upstream]:
    """Upstreams in a random order where each comes first with probability weight / total
    (Efraimidis-Spirakis keys)."""
    return sorted(upstreams, key=lambda u: rng.random() ** (1.0 / u.config.weight), reverse=True)


def _number(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None
