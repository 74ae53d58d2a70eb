"""A generate job through the whole system (API, learner, a rollout server on the real
vLLM engine): MR-ranked conversations become an SFT file and a pairs file, listed by the
API, and both load as the data of a later offline DPO job. A generate job stopped mid-run
resumes with every row written exactly once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest
import redis
from helpers import Producer, create_job, start_learner, wait_for
from transformers import AutoTokenizer

from learner.runs.generate import group_rows
from rollout.tasks import clarify
from services import jobs, protocol
from services.config import parse_job_spec
from services.preference import load_pairs
from services.queues import Keys
from tandem.launcher import Ports, Stack, kill_all, process_tree

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
            # The context ids are the ids the policy saw: the template's rendering of the first
            # turn, then its own generated ids, which are never re-encoded (rollout/episode.py)
            # and need not be the tokenizer's own spelling of their text. So the ids equal a
            # fresh rendering at turn 0 and spell the same text at every turn.
            rendered = tokenizer.apply_chat_template(row["context"], add_generation_prompt=True, tokenize=True)
            rendered = list(rendered if isinstance(rendered, list) else rendered["input_ids"])
            assert tokenizer.decode(row["context_ids"]) == tokenizer.decode(rendered)
            if row["turn"] == 0:
                assert row["context_ids"] == rendered
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


class ConversationProducer(Producer):
    """The deterministic producer's groups as ranked conversations: each names its task in
    a well-formed conversation, so every task writes one SFT row, and pairs wherever its
    samples' rewards differ."""

    def group(self, task: protocol.Task) -> protocol.TrajectoryGroup:
        group = super().group(task)
        group.conversation = [
            {"role": "user", "content": f"task {task.task_id}"},
            {"role": "assistant", "content": "ok"},
        ]
        group.conversation_metrics = {"well_formed": 1.0}
        return group


def records(client: redis.Redis, job_id: str, phase: str) -> list[dict]:
    return [r for r in map(json.loads, client.lrange(Keys.history(job_id), 0, -1)) if r["phase"] == phase]


@pytest.mark.parametrize("interrupt", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_generate_job_stopped_mid_run_resumes_with_every_row_exactly_once(
    redis_url, tiny_model, tokenizer, tmp_path, interrupt
):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    demonstrations = tmp_path / "demonstrations.jsonl"
    demonstrations.write_text(
        "".join(json.dumps({"messages": m}) + "\n" for m in clarify.demonstrations(8, seed=1, ask_share=0.5))
    )
    spec = parse_job_spec(
        {
            "kind": "generate",
            "model": {"path": str(tiny_model), "max_model_len": 512},
            "warm_start": {"steps": 2, "batch_size": 4, "data": str(demonstrations)},
            "rollout": {"group_size": 2, "max_total_tokens": 256},
            "reward": {"mode": "multiturn"},
            "train": {"batch_size": 2},
            "generate": {"conversations": 8},
        }
    )
    job_id = create_job(redis_url, spec)
    producer = ConversationProducer(redis_url, job_id, tokenizer, gate=4)  # two batches, then the learner waits
    producer.start()
    runs, log = tmp_path / "runs", tmp_path / "learner.log"
    learner = start_learner(redis_url, runs, log, resume=False)
    try:
        wait_for(lambda: len(records(client, job_id, "generate")) == 2, 240, "two batches written")
        if interrupt == signal.SIGKILL:
            kill_all(process_tree(learner.pid))
        else:
            os.killpg(learner.pid, interrupt)
        learner.wait(timeout=120)
        assert client.hget(Keys.job(job_id), "status") == b"RUNNING"  # left for --resume
        producer.gate = 8
        learner = start_learner(redis_url, runs, log, resume=True)
        wait_for(lambda: client.hget(Keys.job(job_id), "status").decode() in jobs.TERMINAL, 240, "the job to end")
        assert client.hget(Keys.job(job_id), "status") == b"SUCCEEDED", log.read_text()[-3000:]
    finally:
        producer.stop.set()
        os.killpg(learner.pid, signal.SIGTERM)
        learner.wait(timeout=60)

    folder = runs / job_id / "dataset"
    sft = [json.loads(line) for line in (folder / "sft.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    tasks = [protocol.Task(job_id=job_id, task_id=t, example=0, group_size=2, dispatched_version=0) for t in range(8)]
    expected_pairs = [
        (task.task_id, p["turn"], p["chosen_score"], p["rejected_score"])
        for task in tasks
        for p in group_rows(producer.group(task), 0, 0.0)[1]
    ]
    assert sorted(r["task_id"] for r in sft) == list(range(8))
    assert sorted((r["task_id"], r["turn"], r["chosen_score"], r["rejected_score"]) for r in pairs) == expected_pairs
    listed = {k.decode(): json.loads(v)["rows"] for k, v in client.hgetall(Keys.datasets(job_id)).items()}
    assert listed == {"sft": 8, "pairs": len(expected_pairs)}
    # The warm start ran once: the resumed run played the step-0 checkpoint's policy.
    assert len(records(client, job_id, "sft")) == 2
    assert records(client, job_id, "generate")[-1]["conversations"] == 8
    # Every group was acknowledged before its batch's trim, which keeps only the newest
    # entry; the producer acknowledges a task right after its group, so at most one more.
    assert client.xlen(Keys.trajectories(job_id)) == 1
    assert client.xlen(Keys.tasks(job_id)) <= 2
