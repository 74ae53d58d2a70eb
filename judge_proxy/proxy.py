"""The judge proxy's parts, put together for one process: the LLM gateway
(`judge_proxy.gateway`: admission, budgets, retries, streaming), the judge on top of it
(`judge_proxy.judge`: rubrics, verdicts, group verdicts), and the memory both remember
replies in (`judge_proxy.memory`). The judge reaches the gateway only through `JudgeLLM`:
whether a model is structured, and one settled question."""

from __future__ import annotations

import redis.asyncio as aioredis

from judge_proxy.budget import LEASE_MARGIN_S
from judge_proxy.gateway import Gateway
from judge_proxy.judge import Judge
from judge_proxy.memory import Memory, Slot
from judge_proxy.upstream import UpstreamConfig, load_upstreams
from services.config import JudgeProxySettings
from services.queues import connect

REDIS_CONNECTIONS = 64
"""Redis connections per replica; requests beyond that wait for one (budget scripts are short)."""
REDIS_CONNECTION_WAIT_S = 10.0
"""Longest wait for a free Redis connection before the request fails with a 503."""


class Proxy:
    def __init__(self, settings: JudgeProxySettings, configs: list[UpstreamConfig], redis: aioredis.Redis) -> None:
        self.redis = redis
        self.gateway = Gateway(settings, configs, redis)
        self.memory = Memory(
            redis,
            settings.cache_ttl_s,
            settings.idempotency_ttl_s,
            pending_ttl_s=settings.queue_deadline_s + self.gateway.longest_call_s + LEASE_MARGIN_S,
        )
        self.judge = Judge(self.gateway, self.memory)

    @classmethod
    def from_settings(cls, settings: JudgeProxySettings) -> Proxy:
        # A blocking pool: a burst of requests waits for a free Redis connection instead of
        # failing with "Too many connections" (500s to clients) once all are in use.
        return cls(
            settings,
            load_upstreams(settings.upstreams),
            connect(settings.redis_url, REDIS_CONNECTIONS, REDIS_CONNECTION_WAIT_S, outage_s=settings.redis_outage_s),
        )

    def chat_memory_key(self, body: dict, job: str, idempotency_key: str | None) -> Slot | None:
        """Where a chat reply is remembered: a temperature-0 request by its content, any
        other by its idempotency key; a stream is never remembered."""
        if body.get("stream"):
            return None
        if body.get("temperature") == 0 and body.get("n", 1) == 1:
            return self.memory.key("cache", job, body)
        return self.memory.replay(job, idempotency_key, body)

    async def aclose(self) -> None:
        await self.gateway.aclose()
        await self.redis.aclose()
