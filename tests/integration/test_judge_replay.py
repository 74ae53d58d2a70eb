"""A rollout server killed in the middle of judge-bound episodes: the server that takes its
tasks over replays them from the task journal and the judge proxy's memory, so the provider
(the stand-in, counting each call's idempotency key) answers no call of those episodes
twice, and each of those tasks trains once. The whole system as separate processes."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import httpx
import pytest
import redis
from helpers import stand_in_upstreams, wait_for

from devtools.provider import Latency, LocalUpstreamConfig, create_app, serve_in_thread
from services import protocol
from services.queues import FIELD, Keys
from tandem.demo import write_demonstrations
from tandem.launcher import Ports, Stack, kill_all, process_tree
from tandem.redis_embed import free_port

pytestmark = pytest.mark.slow


def job_spec(model: str, warm_start: Path) -> dict:
    write_demonstrations(warm_start, num=1000, share=0.5)
    return {
        "name": "replay",
        "model": {"path": model, "max_model_len": 512},
        "task": {"name": "clarify", "num_examples": 64, "user": "llm"},
        "rollout": {"group_size": 2, "max_new_tokens": 32, "max_turns": 2, "max_total_tokens": 256},
        "reward": {
            "mode": "multiturn",
            "window": 2,
            "futures": "adaptive",
            "num_futures": 3,
            "min_futures": 2,
            "judge_rubric": "interactivity",
            "judge_weight": 0.5,
            "judge_model": "judge",
            "user_model": "judge",
            "judge_mode": "group",
        },
        "train": {"num_steps": 4, "batch_size": 4, "max_staleness": 3, "lr": 1e-4},
        # Well-formed replies from the start: a malformed response is scored without futures,
        # so an untrained model's tasks would make no calls to replay.
        "warm_start": {"steps": 150, "batch_size": 32, "lr": 3e-3, "data": str(warm_start)},
    }


def held_tasks(client: redis.Redis, job_id: str, consumer: str) -> set[int]:
    try:
        entries = client.xpending_range(Keys.tasks(job_id), "rollout", "-", "+", 100, consumername=consumer)
    except redis.ResponseError:  # NOGROUP: the servers are still starting
        return set()
    held = set()
    for entry in entries:
        for _, fields in client.xrange(Keys.tasks(job_id), entry["message_id"], entry["message_id"]):
            held.add(protocol.decode(fields[FIELD], protocol.Task).task_id)
    return held


def calls_by_task(tags: dict[str, int]) -> dict[int, dict[str, int]]:
    by_task: dict[int, dict[str, int]] = {}
    for tag, count in tags.items():
        if match := re.match(r"task(\d+)/", tag):
            by_task.setdefault(int(match.group(1)), {})[tag] = count
    return by_task


def test_a_killed_servers_episodes_finish_elsewhere_without_a_single_call_sent_twice(tmp_path, tiny_model):
    stand_in = LocalUpstreamConfig(
        tpm=50_000_000,
        rpm=500_000,
        models=["judge"],
        seed=3,
        latency=Latency(median_s=0.3, p99_s=1.0, tokens_per_s=400),
    )
    with contextlib.ExitStack() as stack:
        stand_in_url = stack.enter_context(serve_in_thread(create_app(stand_in), free_port()))
        upstreams = stand_in_upstreams(tmp_path / "upstreams.json", stand_in_url)
        env = {
            "TANDEM_TASK_RECLAIM_IDLE_S": "2",
            "TANDEM_WEIGHT_TIMEOUT_S": "20",
            "TANDEM_SERVER_TIMEOUT_S": "5",
            "TANDEM_RUNS_DIR": str(tmp_path / "runs"),
            "TANDEM_MAX_CONCURRENT_TASKS": "2",
            "TANDEM_MIN_ROLLOUT_SERVERS": "2",
            "TANDEM_UPSTREAMS": str(upstreams),
        }
        system = stack.enter_context(Stack(tmp_path / "logs", ports=Ports.free(rollout_servers=2), extra_env=env))
        api = httpx.Client(base_url=system.api_url, timeout=10)
        client = redis.Redis.from_url(system.redis_url)
        job_id = api.post("/v1/jobs", json=job_spec(str(tiny_model), tmp_path / "warm_start.jsonl")).json()["id"]

        def victim_mid_episode() -> set[int]:
            """Tasks rollout-1 holds that have already paid for calls upstream."""
            called = calls_by_task(httpx.get(f"{stand_in_url}/admin/request-tags").json())
            return {t for t in held_tasks(client, job_id, "rollout-1") if t in called}

        killed = wait_for(victim_mid_episode, 180, "rollout-1 to be in the middle of an episode", interval_s=0.05)
        kill_all(process_tree(system.processes.pop("rollout-1").pid))

        final = wait_for(
            lambda: (r := api.get(f"/v1/jobs/{job_id}").json())["status"] in ("SUCCEEDED", "FAILED", "CANCELLED") and r,
            300,
            "the job to end",
            interval_s=0.5,
        )
        history = api.get(f"/v1/jobs/{job_id}/history").json()
        tags = httpx.get(f"{stand_in_url}/admin/request-tags").json()
        proxy_metrics = httpx.get(f"{system.judge_url}/metrics").text

    assert final["status"] == "SUCCEEDED", final.get("error")
    trained = [task_id for record in history if record["phase"] == "rl" for task_id in record["task_ids"]]
    assert len(trained) == len(set(trained)) == 4 * 4
    assert killed <= set(trained)
    by_task = calls_by_task(tags)
    for task_id in killed:
        assert by_task[task_id] and all(n == 1 for n in by_task[task_id].values()), by_task[task_id]
    assert all(n == 1 for calls in by_task.values() for n in calls.values())
    replays = re.findall(r'tandem_judge_memory_total\{[^}]*kind="replay",result="hit"\} (\S+)', proxy_metrics)
    assert sum(float(v) for v in replays) >= 1  # the taker-over asked again and was answered from memory
