"""The LLM gateway: admit a chat request into an upstream's budget (`admission.py`), call
the upstream and settle the budget with what it charged (`calls.py`), and retry where that
helps. It knows nothing of judging: the judge (`judge.py`) asks it questions through
`ask` and `structured`, as any client asks through the chat route.

Admission takes the request's cost first from its job's share of the model group
(`share.py`: jobs share a group's budget by their `judge_weight`, read from the job's record
and kept 10 s per replica; a job id with no record, or no `X-Tandem-Job`, weighs 1), then
from an upstream's budget; when no upstream has room the share gets its tokens back at
once, and a request its share holds back lets other jobs' requests go first (`queue.py`).
Settling charges the share what the upstream charged, like the budget.

One call of `complete` makes at most `max_attempts` upstream calls:
- 2xx: the reply is passed through; once it is sent, `usage.total_tokens` settles the
  reservation (at most what the request could cost, `Budget.billed`), `usage.prompt_tokens`
  teaches the upstream's prompt ratio (`budget.py`) and the reply's
  `x-ratelimit-remaining-*`/`reset-*` clamp the shared budget. A stream (`stream: true`) is
  relayed event by event as it arrives; the proxy asks the upstream for `usage` in its last
  chunk (`stream_options.include_usage`, dropped again when the client did not ask) and
  settles when the stream ends. A stream cut off midway (the upstream's connection or the
  client's) settles all it reserved, and is counted.
- 429: nothing was charged; the upstream is paused for every replica for `retry-after-ms`
  / `retry-after` (else exponential backoff with jitter), at most `max_backoff_s`, and the
  request waits in the queue again (any upstream of the group may take it).
- 5xx, 401/403, a 2xx that is not JSON, a timeout or a connection error: the reservation
  stays charged (the upstream may have counted it), the upstream is avoided by this replica
  for `failure_cooldown_s`, and the request goes to another upstream of the group. A hung
  upstream fails by `first_byte_timeout_s`; a stream fails only when no byte comes for
  `idle_timeout_s`, however long it runs.
- Every outcome goes to the upstream's circuit (`circuit.py`), shared by all replicas: an
  upstream that keeps failing (or answers nothing but 429 for `rate_limit_outage_s`) is sent
  nothing until a probe finds it back, and a model whose every upstream is down is refused
  at once with 503 `upstream_unavailable`, nothing reserved.
- any other 4xx is the client's: passed through, with the API key redacted.
Waiting for budget, over all attempts, ends at `queue_deadline_s` with a 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from judge_proxy import metrics
from judge_proxy.admission import Admission, Attempts, Grant, Group, Need, exhausted
from judge_proxy.budget import LEASE_MARGIN_S, Budget, Limits, Seen
from judge_proxy.calls import Caller, Completion, settle
from judge_proxy.errors import ProxyError
from judge_proxy.health import Health
from judge_proxy.queue import Admitter
from judge_proxy.share import Share, Weights
from judge_proxy.spend import ROLE, JobSpend
from judge_proxy.upstream import Upstream, UpstreamConfig, format_duration
from services.config import JudgeProxySettings
from services.stats import TrailingRate

BUDGET_SAMPLE_S = 5.0
"""How often the budget utilization gauge is brought up to date."""


class Gateway:
    """The model groups this proxy serves, and every request's way through their budgets."""

    def __init__(self, settings: JudgeProxySettings, configs: list[UpstreamConfig], redis: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.groups: dict[str, Group] = {}
        rng = random.Random()
        self.admission = Admission(Weights(redis), rng)
        self.caller = Caller(settings, rng, self.admission)
        self.spend = JobSpend(redis)
        self.health = Health(redis, settings, self.groups)
        self.setup_groups(configs)
        self.longest_call_s = max((c.timeout_s for c in configs), default=60.0) * settings.max_attempts
        """A request's longest time upstream over all its attempts (what a reply kept
        pending for other replicas must outlast, with the queue deadline)."""

    def setup_groups(self, configs: list[UpstreamConfig]) -> None:
        for config in configs:
            limits = Limits(
                config.tpm,
                config.rpm,
                config.max_concurrency,
                config.quiet_bound_s + LEASE_MARGIN_S,
                model=config.limit_model,
                window_s=config.window_s,
                pace_s=config.pace_s,
                prompt_margin=config.prompt_margin,
                prompt_ratio_band=config.prompt_ratio_band,
            )
            budget = Budget(self.redis, config.name, limits)
            upstream = Upstream(config, budget, self.health.circuit(config), self.settings.max_reply_bytes)
            if config.model not in self.groups:
                admitter = Admitter(self.settings.judge_priority_weight, tokens_per_s=0.0, release=self.release)
                share = Share(self.redis, config.model)
                self.groups[config.model] = Group(
                    config.model, [], admitter, share, self.spend, config.structured_output
                )
            group = self.groups[config.model]
            group.upstreams.append(upstream)
            group.admitter.tokens_per_s += config.tpm / 60
            group.share.add_upstream(config)
            metrics.BUDGET_TPM.labels(config.name).set(config.tpm)
            metrics.BUDGET_RPM.labels(config.name).set(config.rpm)
            metrics.MODEL_AVAILABLE.labels(config.model).set(1)

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
        self.admission.check_fits(group, need)
        payload = upstream_body(body, max_tokens)
        deadline = time.monotonic() + self.settings.queue_deadline_s
        attempts = Attempts(job, priority, tag, role=ROLE.get() or priority)
        for attempt in range(self.settings.max_attempts):
            grant = await self.admission.admit(group, need, attempts, deadline, job, priority)
            upstream_payload = msgspec.json.encode(
                {**payload, "model": grant.upstream.config.upstream_model or group.model}
            )
            completion = await self.caller.call(
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
        raise exhausted(group, attempts, priority)

    async def settled(
        self, body: dict, max_tokens: int, n: int, *, job: str, priority: str, tag: str = ""
    ) -> Completion:
        """A whole (not streamed) completion, its budget settled before it returns: for a
        reply to be remembered, and for the judge's questions."""
        completion = await self.complete(body, max_tokens, n, job=job, priority=priority, tag=tag)
        await completion.settle()
        return completion

    async def release(self, grant: Grant) -> None:
        """Give back a grant whose request left the queue before using it."""
        await settle(self.groups[grant.upstream.config.model], grant, 0, None, used_request=False)

    async def limit_headers(self, group: Group) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for the budget a group's upstreams share across
        replicas: limits and what remains summed, resets the longest. What remains is as this
        replica last saw it, at its last reservation (Redis is asked only for an upstream it
        has not seen yet), so the headers cost no extra round trip per request."""
        seen = await asyncio.gather(*(last_seen(u.budget) for u in group.upstreams))
        now = time.monotonic()
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
                    metrics.USAGE_OUTLIERS.labels(upstream.name).set(view.usage_outliers)
            await asyncio.sleep(every_s)

    def structured(self, model: str) -> bool:
        """Whether `model`'s upstreams keep to a JSON schema in `response_format`."""
        return self.group(model).structured

    async def ask(self, body: dict, max_tokens: int, *, job: str, tag: str = "") -> dict:
        """A judge's question: one completion at the judge's priority, settled before it
        returns; the reply's JSON."""
        return (await self.settled(body, max_tokens, 1, job=job, priority="judge", tag=tag)).data

    async def aclose(self) -> None:
        for upstream in self.upstreams:
            await upstream.aclose()


async def last_seen(budget: Budget) -> Seen:
    """What this replica last saw left of `budget`; Redis is read only when it has seen nothing yet."""
    if budget.seen is not None:
        return budget.seen
    return (await budget.view()).left(time.monotonic())


def pin_output_cap(body: dict, max_tokens: int) -> dict:
    """`body` as sent upstream: the reservation holds only if the upstream cannot write more
    than `max_tokens`, so a missing or null cap becomes `max_tokens: max_tokens` (a set
    `max_completion_tokens` is the cap the proxy reserved, and takes precedence upstream)."""
    if body.get("max_completion_tokens") is not None:
        return body
    return {**{k: v for k, v in body.items() if k != "max_completion_tokens"}, "max_tokens": max_tokens}


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
