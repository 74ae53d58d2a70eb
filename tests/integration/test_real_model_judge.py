"""SmolLM2-135M-Instruct served by `tandem serve-model` as the judge proxy's upstream: it
plays the user simulator and the judge of a judge-bound job, verdicts and simulator replies
held to JSON schemas (structured outputs), and the proxy charges what vLLM counted."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from helpers import metric_sum, served_model, vllm_counted, wait_for

from judge_proxy.rubrics import RUBRICS, prompt_sha256
from tandem.demo import write_demonstrations
from tandem.launcher import Ports, Stack

pytestmark = pytest.mark.slow
SERVED = "smollm2"


@pytest.fixture(scope="module")
def served(real_model, tmp_path_factory):
    """`tandem serve-model` on the real model: its base URL."""
    with served_model(real_model, SERVED, tmp_path_factory.mktemp("served") / "serve-model.log") as url:
        yield url


def job_spec(model: str, warm_start: Path) -> dict:
    return {
        "name": "real-judge",
        "model": {"path": model, "max_model_len": 1024},
        "task": {"name": "clarify", "num_examples": 16, "user": "llm"},
        # A few SFT steps teach the pretrained model clarify's short replies (well-formed after
        # six here); a reply cut at the length limit would score -1 with neither a simulator
        # turn nor a verdict.
        "warm_start": {"steps": 6, "batch_size": 8, "lr": 1e-4, "data": str(warm_start)},
        "rollout": {"group_size": 2, "max_new_tokens": 48, "max_turns": 2, "max_total_tokens": 600},
        "reward": {
            "judge_rubric": "interactivity",
            "judge_weight": 0.5,
            "token_penalty": 0.001,
            "judge_model": SERVED,
            "user_model": SERVED,
        },
        "train": {"num_steps": 2, "batch_size": 1, "lr": 1e-5, "max_staleness": 0},
    }


def test_served_real_model_is_simulator_and_judge_and_the_proxy_charges_what_vllm_counted(served, real_model, tmp_path):
    upstreams = tmp_path / "upstreams.yaml"
    upstreams.write_text(
        yaml.safe_dump(
            {
                "upstreams": [
                    {
                        "name": "smollm2-local",
                        "model": SERVED,
                        "base_url": f"{served}/v1",
                        "tpm": 1_000_000,
                        "rpm": 10_000,
                        "max_concurrency": 4,
                        "timeout_s": 300,
                        "structured_output": True,
                        "tokenizer": str(real_model / "tokenizer.json"),
                    }
                ]
            }
        )
    )
    env = {"TANDEM_UPSTREAMS": str(upstreams), "TANDEM_RUNS_DIR": str(tmp_path / "runs")}
    warm_start = tmp_path / "warm_start.jsonl"
    write_demonstrations(warm_start, num=200, share=0.5)
    with Stack(tmp_path / "logs", ports=Ports.free(), extra_env=env) as stack:
        api = httpx.Client(base_url=stack.api_url, timeout=10)
        card = httpx.get(f"{stack.judge_url}/v1/models/{SERVED}", timeout=10).json()
        assert card["structured_output"] is True
        job_id = api.post("/v1/jobs", json=job_spec(str(real_model), warm_start)).json()["id"]
        record = wait_for(
            lambda: (r := api.get(f"/v1/jobs/{job_id}").json())["status"] in ("SUCCEEDED", "FAILED") and r,
            900,
            "the job to end",
            interval_s=2,
        )
        history = api.get(f"/v1/jobs/{job_id}/history").json()
        proxy_metrics = httpx.get(f"{stack.judge_url}/metrics", timeout=10).text
    assert record["status"] == "SUCCEEDED", record.get("error")

    steps = [h for h in history if h.get("phase") == "rl"]
    assert len(steps) == 2 and all(h["judge_tokens"] > 0 for h in steps)
    assert sum(h["simulator_tokens"] for h in steps) > 0
    expected = {
        "judge_model": SERVED,
        "simulator_model": SERVED,
        "seed": "0",
        "rubric_sha256": prompt_sha256(RUBRICS["interactivity"], structured=True),
    }
    unjudged = {"simulator_model": SERVED, "seed": "0"}  # a reply cut off after the user's turn: -1, no verdict
    assert all(
        expected in h["reward_sources"] and all(s in (expected, unjudged) for s in h["reward_sources"]) for h in steps
    )

    charged = metric_sum(proxy_metrics, "tandem_judge_tokens_total", upstream="smollm2-local", kind="actual")
    assert charged > 0 and charged == vllm_counted(served)
    assert metric_sum(proxy_metrics, "tandem_judge_verdicts_total", outcome="parsed") > 0
