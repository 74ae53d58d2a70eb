"""Health rules end to end: a real learner (torchrun, 2 ranks) on groups whose rewards are
pinned equal, so every group has zero spread and the job trains on nothing.

One learner serves two jobs in turn: the one whose rule says `stop` ends FAILED at the step
the rule fires, with the rule in its error, its alerts and that step's record; the one whose
rule says `warn` runs to the end with one alert for the whole stretch. Neither moves the
policy: a zero gradient takes no optimizer update.
"""

from __future__ import annotations

import os
import signal

import pytest
import redis
from helpers import Producer, create_job, rl_steps, start_learner, wait_for
from safetensors.torch import load_file

from services import jobs
from services.config import (
    HealthRule,
    JobSpec,
    ModelSpec,
    RLJob,
    RolloutSpec,
    TrainSpec,
)
from services.queues import Keys

pytestmark = pytest.mark.slow
ZERO_SPREAD = {"metric": "zero_spread_share", "above": 0.5, "steps": 3}


def pinned_job(model, action: str, num_steps: int) -> JobSpec:
    return RLJob(
        name=f"pinned-{action}",
        model=ModelSpec(path=str(model), max_model_len=512),
        rollout=RolloutSpec(group_size=2, max_total_tokens=256),
        train=TrainSpec(num_steps=num_steps, batch_size=2, max_staleness=0, lr=1e-2),
        health=[HealthRule(**ZERO_SPREAD, action=action)],
    )


def ended(client: redis.Redis, job_id: str) -> dict | None:
    record = jobs.parse_record(client.hgetall(Keys.job(job_id)))
    return record if record["status"] in jobs.TERMINAL else None


def test_zero_spread_jobs_stop_or_warn_as_their_rule_says_and_never_move_the_policy(
    redis_url, tiny_model, tokenizer, tmp_path
):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    stopping = create_job(redis_url, pinned_job(tiny_model, "stop", num_steps=10))
    warning = create_job(redis_url, pinned_job(tiny_model, "warn", num_steps=5))
    producers = [
        Producer(redis_url, job_id, tokenizer, gate=10**6, reward=lambda rng: 0.5) for job_id in (stopping, warning)
    ]
    for producer in producers:
        producer.start()
    learner = start_learner(redis_url, tmp_path / "runs", tmp_path / "learner.log", resume=False)
    try:
        stopped = wait_for(lambda: ended(client, stopping), 240, "the stop-rule job to end")
        warned = wait_for(lambda: ended(client, warning), 240, "the warn-rule job to end")
    finally:
        for producer in producers:
            producer.stop.set()
        os.killpg(learner.pid, signal.SIGTERM)
        learner.wait(timeout=60)
    log = (tmp_path / "learner.log").read_text()[-3000:]

    # stop: FAILED at step 3, the third zero-spread step in a row; the reason everywhere.
    reason = "health rule (stop): zero_spread_share > 0.5 for 3 steps (steps 1-3: 1, 1, 1)"
    assert (stopped["status"], stopped["error"], stopped["alerts"]) == ("FAILED", reason, [reason]), log
    steps = rl_steps(client, stopping)
    assert [s["step"] for s in steps] == [1, 2, 3] and steps[-1]["health"] == [reason]
    assert all(s["zero_spread_share"] == 1.0 and s["grad_norm"] == 0.0 and s["skipped_updates"] == 1.0 for s in steps)

    # warn: all 5 steps, one alert at step 3 for the one stretch, and the policy never moved.
    assert (warned["status"], warned.get("error")) == ("SUCCEEDED", None), log
    assert warned["alerts"] == [reason.replace("(stop)", "(warn)")]
    assert [bool(s.get("health")) for s in rl_steps(client, warning)] == [False, False, True, False, False]
    trained = load_file(tmp_path / "runs" / warning / "policy" / "model.safetensors")
    initial = load_file(tiny_model / "model.safetensors")
    assert all(trained[name].equal(initial[name]) for name in initial)
