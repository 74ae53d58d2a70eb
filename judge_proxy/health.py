"""Every upstream's health as one replica sees it: the circuits (`circuit.py`) of the model
groups it serves, kept current with what every replica records, on the gauges, in
`/healthz` and `GET /v1/upstreams`. A model is down when every one of its upstreams is."""

from __future__ import annotations

import asyncio
import contextlib
import functools

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from judge_proxy import metrics
from judge_proxy.admission import Group
from judge_proxy.budget import LEASE_MARGIN_S
from judge_proxy.circuit import Circuit, CircuitSettings, register
from judge_proxy.upstream import UpstreamConfig
from services.config import JudgeProxySettings
from services.upstream_health import Outage, UpstreamHealth, outage_of, read

HEALTH_SAMPLE_S = 2.0
"""How often this replica reads every upstream's circuit (what other replicas recorded)."""


class Health:
    def __init__(self, redis: aioredis.Redis, settings: JudgeProxySettings, groups: dict[str, Group]) -> None:
        self.redis = redis
        self.settings = settings
        self.groups = groups
        """The gateway's model groups (filled after this is made)."""

    def circuit(self, config: UpstreamConfig) -> Circuit:
        """The circuit of a new upstream; a state change it sees updates its model's gauge."""
        settings = self.settings
        circuit_settings = CircuitSettings(
            settings.circuit_failures,
            settings.rate_limit_outage_s,
            settings.circuit_open_s,
            probe_lease_s=config.quiet_bound_s + LEASE_MARGIN_S,
        )
        note = functools.partial(self.note, config.model)
        return Circuit(self.redis, config.name, config.model, circuit_settings, on_change=note)

    @property
    def index(self) -> dict[str, str]:
        """Upstream name -> model."""
        return {u.name: model for model, group in self.groups.items() for u in group.upstreams}

    async def watch(self, every_s: float = HEALTH_SAMPLE_S) -> None:
        """Keep this proxy's upstreams in the shared index, and each circuit as this replica
        sees it current with what every replica recorded, calls or none."""
        while True:
            with contextlib.suppress(RedisError):
                await register(self.redis, self.index)  # again each time: Redis may have lost it
                await self.read()
            await asyncio.sleep(every_s)

    async def read(self) -> tuple[list[UpstreamHealth], float]:
        """Every upstream's circuit as recorded in Redis (noted as seen), and Redis's clock."""
        healths = await read(self.redis, self.index)
        seconds, micros = await self.redis.time()
        circuits = {u.name: u.circuit for group in self.groups.values() for u in group.upstreams}
        for health in healths:
            circuits[health.name].note(health)
        return healths, seconds + micros / 1e6

    def note(self, model: str) -> None:
        metrics.MODEL_AVAILABLE.labels(model).set(self.outage(model) is None)

    def outage(self, model: str) -> Outage | None:
        """The model's outage as this replica last saw its upstreams' circuits."""
        return outage_of(model, (u.circuit.seen for u in self.groups[model].upstreams))

    def report(self) -> tuple[bool, dict]:
        """For `/healthz`: live whatever the upstreams do (restarting the proxy mends no
        provider), but `degraded`, with the reasons, while every upstream of some model is down."""
        degraded = [o.reason for o in map(self.outage, sorted(self.groups)) if o is not None]
        return True, {
            "status": "degraded" if degraded else "ok",
            "degraded": degraded,
            "models": sorted(self.groups),
            "upstreams": list(self.index),
        }
