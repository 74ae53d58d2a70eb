"""A generate job through the whole system (API, learner, a rollout server on the real
vLLM engine): MR-ranked conversations become an SFT file and a pairs file, listed by the
API, and both load as the data of a later offline DPO job."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers import wait_for
from transformers import AutoTokenizer

from rollout.tasks import clarify
from services.preference import load_pairs
from tandem.launcher import Ports, Stack

pytestmark = pytest.mark.slow


def finished(api: httpx.Client, job_id: str, timeout_s: float) -> dict:
    record = wait_for(
        lambda: (r := api.get(f"/v1/jobs/{job_id}").json())["status"] in ("SUCCEEDED", "FAILED", "CANCELLED") and r,
        timeout_s,
        f"job {job_id}",
        interval_s=0.5,
    )
    assert record["status"] == "SUCCEEDED", record
    return record


def test_a_generated_dataset_round_trips_through_an_offline_dpo_job(tmp_path, tiny_model):
    demonstrations = tmp_path / "demonstrations.jsonl"
    demonstrations.write_text(
        "".join(json.dumps({"messages": m}) + "\n" for m in clarify.demonstrations(256, seed=1, ask_share=0.5))
    )
    model = {"path": str(tiny_model), "max_model_len": 512}
    generate = {
        "name": "generate",
        "kind": "generate",
        "model": model,
        "task": {"name": "clarify", "num_examples": 64},
        # A short warm start so that the responses end their turns and differ in MR.
        "warm_start": {"steps": 80, "batch_size": 32, "data": str(demonstrations)},
        "rollout": {"group_size": 3, "max_new_tokens": 16, "max_turns": 2, "max_total_tokens": 160},
        # The token penalty (lambda) alone makes responses of different lengths differ in MR.
        "reward": {"mode": "multiturn", "window": 1, "num_futures": 2, "token_penalty": 0.02},
        "train": {"batch_size": 2},
        "generate": {"conversations": 4, "pair_margin": 0.01},
    }
    with Stack(tmp_path / "logs", ports=Ports.free(), extra_env={"TANDEM_RUNS_DIR": str(tmp_path / "runs")}) as stack:
        api = httpx.Client(base_url=stack.api_url, timeout=10)
        job_id = api.post("/v1/jobs", json=generate).json()["id"]
        finished(api, job_id, 420)
        listed = {d["name"]: d for d in api.get(f"/v1/jobs/{job_id}/datasets").json()}
        history = [h for h in api.get(f"/v1/jobs/{job_id}/history").json() if h["phase"] == "generate"]

        assert set(listed) == {"sft", "pairs"}
        sft_rows = [json.loads(line) for line in Path(listed["sft"]["path"]).read_text().splitlines()]
        pair_rows = [json.loads(line) for line in Path(listed["pairs"]["path"]).read_text().splitlines()]
        assert (len(sft_rows), len(pair_rows)) == (listed["sft"]["rows"], listed["pairs"]["rows"])
        assert history[-1]["conversations"] == 4 and history[-1]["pairs"] == len(pair_rows) > 0
        assert sorted(r["task_id"] for r in sft_rows) == sorted(set(r["task_id"] for r in sft_rows))
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        for row in sft_rows:
            assert row["messages"][0]["role"] == "user" and row["messages"][1]["role"] == "assistant"
            assert "success" in row
        for row in pair_rows:
            assert row["chosen_score"] - row["rejected_score"] >= 0.01
            assert row["turn"] in (0, 1) and row["context"][-1]["role"] == "user"
            assert tokenizer.decode(row["chosen_ids"], skip_special_tokens=True) == row["chosen_text"]
            assert tokenizer.decode(row["rejected_ids"], skip_special_tokens=True) == row["rejected_text"]
            # The context ids are the template's rendering of the context messages.
            rendered = tokenizer.apply_chat_template(row["context"], add_generation_prompt=True, tokenize=True)
            assert row["context_ids"] == list(rendered if isinstance(rendered, list) else rendered["input_ids"])
        assert len(load_pairs(listed["pairs"]["path"], vocab_size=len(tokenizer))) == 2 * len(pair_rows)

        offline = {
            "name": "offline-dpo",
            "kind": "offline",
            "model": model,
            "warm_start": {"steps": 2, "batch_size": 4, "data": listed["sft"]["path"]},
            "train": {"algorithm": "dpo", "data": listed["pairs"]["path"], "num_steps": 2, "batch_size": 2},
        }
        offline_id = api.post("/v1/jobs", json=offline).json()["id"]
        finished(api, offline_id, 180)
        steps = [h for h in api.get(f"/v1/jobs/{offline_id}/history").json() if h["phase"] == "offline"]
        assert [h["step"] for h in steps] == [1, 2]
        assert (tmp_path / "runs" / offline_id / "policy" / "model.safetensors").exists()
