"""Each upstream's circuit, shared by every replica: an upstream that keeps failing is left
alone, one probe at a time finds out when it is back, and a model whose every upstream is
down is refused at once (503 `upstream_unavailable`) rather than after a minute of failures.

The record is a Redis hash per upstream (fields in `services.upstream_health`, which other
processes read), changed only by the Lua scripts below on Redis's clock, so replicas agree:
- a success closes the circuit and ends the failure streak;
- a failure (connection error, timeout, 5xx, 401/403, a 2xx that is not JSON) adds to the
  streak, and `circuit_failures` in a row open the circuit;
- a 429 neither ends the streak nor counts in it: a burst of them is the provider's pacing.
  A run of nothing but 429s that has lasted `rate_limit_outage_s` (an exhausted quota)
  opens the circuit;
- while open, no call goes; `circuit_open_s` after it opened, one call from any replica
  takes the probe (the record's `probe_until` is the lease: it lapses if the probe's
  replica dies) and goes through half-open. Its success closes the circuit, its failure
  opens it again for `circuit_open_s`; `since` keeps when the outage began.
Calls that were out when the circuit opened still count when they end, but only the probe
reopens it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from judge_proxy import metrics
from judge_proxy.scripts import lua
from services.queues import Keys
from services.upstream_health import UpstreamHealth

STATE_GAUGE = {"closed": 0, "half_open": 1, "open": 2}
"""`tandem_judge_upstream_state`'s value for each state."""

_GATE = lua("now", "circuit_gate")
_RELEASE = lua("now", "circuit_release")
_RECORD = lua("now", "circuit_record")
_REGISTER = lua("circuit_register")
"""The circuit's scripts (`judge_proxy/lua/circuit_*.lua`, each saying its keys and arguments)."""


@dataclass(frozen=True)
class CircuitSettings:
    failures: int
    """Consecutive failures that open the circuit."""
    rate_limit_outage_s: float
    """A run of nothing but 429s this long opens it."""
    open_s: float
    """How long it stays open before a probe."""
    probe_lease_s: float
    """How long a probe holds its lease: longer than its call can take."""


@dataclass(frozen=True)
class Gate:
    verdict: Literal["go", "probe", "wait"]
    health: UpstreamHealth
    now: float
    """Redis's clock when read."""


class Circuit:
    """One upstream's circuit, as one replica reaches it (the record is shared in Redis).
    `seen` is the record as last read or written here; `on_change` is called when its
    state differs from the one seen before."""

    def __init__(
        self, client: aioredis.Redis, name: str, model: str, settings: CircuitSettings, on_change: Callable[[], None]
    ) -> None:
        self.name, self.model, self.settings, self.on_change = name, model, settings, on_change
        self.key = Keys.upstream_health(name)
        self.seen = UpstreamHealth(name, model)
        self._gate, self._release, self._record = (client.register_script(s) for s in (_GATE, _RELEASE, _RECORD))
        metrics.UPSTREAM_STATE.labels(name).set(0)

    async def gate(self) -> Gate:
        """Whether a call may go now: `go` (closed), `probe` (this call is the probe) or `wait`."""
        verdict, now, fields = await self._gate([self.key], [self.settings.probe_lease_s])
        return Gate(verdict.decode(), self.note(self.parse(fields)), float(now))

    async def release_probe(self) -> None:
        """The probe this replica took will not go (no budget): let the next call take it."""
        await self._release([self.key])

    async def succeeded(self) -> None:
        """A success closes the circuit and ends a streak; with neither to end as this call's
        gate read the record, there is nothing to write (no round trip on a healthy call)."""
        if self.seen.state == "closed" and self.seen.since == 0:
            return
        await self.record("ok", "", probe=False)

    async def failed(self, reason: str, *, probe: bool) -> None:
        await self.record("failure", reason, probe=probe)

    async def rate_limited(self, *, probe: bool) -> None:
        await self.record("rate_limited", "", probe=probe)

    async def record(self, kind: str, reason: str, *, probe: bool) -> None:
        s = self.settings
        fields = await self._record(
            [self.key],
            [self.model, kind, reason, int(probe), s.failures, s.rate_limit_outage_s, s.open_s],
        )
        self.note(self.parse(fields))

    def parse(self, fields: list[bytes]) -> UpstreamHealth:
        """The record from a script's flat HGETALL (empty: never failed)."""
        return UpstreamHealth.from_hash(self.name, self.model, dict(zip(fields[::2], fields[1::2])))

    def note(self, health: UpstreamHealth) -> UpstreamHealth:
        """Keep `health` as seen; a state new to this replica goes on the gauge and is told
        to `on_change`."""
        changed = health.state != self.seen.state
        self.seen = health
        if changed:
            metrics.UPSTREAM_STATE.labels(self.name).set(STATE_GAUGE[health.state])
            self.on_change()
        return health


async def register(client: aioredis.Redis, upstreams: dict[str, str]) -> None:
    """Write the index (upstream name -> model) for the upstreams this proxy serves."""
    if upstreams:
        await client.eval(_REGISTER, 1, Keys.upstream_index, *(x for pair in upstreams.items() for x in pair))
