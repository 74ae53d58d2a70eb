"""Judge upstreams' health as the judge proxies record it in Redis, for any process to read.

Every judge proxy replica keeps each upstream's circuit in one shared hash
(`judge_proxy/circuit.py` writes it, on Redis's clock). This module owns the record's
fields and the words an outage is reported in: the proxy's 503 carries them, a rollout
server's waiting judge call reports them in its heartbeat, and the learner pauses the job
with them. It imports nothing of the proxy, so any process can read the record.

Hash `tandem:judge:upstream:{name}` (absent: never failed, closed):
- `model`: the model name clients ask for;
- `state`: `closed` (calls flow), `open` (no call is sent) or `half_open` (one probe call is
  out to see whether the upstream is back);
- `failures`: consecutive failed calls (connection errors, timeouts, 5xx, 401/403, a 2xx that
  is not JSON) since the last success; 429s do not count here;
- `since`: epoch seconds the current failure streak (or outage) began, 0 when there is none;
- `limited_since`: epoch seconds the current run of nothing but 429s began, 0 when none;
- `opened_at`: epoch seconds the circuit last opened;
- `reason`: the newest failure (`connect_error ClientConnectorError`, `timeout (no first byte
  in 20 s)`, `HTTP 503`, `reply is not JSON`, `429 for 64 s`);
- `probe_until`: open, when the next probe may go; half-open, when the probe out lapses
  (another may then go);
- `updated`: epoch seconds of the last write.
Hash `tandem:judge:upstreams`: upstream name -> model, for every upstream a proxy serves.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import redis.asyncio as redis

from services.queues import Keys
from services.redis_values import Value, text_fields

State = Literal["closed", "open", "half_open"]
STATES: tuple[State, ...] = get_args(State)


@dataclass(frozen=True)
class UpstreamHealth:
    name: str
    model: str
    state: State = "closed"
    failures: int = 0
    since: float = 0.0
    limited_since: float = 0.0
    opened_at: float = 0.0
    reason: str = ""
    probe_until: float = 0.0
    updated: float = 0.0

    @property
    def down(self) -> bool:
        """Open, or half-open with its probe not yet back: no call gets through now."""
        return self.state != "closed"

    def next_probe_s(self, now: float) -> float:
        """Seconds until a call may go to it again (0: closed, or a probe is due)."""
        return max(0.0, self.probe_until - now) if self.down else 0.0

    def describe(self) -> str:
        """`stand-in: connect_error ClientConnectorError since 2026-11-26T09:01:02Z (7 failures)`."""
        failures = f" ({self.failures} failures)" if self.failures else ""
        return f"{self.name}: {self.reason} since {iso(self.since)}{failures}"

    @classmethod
    def from_hash(cls, name: str, model: str, record: Mapping[Value, Value]) -> UpstreamHealth:
        """The upstream's health from its hash; ValueError for a state no proxy writes."""
        fields = text_fields(record)
        state = fields.get("state", "closed")
        if state not in STATES:
            raise ValueError(f"upstream {name!r}: unknown circuit state {state!r}")
        return cls(
            name=name,
            model=fields.get("model", model),
            state=state,
            failures=int(fields.get("failures", 0)),
            since=float(fields.get("since", 0)),
            limited_since=float(fields.get("limited_since", 0)),
            opened_at=float(fields.get("opened_at", 0)),
            reason=fields.get("reason", ""),
            probe_until=float(fields.get("probe_until", 0)),
            updated=float(fields.get("updated", 0)),
        )


@dataclass(frozen=True)
class Outage:
    model: str
    since: float
    """Epoch seconds the outage began (the earliest `since` of its upstreams)."""
    reason: str
    """`every upstream of model 'judge' is down: stand-in: connect_error ... (7 failures)`."""


def iso(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))


def outage_of(model: str, healths: Iterable[UpstreamHealth]) -> Outage | None:
    """The model's outage when every one of its upstreams (`healths`) is down, else None."""
    healths = list(healths)
    if not healths or not all(h.down for h in healths):
        return None
    reasons = "; ".join(h.describe() for h in healths)
    return Outage(model, min(h.since for h in healths), f"every upstream of model {model!r} is down: {reasons}")


async def read(client: redis.Redis, index: dict[str, str]) -> list[UpstreamHealth]:
    """The health of each upstream in `index` (name -> model), in its order."""
    async with client.pipeline(transaction=False) as pipe:
        for name in index:
            pipe.hgetall(Keys.upstream_health(name))
        records = await pipe.execute()
    return [UpstreamHealth.from_hash(name, model, r) for (name, model), r in zip(index.items(), records)]
