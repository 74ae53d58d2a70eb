"""The whole system as separate processes: a rollout server dies mid-task, bad messages
arrive on both streams, and the job still trains every task exactly once."""

from __future__ import annotations

import httpx
import msgspec
import pytest
import redis
from helpers import wait_for

from learner import group_log
from services import protocol
from services.queues import FIELD, Keys
from tandem.launcher import Ports, Stack, kill_all, process_tree

pytestmark = pytest.mark.slow


def job_spec(model: str) -> dict:
    return {
        "name": "faults",
        "model": {"path": model, "max_model_len": 512},
        "task": {"name": "clarify", "num_examples": 64},
        "rollout": {"group_size": 4, "max_new_tokens": 12, "max_turns": 2, "max_total_tokens": 128},
        # A server that missed an update lags a version or two; a bound of 3 keeps its
        # (reclaimed) groups trainable, so "trained exactly once" is deterministic.
        "train": {"num_steps": 8, "batch_size": 4, "max_staleness": 3, "lr": 1e-4},
    }


OUT_OF_RANGE_TASK = 10_000
"""Task id (and example) of the injected task no task set has: dead-lettered, never trained."""


def inject_bad_messages(client: redis.Redis, job_id: str) -> None:
    client.xadd(Keys.tasks(job_id), {FIELD: b"\xc1 not msgpack"})
    client.xadd(Keys.tasks(job_id), {b"unexpected": b"field"})
    out_of_range = protocol.Task(
        job_id=job_id, task_id=OUT_OF_RANGE_TASK, example=OUT_OF_RANGE_TASK, group_size=4, dispatched_version=0
    )
    client.xadd(Keys.tasks(job_id), {FIELD: protocol.encode(out_of_range)})
    client.xadd(Keys.trajectories(job_id), {FIELD: protocol.encode(out_of_range)})  # wrong type here


def test_killed_rollout_server_loses_nothing_and_bad_input_takes_nothing_down(tmp_path, tiny_model):
    env = {
        "TANDEM_TASK_RECLAIM_IDLE_S": "2",
        "TANDEM_WEIGHT_TIMEOUT_S": "20",
        "TANDEM_SERVER_TIMEOUT_S": "5",
        "TANDEM_RUNS_DIR": str(tmp_path / "runs"),
        "TANDEM_MAX_CONCURRENT_TASKS": "2",
        "TANDEM_MIN_ROLLOUT_SERVERS": "2",
    }  # both servers take tasks from the start
    with Stack(tmp_path / "logs", ports=Ports.free(rollout_servers=2), extra_env=env) as stack:
        api = httpx.Client(base_url=stack.api_url, timeout=10)
        client = redis.Redis.from_url(stack.redis_url)
        broken = api.post("/v1/jobs", json=job_spec("/no/such/model")).json()["id"]
        failed = wait_for(
            lambda: (r := api.get(f"/v1/jobs/{broken}").json())["status"] == "FAILED" and r,
            120,
            "the job without a model to fail",
            interval_s=0.5,
        )
        stack.check_alive()  # a job that cannot run takes no process down
        job_id = api.post("/v1/jobs", json=job_spec(str(tiny_model))).json()["id"]
        wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] == "RUNNING", 60, "the job to start")
        inject_bad_messages(client, job_id)

        def tasks_on_victim() -> set[int]:
            """Dispatched tasks rollout-1 holds; the injected out-of-range task, which it can
            hold for the instant before dead-lettering it, is not one of them."""
            try:
                entries = client.xpending_range(Keys.tasks(job_id), "rollout", "-", "+", 100, consumername="rollout-1")
            except redis.ResponseError:  # NOGROUP: the servers are still starting their engines
                return set()
            held = set()
            for entry in entries:
                for _, fields in client.xrange(Keys.tasks(job_id), entry["message_id"], entry["message_id"]):
                    try:
                        task_id = protocol.decode(fields[FIELD], protocol.Task).task_id
                    except (KeyError, ValueError, msgspec.DecodeError):  # the injected malformed ones
                        continue
                    if task_id != OUT_OF_RANGE_TASK:
                        held.add(task_id)
            return held

        killed_tasks = wait_for(tasks_on_victim, 120, "rollout-1 to hold a task")
        kill_all(process_tree(stack.processes.pop("rollout-1").pid))  # the server and its engine

        final = wait_for(
            lambda: (r := api.get(f"/v1/jobs/{job_id}").json())["status"] in ("SUCCEEDED", "FAILED", "CANCELLED") and r,
            300,
            "the job to end",
            interval_s=0.5,
        )
        stack.check_alive()  # nobody else went down
        history = api.get(f"/v1/jobs/{job_id}/history").json()
        dead = client.xrange(Keys.dead(job_id))

    assert "'/no/such/model' is not a model folder" in failed["error"]
    assert final["status"] == "SUCCEEDED", final.get("error")
    trained = [task_id for record in history if record["phase"] == "rl" for task_id in record["task_ids"]]
    assert len(trained) == len(set(trained)) == 8 * 4
    records = group_log.read(tmp_path / "runs" / job_id / "groups.jsonl")  # one per decision, trained ones too
    assert sorted(r["task_id"] for r in records if r["decision"] == "trained") == sorted(trained)
    assert killed_tasks and killed_tasks <= set(trained)
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert sum("DecodeError" in r or "MsgspecError" in r or "Validation" in r for r in reasons) >= 3, reasons
    assert any("outside the task set" in r for r in reasons), reasons
