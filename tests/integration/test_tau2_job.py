"""τ²-bench's mock domain through the whole system: an RL job on its train split (API,
learner, a rollout server on vLLM, the judge proxy in front of the stand-in provider, which
plays the benchmark's user), and `tandem eval` on its test split against the same proxy.

The policy is the tiny model, which writes no useful call: what is checked is that the
benchmark's tools, worlds, user and verdict run inside a job and an evaluation, and that
the job's history shows the pass rate, the tool calls and the failures by reason. The mock
task without evaluation criteria (every conversation the user ends passes it) is in neither
split, so a pass rate above 0 would mean a verdict gone wrong.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import httpx
import pytest
import redis
from helpers import stand_in_upstreams, wait_for

from devtools.provider import LocalUpstreamConfig, create_app, serve_in_thread
from services.queues import Keys
from tandem.launcher import Ports, Stack
from tandem.redis_embed import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def system(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("tau2")
    stand_in = LocalUpstreamConfig(tpm=50_000_000, rpm=500_000, models=["judge"], seed=5)
    with contextlib.ExitStack() as stack:
        stand_in_url = stack.enter_context(serve_in_thread(create_app(stand_in), free_port()))
        upstreams = stand_in_upstreams(tmp / "upstreams.json", stand_in_url, max_concurrency=64)
        env = {"TANDEM_RUNS_DIR": str(tmp / "runs"), "TANDEM_UPSTREAMS": str(upstreams)}
        yield stack.enter_context(Stack(tmp / "logs", ports=Ports.free(), extra_env=env)), tmp


def test_a_tau2_job_trains_a_step_and_its_history_shows_passes_calls_and_failures(system, tiny_model):
    stack, _ = system
    spec = {
        "name": "tau2-mock",
        "model": {"path": str(tiny_model), "max_model_len": 1024},
        "task": {"name": "tau2", "domain": "mock", "split": "train"},
        "tools": {"max_calls_per_episode": 4, "max_rounds_per_turn": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 32, "max_turns": 2, "max_total_tokens": 1024},
        "reward": {"user_model": "judge"},
        "train": {"num_steps": 1, "batch_size": 2, "max_staleness": 1, "lr": 1e-4},
    }
    api = httpx.Client(base_url=stack.api_url, timeout=10)
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code in (200, 201), created.text
    job_id = created.json()["id"]
    record = wait_for(
        lambda: (r := api.get(f"/v1/jobs/{job_id}").json())["status"] in ("SUCCEEDED", "FAILED") and r,
        600,
        "the tau2 job",
        interval_s=1,
    )
    assert record["status"] == "SUCCEEDED", record.get("error")
    # Every task drew an example of the split (num_examples is its size): none dead-lettered.
    assert redis.Redis.from_url(stack.redis_url).xlen(Keys.dead(job_id)) == 0
    [step] = [h for h in api.get(f"/v1/jobs/{job_id}/history").json() if h["phase"] == "rl"]
    assert step["reward_mean"] == 0.0 and step["simulator_tokens"] > 0
    for key in (
        "tool_calls",
        "tool_success_ratio",
        "tool_failed_malformed",
        "tool_failed_unknown_tool",
        "tool_failed_bad_arguments",
        "tool_failed_tool_error",
    ):
        assert key in step, key


def test_tandem_eval_reports_pass_hat_k_on_the_mock_test_split(system, tiny_model):
    stack, tmp = system
    out = tmp / "eval.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "eval",
            str(tiny_model),
            "--domains",
            "mock",
            "--split",
            "test",
            "--trials",
            "2",
            "--judge-url",
            stack.judge_url,
            "--user-model",
            "judge",
            "--max-model-len",
            "1024",
            "--max-new-tokens",
            "32",
            "--max-turns",
            "2",
            "--kv-cache-gib",
            "0.5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = json.loads(out.read_text())["results"]
    assert result["tasks"] == 3 and result["trials"] == 2 and len(result["episodes"]) == 6
    assert result["pass^1"]["value"] == result["pass^2"]["value"] == 0.0
    assert set(result["ends"]) <= {"user_ended", "max_turns", "max_tokens", "truncated", "wrong_stop", "special_token"}
    assert "| mock | test | 3 | 2 |" in done.stdout
