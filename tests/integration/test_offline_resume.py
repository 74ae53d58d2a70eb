"""Exact resume of an offline DPO job on the real learner (torchrun, 2 ranks). A module of
its own: its learners must be the only ones reading the job queue."""

from __future__ import annotations

import json
import os
import signal

import pytest
import redis
from helpers import create_job, start_learner, wait_for
from safetensors.torch import load_file
from test_dpo_jobs import asking_pairs, finish

from services.config import ModelSpec, OfflineJob, TrainSpec
from services.queues import Keys

pytestmark = pytest.mark.slow


def test_an_offline_job_stopped_mid_way_resumes_to_the_straight_runs_weights(
    redis_url, tiny_model, tokenizer, tmp_path
):
    """SIGTERM while an offline job trains: the learner checkpoints after its step and exits,
    the job stays RUNNING; `--resume` continues from that step with the same batches (a
    function of the step), so the end equals a run never stopped."""
    client = redis.Redis.from_url(redis_url)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in asking_pairs(tokenizer, 10)))
    spec = OfflineJob(
        kind="offline",
        model=ModelSpec(path=str(tiny_model), max_model_len=512),
        train=TrainSpec(algorithm="dpo", data=str(pairs), num_steps=30, batch_size=3, lr=1e-3),
    )

    def run(name: str, stop: bool) -> tuple[dict, list[dict]]:
        client.flushdb()
        job_id = create_job(redis_url, spec)
        runs, log = tmp_path / name / "runs", tmp_path / name / "learner.log"
        runs.mkdir(parents=True)
        learner = start_learner(redis_url, runs, log, resume=False)
        try:
            if stop:
                wait_for(lambda: len(client.lrange(Keys.history(job_id), 0, -1)) >= 2, 120, "two steps")
                os.killpg(learner.pid, signal.SIGTERM)
                learner.wait(timeout=120)
                assert client.hget(Keys.job(job_id), "status") == b"RUNNING"  # left for --resume
                learner = start_learner(redis_url, runs, log, resume=True)
            record = finish(redis_url, job_id, tmp_path / name)
        finally:
            os.killpg(learner.pid, signal.SIGTERM)
            learner.wait(timeout=60)
        assert record["status"] == "SUCCEEDED", record["log"]
        return load_file(runs / job_id / "policy" / "model.safetensors"), record["history"]

    straight, straight_history = run("straight", stop=False)
    resumed, resumed_history = run("resumed", stop=True)

    assert [h["step"] for h in resumed_history] == list(range(1, 31))  # records after the checkpoint trimmed
    assert [h["loss"] for h in resumed_history] == pytest.approx([h["loss"] for h in straight_history], abs=1e-5)
    assert max((straight[n] - resumed[n]).abs().max().item() for n in straight) < 1e-6
