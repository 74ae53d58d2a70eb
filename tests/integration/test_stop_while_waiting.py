"""SIGTERM (a compose restart, a Kubernetes upgrade) reaches a learner that is not yet
training: in the middle of a long warm start, or waiting for rollout servers that never
come. It must stop within a step and leave the job RUNNING for `--resume`, not finish the
whole warm start (minutes to hours) or wait out `rollout_wait_s` first, only for torchrun
or the orchestrator to kill it half-way.

The learner runs for real under torchrun with 2 ranks; no rollout server is started.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
from helpers import create_job, start_learner, wait_for

from services import jobs
from services.config import JobSpec, ModelSpec, RLJob, TrainSpec, WarmStartSpec
from services.queues import Keys
from tandem.demo import write_demonstrations

pytestmark = pytest.mark.slow
STOPS_WITHIN_S = 20.0
"""One SFT step of the tiny model (well under a second) or one 0.5 s poll of the fleet,
then the shutdown of two ranks (about 1 s here). Below torchrun's own 30 s grace before it
kills its workers, so only a learner that stops by itself passes; before, it went on for
the whole warm start below (thousands of steps) or for `rollout_wait_s` until killed."""


def job(model, warm_start_steps: int, data=None, checkpoint_every: int = 0) -> JobSpec:
    return RLJob(
        name="stopped",
        model=ModelSpec(path=str(model), max_model_len=512),
        train=TrainSpec(num_steps=2, batch_size=2, checkpoint_every=checkpoint_every),
        warm_start=WarmStartSpec(steps=warm_start_steps, batch_size=8, data=data and str(data)),
    )


def stop_when(redis_url: str, job_id: str, tmp_path, ready, env: dict[str, str]) -> tuple[float, dict]:
    """Start a learner, SIGTERM it once `ready(client)`, and return how long it took to
    exit and the job's record then."""
    client = redis.Redis.from_url(redis_url)
    learner = start_learner(redis_url, tmp_path / "runs", tmp_path / "learner.log", resume=False, env=env)
    try:
        wait_for(lambda: ready(client), 180, "the learner to reach the point under test", interval_s=0.2)
        signalled = time.monotonic()
        os.killpg(learner.pid, signal.SIGTERM)
        learner.wait(timeout=STOPS_WITHIN_S + 60)
        seconds = time.monotonic() - signalled
        assert f"stopping: job {job_id} left RUNNING for --resume" in (tmp_path / "learner.log").read_text()
        return seconds, jobs.parse_record(client.hgetall(Keys.job(job_id)))
    finally:
        if learner.poll() is None:
            os.killpg(learner.pid, signal.SIGKILL)


def test_sigterm_in_a_long_warm_start_stops_within_a_step_and_leaves_the_job_to_resume(redis_url, tiny_model, tmp_path):
    redis.Redis.from_url(redis_url).flushdb()
    data = tmp_path / "demonstrations.jsonl"
    write_demonstrations(data, num=64, share=0.5)
    job_id = create_job(redis_url, job(tiny_model, warm_start_steps=20_000, data=data))

    def warming_up(client) -> bool:
        return client.llen(Keys.history(job_id)) >= 2

    seconds, record = stop_when(redis_url, job_id, tmp_path, warming_up, {})

    assert seconds < STOPS_WITHIN_S
    assert record["status"] == "RUNNING"  # left for --resume, which starts it over
    assert record["step"] == 0
    assert not (tmp_path / "runs" / job_id / "checkpoints").exists()


def test_sigterm_while_waiting_for_rollout_servers_stops_at_once(redis_url, tiny_model, tmp_path):
    redis.Redis.from_url(redis_url).flushdb()
    job_id = create_job(redis_url, job(tiny_model, warm_start_steps=0, checkpoint_every=1))

    def waiting_for_servers(client) -> bool:
        """The step-0 checkpoint is written just before the wait for servers begins; and
        the learner's heartbeat, every 5 s, is in the record (nothing else moves it now)."""
        return client.llen(Keys.checkpoints(job_id)) >= 1 and client.hget(Keys.job(job_id), "learner_seen")

    seconds, record = stop_when(redis_url, job_id, tmp_path, waiting_for_servers, {"TANDEM_MIN_ROLLOUT_SERVERS": "1"})

    assert seconds < STOPS_WITHIN_S
    assert record["status"] == "RUNNING"
