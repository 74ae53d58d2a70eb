"""A rollout server whose vLLM engine is wedged (alive, not errored, producing nothing)
says so on `/healthz` at half of `engine_stall_s`, and past it exits with status 1 instead
of holding its tasks forever with heartbeats; its tasks are taken up elsewhere and the job
trains each of them once. A stopped (SIGSTOP) engine-core process is the wedge."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import httpx
import psutil
import pytest
from helpers import engine_of, job_ended, wait_for

from rollout.engine import RESUME_WAIT_S
from rollout.engine_slot import EngineWedged, check_engine
from rollout.server import RolloutServer
from services.config import RolloutSettings
from tandem.launcher import Ports, Stack, kill_all, process_tree

STALL_S = 8.0
HEARTBEAT_S = 2.0
WEIGHT_TIMEOUT_S = 20.0
WEIGHT_UPDATE_BOUND_S = WEIGHT_TIMEOUT_S * (1 + 2)
"""Weights.update's deadline for the tiny model's one bucket."""
VLLM_SHUTDOWN_S = 5.0
"""vLLM's grace for its stopped engine core before SIGKILL, as the server exits."""
EXIT_BOUND_S = WEIGHT_UPDATE_BOUND_S + RESUME_WAIT_S + STALL_S + HEARTBEAT_S + VLLM_SHUTDOWN_S + 30.0
"""SIGSTOP to exit, the longest way: the wedge catches a weight update in its collective
call, and its requests (abort mode) go back into vLLM only after the update's deadline and
the resume's wait; then they stall `STALL_S`, a heartbeat sees it, vLLM shuts down. 30 s
for a server and a learner sharing two cores."""


@contextlib.contextmanager
def stopped(processes: list[psutil.Process]):
    """`processes` stopped (SIGSTOP) for the block; continued after it."""
    for process in processes:
        process.suspend()
    try:
        yield
    finally:
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.resume()


def engine_cores() -> list[psutil.Process]:
    """The session engine's engine-core process (vLLM runs it as a child, titled so)."""
    return [child for child in psutil.Process().children() if "EngineCore" in " ".join(child.cmdline())]


@pytest.mark.asyncio(loop_scope="session")
async def test_stalled_s_counts_from_submission_while_the_engine_core_is_stopped(engine, tiny_model):
    await engine.reload_from_disk(str(tiny_model))
    server = RolloutServer(RolloutSettings(engine_stall_s=2.0))
    server.slot.engine = engine
    assert engine.stalled_s() == 0.0 and server.health()[1]["status"] == "ok"  # idle

    with stopped(engine_cores()):
        generation = asyncio.create_task(engine.generate([1, 2, 3], 8, 1.0, [], ignore_eos=True))
        await asyncio.sleep(1.2)
        assert 1.2 <= engine.stalled_s() < 2.0
        ok, body = server.health()
        assert ok and body["status"] == "degraded"  # past half of engine_stall_s
        assert re.fullmatch(r"the engine has produced nothing for \d s with 1 requests in flight", body["reason"])
        check_engine(engine, 2.0)

        await asyncio.sleep(1.0)
        assert not server.health()[0]
        with pytest.raises(EngineWedged, match=r"is wedged: it has produced nothing for \d s with 1 requests"):
            check_engine(engine, 2.0)

    assert len((await generation).tokens) == 8
    assert engine.stalled_s() == 0.0 and server.health()[1]["status"] == "ok"


@pytest.mark.asyncio(loop_scope="session")
async def test_an_idle_engine_that_leaves_a_pause_unanswered_counts_as_stalled(engine, tiny_model):
    """With no request in flight only the pause shows the wedge: a server whose engine
    stopped between its tasks, during a weight update, otherwise sat idle forever."""
    await engine.reload_from_disk(str(tiny_model))
    with stopped(engine_cores()):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5), engine._paused("abort"):  # a weight update's deadline cuts it off
                pass
        assert engine.requests == 0 and engine.stalled_s() >= 0.5 + RESUME_WAIT_S
        with pytest.raises(EngineWedged, match=r"with 0 requests in flight, a pause or resume unanswered"):
            check_engine(engine, 2.0)

    deadline = time.monotonic() + 30.0  # the resume sent before, answered once the core runs again
    while engine.unanswered_since is not None:
        assert time.monotonic() < deadline, "the continued engine never answered the resume"
        await asyncio.sleep(0.05)
    assert engine.stalled_s() == 0.0
    assert len((await engine.generate([1, 2, 3], 4, 1.0, [], ignore_eos=True)).tokens) == 4


@pytest.mark.slow
def test_a_server_whose_engine_wedges_exits_and_its_tasks_train_elsewhere(tmp_path, tiny_model):
    env = {
        "TANDEM_ENGINE_STALL_S": str(STALL_S),
        "TANDEM_HEARTBEAT_S": str(HEARTBEAT_S),
        "TANDEM_TASK_RECLAIM_IDLE_S": "2",
        "TANDEM_WEIGHT_TIMEOUT_S": str(WEIGHT_TIMEOUT_S),
        "TANDEM_SERVER_TIMEOUT_S": "5",
        "TANDEM_RUNS_DIR": str(tmp_path / "runs"),
        "TANDEM_MIN_ROLLOUT_SERVERS": "2",
    }
    spec = {
        "name": "engine-wedge",
        "model": {"path": str(tiny_model), "max_model_len": 512},
        "task": {"name": "clarify", "num_examples": 64},
        "rollout": {"group_size": 4, "max_new_tokens": 12, "max_turns": 2, "max_total_tokens": 128},
        "train": {"num_steps": 8, "batch_size": 4, "max_staleness": 3, "lr": 1e-4},
    }
    with Stack(tmp_path / "logs", ports=Ports.free(rollout_servers=2), extra_env=env) as stack:
        api = httpx.Client(base_url=stack.api_url, timeout=10)
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        engine = wait_for(
            lambda: engine_of(stack, api, job_id, "rollout-1"),
            180,
            "rollout-1 to serve the job with its engine",
            interval_s=0.5,
        )
        victim = stack.processes.pop("rollout-1")
        try:
            with stopped(engine):
                wedged_at = time.monotonic()
                status = victim.wait(timeout=EXIT_BOUND_S)
                exit_s = time.monotonic() - wedged_at
        finally:
            kill_all(engine + process_tree(victim.pid))
        final = job_ended(api, job_id)
        stack.check_alive()
        history = api.get(f"/v1/jobs/{job_id}/history").json()

    log = (tmp_path / "logs" / "rollout-1.log").read_text()
    print(f"rollout-1 exited {exit_s:.1f} s after its engine core was stopped")
    assert status == 1, log[-2000:]
    assert "is wedged: it has produced nothing for" in log
    assert "exiting so that a new server takes its place" in log
    assert final["status"] == "SUCCEEDED", final.get("error")
    trained = [task_id for record in history if record["phase"] == "rl" for task_id in record["task_ids"]]
    assert len(trained) == len(set(trained)) == 8 * 4
