"""A rollout server that moves to a job with another model shuts its engine down and
starts a new one; in between, its heartbeat must not see the shut-down engine (whose vLLM
client is gone) and die of it. Found by bench/async_speedup.py: the warm-start job's
engine was shut down and the heartbeat raised AttributeError on its `dead` property."""

import asyncio

from rollout import server as server_module
from rollout.server import RolloutServer
from services.config import ModelSpec, RolloutSettings, parse_job_spec


class ShutDownEngine:
    """Records what the server holds while it shuts down (vLLM's engine has no cheap double:
    what is checked is only the order of the server's two steps)."""

    def __init__(self, server: RolloutServer) -> None:
        self.server = server
        self.model = ModelSpec(path="/models/first")
        self.held_during_shutdown = "not shut down"

    def shutdown(self) -> None:
        self.held_during_shutdown = self.server.engine


class StartedEngine:
    """A new engine: asked for its devices before the server takes it."""

    devices: list[str] = []

    async def identify_devices(self) -> None:
        self.devices = ["cpu"]


def test_the_old_engine_is_let_go_before_it_shuts_down(monkeypatch) -> None:
    server = RolloutServer(RolloutSettings(redis_url="redis://127.0.0.1:1/0"))
    old = ShutDownEngine(server)
    server.engine = old
    started = StartedEngine()
    monkeypatch.setattr(server_module.Engine, "start", staticmethod(lambda *args: started))
    spec = parse_job_spec({"name": "second", "model": {"path": "/models/second"}})
    asyncio.run(server.prepare_engine(spec))
    assert old.held_during_shutdown is None
    assert server.engine is started and started.devices == ["cpu"]
