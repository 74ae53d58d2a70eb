"""The only rollout server of a job killed and started again under the same id, as a
restarted container keeps its hostname (and Tandem's default server id is `hostname-pid`,
which repeats): the job goes on and succeeds.

Before, the learner re-sent weights only to ids its last plan did not name, and the new
process tried to join the old plan's finished broadcast, failed, and waited for a plan that
never came: the job sat RUNNING at its step until `stall_timeout_s` (found by
bench/chaos.py). Plans now carry each member's process start (`started`): the learner
plans a new epoch for a restarted member, and a server ignores a plan made for the process
its id had before.
"""

from __future__ import annotations

import httpx
import pytest
from helpers import job_ended, wait_for

from tandem.launcher import Ports, Stack, kill_all, process_tree

pytestmark = pytest.mark.slow


def test_the_only_server_restarted_under_its_old_id_gets_weights_and_the_job_succeeds(tmp_path, tiny_model):
    env = {
        "TANDEM_TASK_RECLAIM_IDLE_S": "2",
        "TANDEM_WEIGHT_TIMEOUT_S": "20",
        "TANDEM_SERVER_TIMEOUT_S": "5",
        "TANDEM_RUNS_DIR": str(tmp_path / "runs"),
    }
    spec = {
        "name": "restarted",
        "model": {"path": str(tiny_model), "max_model_len": 512},
        "task": {"name": "clarify", "num_examples": 64},
        "rollout": {"group_size": 2, "max_new_tokens": 12, "max_turns": 2, "max_total_tokens": 128},
        "train": {"num_steps": 6, "batch_size": 2, "max_staleness": 1, "lr": 1e-4},
    }
    with Stack(tmp_path / "logs", ports=Ports.free(rollout_servers=1), extra_env=env) as stack:
        api = httpx.Client(base_url=stack.api_url, timeout=10)
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["step"] >= 1, 240, "the first RL step")
        kill_all(process_tree(stack.processes.pop("rollout-0").pid))  # the server and its engine
        # Gone from the job before it is back (and no step since: no server), as a container
        # restarting under its supervisor's back-off is; its last plan still names its id.
        paused = wait_for(lambda: (r := api.get(f"/v1/jobs/{job_id}").json())["status"] == "PAUSED" and r, 60, "PAUSED")
        stack.spawn_rollout(0, stack.ports.rollout[0])  # the same name, so the same server id

        final = job_ended(api, job_id)
        history = api.get(f"/v1/jobs/{job_id}/history").json()
        memberships = api.get(f"/v1/jobs/{job_id}/servers").json()

    assert paused["paused_reason"] == "no rollout server is on the job"
    assert final["status"] == "SUCCEEDED", final.get("error")
    trained = [task_id for record in history if record["phase"] == "rl" for task_id in record["task_ids"]]
    assert len(trained) == len(set(trained)) == 6 * 2
    assert sum("rollout-0" in record["joined"] for record in memberships) == 2  # it joined twice
