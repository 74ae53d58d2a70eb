"""A rollout server that moves to a job with another model shuts its engine down and
starts a new one; in between, its heartbeat must not see the shut-down engine (whose vLLM
client is gone) and die of it: the engine slot lets the old engine go before it shuts down."""

import asyncio

from rollout import engine_slot
from rollout.engine_slot import EngineSlot
from services.config import ModelSpec, RolloutSettings, parse_job_spec


class ShutDownEngine:
    """Records what the server holds while it shuts down (vLLM's engine has no cheap double:
    what is checked is only the order of the server's two steps)."""

    def __init__(self, slot: EngineSlot) -> None:
        self.slot = slot
        self.model = ModelSpec(path="/models/first")
        self.held_during_shutdown = "not shut down"

    def shutdown(self) -> None:
        self.held_during_shutdown = self.slot.engine


class StartedEngine:
    """A new engine: asked for its devices before the server takes it."""

    devices: list[str] = []

    async def identify_devices(self) -> None:
        self.devices = ["cpu"]


def test_the_old_engine_is_let_go_before_it_shuts_down(monkeypatch) -> None:
    slot = EngineSlot(RolloutSettings(redis_url="redis://127.0.0.1:1/0"))
    old = ShutDownEngine(slot)
    slot.engine = old
    started = StartedEngine()
    monkeypatch.setattr(engine_slot.Engine, "start", staticmethod(lambda *args: started))
    spec = parse_job_spec({"name": "second", "model": {"path": "/models/second"}})
    assert asyncio.run(slot.load(spec)) is started
    assert old.held_during_shutdown is None
    assert slot.engine is started and started.devices == ["cpu"]
