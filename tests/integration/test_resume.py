"""Exact resume: 6 learner steps straight equal 3 steps, SIGTERM, `--resume`, 3 steps
(same parameters to 1e-6, same trained trajectories, none twice).

The rollout side is replaced by a deterministic producer (a real consumer of the real
tasks stream) that answers each task with a group computed from the task alone, so both
runs see identical trajectories; the learner runs for real under torchrun with 2 ranks.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis
from helpers import Producer, create_job, rl_steps, start_learner, wait_for
from safetensors.torch import load_file

from learner import group_log
from learner.step_log import StepLog
from services import jobs
from services.config import (
    ModelSpec,
    RLJob,
    RolloutSpec,
    TrainSpec,
)
from services.queues import Keys
from tandem.launcher import kill_all, process_tree


def job_record(client: redis.Redis, job_id: str) -> dict:
    return {k.decode(): v.decode() for k, v in client.hgetall(Keys.job(job_id)).items()}


def run_job(
    redis_url: str,
    model: Path,
    tokenizer,
    workdir: Path,
    interrupt_after: int | None,
    interrupt: signal.Signals = signal.SIGTERM,
    checkpoint_every: int = 3,
    checkpoint_every_s: float = 1800.0,
):
    """Run the 6-step job; with `interrupt_after`, only that many steps' tasks are answered
    until the learner, blocked waiting for the next batch, gets `interrupt` and is
    restarted with --resume."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    spec = RLJob(
        model=ModelSpec(path=str(model), max_model_len=512),
        rollout=RolloutSpec(group_size=2, max_total_tokens=256),
        train=TrainSpec(
            num_steps=6,
            batch_size=2,
            max_staleness=0,
            lr=1e-3,
            checkpoint_every=checkpoint_every,
            checkpoint_every_s=checkpoint_every_s,
        ),
    )
    job_id = create_job(redis_url, spec)
    batch = spec.train.batch_size
    producer = Producer(redis_url, job_id, tokenizer, gate=batch * (interrupt_after or spec.train.num_steps))
    producer.start()
    workdir.mkdir(parents=True, exist_ok=True)
    runs, log = workdir / "runs", workdir / "learner.log"
    learner = start_learner(redis_url, runs, log, resume=False)
    try:
        if interrupt_after is not None:
            wait_for(lambda: len(rl_steps(client, job_id)) == interrupt_after, 180, f"step {interrupt_after}")
            time.sleep(1.0)  # the learner is now waiting for tasks the producer holds back
            if interrupt == signal.SIGKILL:
                kill_all(process_tree(learner.pid))  # every rank, not just torchrun's agent
            else:
                os.killpg(learner.pid, interrupt)
            learner.wait(timeout=120)
            assert job_record(client, job_id)["status"] == "RUNNING"  # left for --resume
            producer.gate = batch * spec.train.num_steps
            learner = start_learner(redis_url, runs, log, resume=True)
        wait_for(lambda: job_record(client, job_id)["status"] in jobs.TERMINAL, 300, "the job to end")
        assert job_record(client, job_id)["status"] == "SUCCEEDED", log.read_text()[-3000:]
    finally:
        producer.stop.set()
        os.killpg(learner.pid, signal.SIGTERM)
        learner.wait(timeout=60)
    task_ids = [t for record in rl_steps(client, job_id) for t in record["task_ids"]]
    return load_file(runs / job_id / "policy" / "model.safetensors"), task_ids, runs / job_id


@pytest.fixture(scope="module")
def straight_run(redis_url, tiny_model, tokenizer, tmp_path_factory):
    return run_job(redis_url, tiny_model, tokenizer, tmp_path_factory.mktemp("straight"), None)


@pytest.mark.slow
def test_a_learner_stopped_after_three_steps_resumes_exactly(straight_run, redis_url, tiny_model, tokenizer, tmp_path):
    straight, straight_tasks, _ = straight_run
    resumed, resumed_tasks, resumed_dir = run_job(redis_url, tiny_model, tokenizer, tmp_path / "resumed", 3)

    assert sorted(p.name for p in (resumed_dir / "checkpoints").glob("step-*")) == [
        "step-000000",
        "step-000003",
        "step-000006",
    ]
    assert resumed_tasks == straight_tasks
    assert len(resumed_tasks) == len(set(resumed_tasks)) == 6 * 2
    assert max((straight[n] - resumed[n]).abs().max().item() for n in straight) < 1e-6


@pytest.mark.slow
def test_with_periodic_checkpoints_off_a_stop_still_checkpoints_and_resumes_exactly(
    redis_url, tiny_model, tokenizer, tmp_path
):
    """`checkpoint_every: 0, checkpoint_every_s: 0` turn off periodic checkpoints, not the
    one SIGTERM promises: a restarted learner (`docker compose restart`) resumes instead of
    failing the job."""
    off = {"checkpoint_every": 0, "checkpoint_every_s": 0.0}
    straight, straight_tasks, _ = run_job(redis_url, tiny_model, tokenizer, tmp_path / "straight", None, **off)
    resumed, resumed_tasks, resumed_dir = run_job(redis_url, tiny_model, tokenizer, tmp_path / "off", 2, **off)

    assert sorted(p.name for p in (resumed_dir / "checkpoints").glob("step-*")) == ["step-000002"]
    assert resumed_tasks == straight_tasks
    assert max((straight[n] - resumed[n]).abs().max().item() for n in straight) < 1e-6


@pytest.mark.slow
def test_a_learner_killed_after_step_five_retrains_from_step_three_exactly(
    straight_run, redis_url, tiny_model, tokenizer, tmp_path
):
    """SIGKILL of every learner process: the groups of steps 4-5, trained but not covered by
    a checkpoint, were never acknowledged; they come back and are trained once more from
    the step-3 state, so the result is still the uninterrupted run's."""
    straight, straight_tasks, _ = straight_run
    killed, tasks, run_dir = run_job(redis_url, tiny_model, tokenizer, tmp_path / "killed", 5, signal.SIGKILL)

    assert tasks == straight_tasks
    assert len(tasks) == len(set(tasks)) == 6 * 2
    trained = [r["task_id"] for r in group_log.read(run_dir / "groups.jsonl") if r["decision"] == "trained"]
    assert sorted(trained) == sorted(tasks)  # groups.jsonl cut back to the checkpoint, as the history is
    assert max((straight[n] - killed[n]).abs().max().item() for n in straight) < 1e-6


@pytest.mark.parametrize("covered", [0, 2])
async def test_resuming_drops_the_history_records_written_after_the_checkpoint(redis_client, tmp_path, covered):
    steps = StepLog(redis_client, "j", tmp_path, rules=[])
    await redis_client.rpush(Keys.history("j"), "a", "b", "c")

    await steps.trim(covered)

    assert await redis_client.lrange(Keys.history("j"), 0, -1) == [b"a", b"b", b"c"][:covered]
