"""A rollout server whose vLLM engine dies (a crash, the OOM killer) exits with status 1
instead of holding its tasks forever with heartbeats; its tasks are taken up elsewhere and
the job trains each of them once. (Under compose the restart policy then starts a new
server: tests/compose.)"""

from __future__ import annotations

import httpx
import pytest
from helpers import engine_of, job_ended, wait_for

from tandem.launcher import Ports, Stack, kill_all

pytestmark = pytest.mark.slow


def test_a_server_whose_engine_dies_exits_and_its_tasks_train_elsewhere(tmp_path, tiny_model):
    env = {
        "TANDEM_TASK_RECLAIM_IDLE_S": "2",
        "TANDEM_WEIGHT_TIMEOUT_S": "20",
        "TANDEM_SERVER_TIMEOUT_S": "5",
        "TANDEM_RUNS_DIR": str(tmp_path / "runs"),
        "TANDEM_MIN_ROLLOUT_SERVERS": "2",
    }
    spec = {
        "name": "engine-death",
        "model": {"path": str(tiny_model), "max_model_len": 512},
        "task": {"name": "clarify", "num_examples": 64},
        "rollout": {"group_size": 4, "max_new_tokens": 12, "max_turns": 2, "max_total_tokens": 128},
        "train": {"num_steps": 8, "batch_size": 4, "max_staleness": 3, "lr": 1e-4},
    }
    with Stack(tmp_path / "logs", ports=Ports.free(rollout_servers=2), extra_env=env) as stack:
        api = httpx.Client(base_url=stack.api_url, timeout=10)
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        # The learner waits for both servers, so rollout-1 has joined and taken tasks.
        engine = wait_for(
            lambda: engine_of(stack, api, job_id, "rollout-1"),
            180,
            "rollout-1 to serve the job with its engine",
            interval_s=0.5,
        )
        victim = stack.processes.pop("rollout-1")
        kill_all(engine)
        status = victim.wait(timeout=60)
        final = job_ended(api, job_id)
        stack.check_alive()
        history = api.get(f"/v1/jobs/{job_id}/history").json()

    log = (tmp_path / "logs" / "rollout-1.log").read_text()
    assert status == 1, log[-2000:]
    assert "died; exiting so that a new server takes its place" in log
    assert final["status"] == "SUCCEEDED", final.get("error")
    trained = [task_id for record in history if record["phase"] == "rl" for task_id in record["task_ids"]]
    assert len(trained) == len(set(trained)) == 8 * 4
