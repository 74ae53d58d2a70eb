"""A rollout server's engine across the jobs it serves: started for a job's model, or
reloaded in place when the next job has the same model; watched for death and stalls (a
server whose engine is gone must exit, or its heartbeats would keep its held tasks from
being reclaimed forever); its busy time counted under the job being served."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter, Gauge

from rollout.engine import Engine
from services.config import JobSpec, RolloutSettings
from services.stats import TrailingRate

ENGINE_BUSY = Counter(
    "tandem_rollout_engine_busy_seconds_total", "Seconds the engine had at least one request generating", ["job"]
)
ENGINE_BUSY_RATIO = Gauge(
    "tandem_rollout_engine_busy_ratio", "Share of the last minute the engine had a request generating", ["job"]
)


class EngineDied(Exception):
    """The server's vLLM engine is gone; the server cannot serve again in this process."""


class EngineWedged(EngineDied):
    """The server's vLLM engine is alive but has produced nothing for `engine_stall_s` with
    requests in flight; nothing in this process brings it back."""


def check_engine(engine: Engine, stall_s: float) -> None:
    """EngineDied when the engine died, EngineWedged when it stalled past `stall_s`."""
    if engine.dead:
        raise EngineDied(f"the inference engine of {engine.model.path} died")
    if engine.stalled_s() > stall_s:
        raise EngineWedged(
            f"the inference engine of {engine.model.path} is wedged: it has {stall_reason(engine)} "
            f"(engine_stall_s {stall_s:g} s)"
        )


def stall_reason(engine: Engine) -> str:
    unanswered = ", a pause or resume unanswered" if engine.unanswered_since is not None else ""
    return f"produced nothing for {engine.stalled_s():.0f} s with {engine.requests} requests in flight{unanswered}"


class EngineSlot:
    """The one engine of a rollout server (None before its first job)."""

    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.engine: Engine | None = None
        self.counted_s = 0.0
        """The engine's busy seconds already counted under the current job."""
        self.busy_rate = TrailingRate(window_s=60.0)

    async def load(self, spec: JobSpec) -> Engine:
        """The engine with the job's model: the loaded one reloaded from its folder when the
        model is the same, else a new one (the old one let go before it shuts down, so the
        heartbeat never sees a shut-down engine as dead)."""
        if self.engine and self.engine.model == spec.model:
            await self.engine.reload_from_disk(spec.model.path)
            return self.engine
        if self.engine:
            engine, self.engine = self.engine, None
            engine.shutdown()
        engine = await asyncio.to_thread(
            Engine.start, spec.model, self.settings.kv_cache_gib, spec.train.seed, self.settings.memory_utilization
        )
        try:
            await engine.identify_devices()
        except BaseException:
            engine.shutdown()
            raise
        self.engine = engine
        return engine

    def count_from_now(self) -> None:
        """Busy time counts from here, under the job about to be served (the engine may be new,
        and is loaded: `load` came first)."""
        if self.engine is None:
            raise RuntimeError("busy time counts on a loaded engine: load the job's first")
        self.counted_s, self.busy_rate = self.engine.busy.busy_s(), TrailingRate(window_s=60.0)

    def export_busy(self, job_id: str) -> None:
        """The engine's busy seconds since the last export, and its busy share of the last
        minute, under `job_id`."""
        if self.engine is None or not job_id:
            return
        busy_s = self.engine.busy.busy_s()
        ENGINE_BUSY.labels(job_id).inc(busy_s - self.counted_s)
        ENGINE_BUSY_RATIO.labels(job_id).set(self.busy_rate.add(time.monotonic(), busy_s))
        self.counted_s = busy_s

    def check(self) -> None:
        """EngineDied or EngineWedged once the engine is gone or stalled past `engine_stall_s`."""
        if self.engine is not None:
            check_engine(self.engine, self.settings.engine_stall_s)

    def condition(self) -> tuple[bool, dict]:
        """Not ok once the engine died or is wedged; degraded, with why, once it has produced
        nothing for half of `engine_stall_s`. With its version, for `/healthz`."""
        engine, stall_s = self.engine, self.settings.engine_stall_s
        stalled_s = engine.stalled_s() if engine else 0.0
        condition = {"status": "ok"}
        if engine is not None and stalled_s > stall_s / 2:
            condition = {"status": "degraded", "reason": f"the engine has {stall_reason(engine)}"}
        ok = (engine is None or not engine.dead) and stalled_s <= stall_s
        return ok, {"version": engine.version if engine else -1, **condition}

    def shutdown(self) -> None:
        if self.engine:
            self.engine.shutdown()
