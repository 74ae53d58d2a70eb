"""What a job leaves behind, on the real learner (torchrun, 2 ranks) with offline DPO jobs
(no rollout server): checkpoints pruned to `keep_checkpoints`, a cancel that keeps a
checkpoint and the policy, and a Redis at its memory cap that fails the job by name
instead of crashing the learner. A module of its own: its learner must be the only one
reading the job queue."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from types import SimpleNamespace

import pytest
import redis
import redis.asyncio as aioredis
from helpers import create_job, start_learner, wait_for
from safetensors.torch import load_file
from test_dpo_jobs import asking_pairs, finish

from learner import checkpoint
from services import jobs
from services.config import ModelSpec, OfflineJob
from services.queues import Keys

pytestmark = pytest.mark.slow
KEEP = 2


@pytest.fixture(scope="module")
def learner(redis_url, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("state-learner")
    redis.Redis.from_url(redis_url).flushdb()
    env = {"TANDEM_KEEP_CHECKPOINTS": str(KEEP)}
    process = start_learner(redis_url, workdir / "runs", workdir / "learner.log", resume=False, env=env)
    yield SimpleNamespace(dir=workdir, runs=workdir / "runs", process=process)
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=60)


@pytest.fixture
def offline_job(tiny_model, tokenizer, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in asking_pairs(tokenizer, 10)))

    def spec(**train) -> OfflineJob:
        train = {"algorithm": "dpo", "data": str(pairs), "batch_size": 2, "lr": 1e-3} | train
        return OfflineJob(kind="offline", model=ModelSpec(path=str(tiny_model), max_model_len=512), train=train)

    return spec


def test_an_offline_job_keeps_only_its_newest_checkpoints(learner, redis_url, offline_job):
    job_id = create_job(redis_url, offline_job(num_steps=5, checkpoint_every=1))

    record = finish(redis_url, job_id, learner.dir)

    assert record["status"] == "SUCCEEDED", record["log"]
    assert checkpoint.steps(learner.runs, job_id) == [4, 5]
    listed = redis.Redis.from_url(redis_url).lrange(Keys.checkpoints(job_id), 0, -1)
    assert [json.loads(entry)["step"] for entry in listed] == [4, 5]


def test_a_cancelled_job_keeps_a_checkpoint_of_its_last_step_and_exports_its_policy(
    learner, redis_url, offline_job, tmp_path
):
    """Cancelled after two steps of 10,000 (milliseconds each: it cannot end first), with
    periodic checkpoints off: it ends CANCELLED with a checkpoint at the last step it
    trained, and `runs/<job>/policy` holds that checkpoint's policy."""
    client = redis.Redis.from_url(redis_url)
    job_id = create_job(redis_url, offline_job(num_steps=10_000, checkpoint_every=0))
    wait_for(lambda: client.llen(Keys.history(job_id)) >= 2, 120, "two steps")

    cancel(redis_url, job_id)
    record = finish(redis_url, job_id, learner.dir)

    assert record["status"] == "CANCELLED", record["log"]
    last_step = record["history"][-1]["step"]
    assert 2 <= last_step < 10_000
    assert checkpoint.steps(learner.runs, job_id) == [last_step]
    exported = load_file(learner.runs / job_id / "policy" / "model.safetensors")
    from_checkpoint = checkpoint.export(learner.runs, job_id, last_step, tmp_path / "from-checkpoint")
    expected = load_file(from_checkpoint / "model.safetensors")
    assert exported.keys() == expected.keys()
    assert all(exported[name].equal(expected[name]) for name in expected)


def test_a_cancel_whose_checkpoint_cannot_be_written_still_ends_cancelled_naming_the_failure(
    learner, redis_url, offline_job
):
    """A file where the job's checkpoints folder goes, so the cancel's checkpoint fails on
    every rank as on a full disk: the cancel, what the user asked for, still ends the job
    CANCELLED, its error says what could not be kept, and the learner lives on."""
    client = redis.Redis.from_url(redis_url)
    job_id = create_job(redis_url, offline_job(num_steps=10_000, checkpoint_every=0))
    wait_for(lambda: client.llen(Keys.history(job_id)) >= 2, 120, "two steps")
    (learner.runs / job_id / "checkpoints").write_text("")  # no periodic one is due for 1800 s

    cancel(redis_url, job_id)
    record = finish(redis_url, job_id, learner.dir)

    assert record["status"] == "CANCELLED", record["log"]
    assert "cancelled, but keeping its checkpoint or policy failed" in record["error"]
    assert "'save' failed" in record["error"]
    assert not (learner.runs / job_id / "policy").exists()
    assert learner.process.poll() is None


def test_redis_at_its_memory_cap_fails_the_job_by_name_and_the_learner_lives_on(learner, redis_url, offline_job):
    """Redis refuses every write that grows it (maxmemory below what it holds, nothing to
    evict): the step's record is refused, and so is the job's end, which the learner waits
    to write rather than crash and be restarted into the same refusal. With room made, the
    job ends FAILED naming maxmemory, its history has no step twice, the learner still runs."""
    client = redis.Redis.from_url(redis_url)
    job_id = create_job(redis_url, offline_job(num_steps=10_000, checkpoint_every=0))
    wait_for(lambda: client.llen(Keys.history(job_id)) >= 2, 120, "two steps")
    log = learner.dir / "learner.log"
    client.config_set("maxmemory", 1)
    try:
        wait_for(lambda: f"refused the end of job {job_id}" in log.read_text(), 60, "the learner to wait for room")
    finally:
        client.config_set("maxmemory", 0)
    record = finish(redis_url, job_id, learner.dir)

    assert record["status"] == "FAILED", record["log"]
    assert "Redis is full: at its memory cap (maxmemory)" in record["error"]
    steps = [h["step"] for h in record["history"]]
    assert steps == list(range(1, len(steps) + 1))
    assert learner.process.poll() is None


def cancel(redis_url: str, job_id: str) -> None:
    """Ask for the job's cancel, as the API does."""

    async def ask() -> None:
        async with aioredis.from_url(redis_url) as client:
            await jobs.cancel(client, job_id)

    asyncio.run(ask())
