"""DPO jobs on the real learner (torchrun, 2 ranks): offline on a pairs file, online on
groups that arrive as they do for RL, and a malformed pairs file that fails its job with
the line. The rollout side of the online job is the deterministic producer of the resume
test (a real consumer of the tasks stream)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import redis
from helpers import Producer, create_job, rl_steps, start_learner, wait_for

from rollout.tasks import clarify
from services import jobs
from services.config import (
    ModelSpec,
    OfflineJob,
    RLJob,
    RolloutSpec,
    TrainSpec,
)
from services.queues import Keys
from services.tokenization import ChatTokenizer

pytestmark = pytest.mark.slow


def response_ids(chat: ChatTokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(context ids, the last assistant turn's trained ids) of a demonstration."""
    tokens, mask = chat.encode_demonstration(messages)
    first = mask.index(1)
    return tokens[:first], [t for t, m in zip(tokens[first:], mask[first:]) if m]


def asking_pairs(tokenizer, count: int) -> list[dict]:
    """Vague requests where asking which option is meant is preferred to a guess."""
    chat = ChatTokenizer(tokenizer)
    rows = []
    for example in clarify.make_examples(count, seed=5):
        request = [{"role": "user", "content": clarify.request(example)}]
        context, asked = response_ids(
            chat, request + [{"role": "assistant", "content": clarify.question(example.category)}]
        )
        _, guessed = response_ids(
            chat, request + [{"role": "assistant", "content": clarify.answer(example.category, example.options[0])}]
        )
        rows.append(
            {
                "context_ids": context,
                "chosen_ids": asked,
                "rejected_ids": guessed,
                "chosen_score": 1.0,
                "rejected_score": 0.2,
            }
        )
    return rows


@pytest.fixture(scope="module")
def learner(redis_url, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("dpo-learner")
    redis.Redis.from_url(redis_url).flushdb()
    process = start_learner(redis_url, workdir / "runs", workdir / "learner.log", resume=False)
    yield workdir
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=60)


def finish(redis_url: str, job_id: str, learner: Path) -> dict:
    client = redis.Redis.from_url(redis_url)
    wait_for(
        lambda: (r := client.hget(Keys.job(job_id), "status")) and r.decode() in jobs.TERMINAL,
        300,
        f"job {job_id} to end",
    )
    record = {k.decode(): v.decode() for k, v in client.hgetall(Keys.job(job_id)).items()}
    record["history"] = [json.loads(r) for r in client.lrange(Keys.history(job_id), 0, -1)]
    record["log"] = (learner / "learner.log").read_text()[-3000:]
    return record


def test_offline_dpo_learns_the_preferred_response_of_a_pairs_file(learner, redis_url, tiny_model, tokenizer, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in asking_pairs(tokenizer, 12)))
    spec = OfflineJob(
        kind="offline",
        model=ModelSpec(path=str(tiny_model), max_model_len=512),
        train=TrainSpec(algorithm="dpo", data=str(pairs), num_steps=6, batch_size=4, lr=1e-3, dpo_beta=0.5),
    )

    job_id = create_job(redis_url, spec)
    record = finish(redis_url, job_id, learner)

    assert record["status"] == "SUCCEEDED", record["log"]
    steps = [h for h in record["history"] if h["phase"] == "offline"]
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5, 6]
    assert [h["epoch"] for h in steps] == pytest.approx([k * 4 / 12 for k in range(1, 7)])
    assert all(h["pairs"] == 4 for h in steps)
    # The first step starts at the reference (every margin 0); the policy then moves towards
    # the chosen responses, on pairs it sees for the second time from step 4 on.
    assert steps[0]["reward_margin"] == pytest.approx(0.0, abs=1e-5)
    assert steps[-1]["reward_margin"] > 0.5 and steps[-1]["preference_accuracy"] == 1.0
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert (learner / "runs" / job_id / "policy" / "model.safetensors").exists()


def test_a_malformed_pairs_file_fails_the_job_naming_the_line(learner, redis_url, tiny_model, tokenizer, tmp_path):
    rows = asking_pairs(tokenizer, 3)
    rows[2]["rejected_ids"] = [10**9]  # no such token
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = OfflineJob(
        kind="offline",
        model=ModelSpec(path=str(tiny_model), max_model_len=512),
        train=TrainSpec(algorithm="dpo", data=str(pairs), num_steps=2, batch_size=2),
    )

    record = finish(redis_url, create_job(redis_url, spec), learner)

    assert record["status"] == "FAILED"
    assert f"{pairs}, line 3: rejected_ids has a token id outside the tokenizer's vocabulary" in record["error"]


def test_online_dpo_trains_each_groups_best_and_worst_response(learner, redis_url, tiny_model, tokenizer):
    spec = RLJob(
        model=ModelSpec(path=str(tiny_model), max_model_len=512),
        rollout=RolloutSpec(group_size=4, max_total_tokens=256),
        train=TrainSpec(algorithm="dpo", num_steps=3, batch_size=2, max_staleness=0, lr=1e-3, pair_margin=0.25),
    )
    job_id = create_job(redis_url, spec)
    producer = Producer(redis_url, job_id, tokenizer, gate=10**6, reward=lambda rng: rng.choice([0.0, 0.2, 1.0]))
    producer.start()
    try:
        record = finish(redis_url, job_id, learner)
    finally:
        producer.stop.set()

    assert record["status"] == "SUCCEEDED", record["log"]
    steps = rl_steps(redis.Redis.from_url(redis_url), job_id)
    assert [h["step"] for h in steps] == [1, 2, 3]
    for step in steps:
        assert 0 <= step["pairs"] <= 2 and step["pairs_too_long"] == 0
        assert {"preference_accuracy", "reward_margin", "logprob_chosen", "logprob_rejected"} <= step.keys()
    assert sum(step["pairs"] for step in steps) > 0
    assert steps[0]["reward_margin"] == pytest.approx(0.0, abs=1e-5)  # the first step is at the reference
