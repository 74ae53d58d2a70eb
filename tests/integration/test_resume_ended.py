"""An ended job resumed: a FAILED job (through the API) and a CANCELLED one (with `tandem
resume` against a real API process) go back to the queue, and the running learner
continues each from its step-3 checkpoint to the weights of a run never stopped (1e-6,
the same trained tasks, none twice). A newest checkpoint that does not load is set aside
and the one before it used, and the job's alerts say so.

The rollout side is test_resume's deterministic producer; the learner runs for real
under torchrun with 2 ranks. A module of its own: its learners must be the only ones
reading the job queue."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from helpers import Producer, create_job, rl_steps, start_learner, wait_for
from safetensors.torch import load_file
from test_resume import run_job

from services import jobs
from services.api.app import create_app
from services.config import ApiSettings, ModelSpec, RLJob, RolloutSpec, TrainSpec
from services.queues import Keys
from tandem.redis_embed import free_port

pytestmark = pytest.mark.slow
STEPS, BATCH, STOPPED_AT = 6, 2, 3


def status(client: redis.Redis, job_id: str) -> str:
    return client.hget(Keys.job(job_id), "status").decode()


class StoppedJob:
    """The 6-step job of test_resume, its producer answering only the first 3 steps' tasks,
    and a learner (without --resume) that has trained them and checkpointed step 3."""

    def __init__(self, redis_url: str, model: Path, tokenizer, workdir: Path) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.client.flushdb()
        spec = RLJob(
            model=ModelSpec(path=str(model), max_model_len=512),
            rollout=RolloutSpec(group_size=2, max_total_tokens=256),
            train=TrainSpec(num_steps=STEPS, batch_size=BATCH, max_staleness=0, lr=1e-3, checkpoint_every=3),
        )
        self.redis_url, self.job_id = redis_url, create_job(redis_url, spec)
        self.producer = Producer(redis_url, self.job_id, tokenizer, gate=BATCH * STOPPED_AT)
        self.producer.start()
        workdir.mkdir(parents=True, exist_ok=True)
        self.runs, self.log = workdir / "runs", workdir / "learner.log"
        self.learner = start_learner(redis_url, self.runs, self.log, resume=False)
        # step 0's checkpoint and step 3's: the learner then waits for tasks the producer holds
        wait_for(lambda: self.client.llen(Keys.checkpoints(self.job_id)) == 2, 180, "the step-3 checkpoint")

    def ended(self, tasks: int = BATCH * STEPS) -> dict:
        """The record once the job has ended, the producer answering tasks below `tasks`."""
        self.producer.gate = tasks
        wait_for(lambda: status(self.client, self.job_id) in jobs.TERMINAL, 300, "the job to end")
        return jobs.parse_record(self.client.hgetall(Keys.job(self.job_id)))

    def result(self) -> tuple[dict, list[int]]:
        tasks = [t for record in rl_steps(self.client, self.job_id) for t in record["task_ids"]]
        return load_file(self.runs / self.job_id / "policy" / "model.safetensors"), tasks

    def close(self) -> None:
        self.producer.stop.set()
        if self.learner.poll() is None:
            os.killpg(self.learner.pid, signal.SIGTERM)
            self.learner.wait(timeout=60)


def fail_by_restart(job: StoppedJob) -> None:
    """SIGTERM, then a learner started without --resume: it fails the job it finds RUNNING."""
    os.killpg(job.learner.pid, signal.SIGTERM)
    job.learner.wait(timeout=120)
    job.learner = start_learner(job.redis_url, job.runs, job.log, resume=False)
    wait_for(lambda: status(job.client, job.job_id) == "FAILED", 120, "the restarted learner to fail the job")


def resume_through_the_api(redis_url: str, job_id: str) -> httpx.Response:
    async def post() -> httpx.Response:
        app = create_app(ApiSettings(redis_url=redis_url))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as api:
            return await api.post(f"/v1/jobs/{job_id}/resume")

    return asyncio.run(post())


@pytest.fixture(scope="module")
def straight_run(redis_url, tiny_model, tokenizer, tmp_path_factory):
    straight, tasks, _ = run_job(redis_url, tiny_model, tokenizer, tmp_path_factory.mktemp("straight"), None)
    return straight, tasks


def assert_continued_exactly(straight_run, job: StoppedJob) -> None:
    straight, straight_tasks = straight_run
    resumed, tasks = job.result()
    assert tasks == straight_tasks
    assert len(tasks) == len(set(tasks)) == STEPS * BATCH
    assert max((straight[n] - resumed[n]).abs().max().item() for n in straight) < 1e-6


def test_a_failed_job_resumed_through_the_api_continues_from_its_checkpoint_exactly(
    straight_run, redis_url, tiny_model, tokenizer, tmp_path
):
    job = StoppedJob(redis_url, tiny_model, tokenizer, tmp_path)
    try:
        fail_by_restart(job)

        response = resume_through_the_api(redis_url, job.job_id)

        assert response.status_code == 200 and response.json()["status"] == "PENDING", response.text
        record = job.ended()
        assert record["status"] == "SUCCEEDED", job.log.read_text()[-3000:]
        assert (record["resumes"], record["resumed_from"]) == (1, "FAILED")
        assert "the learner restarted during this job" in record["resumed_error"]
    finally:
        job.close()
    assert_continued_exactly(straight_run, job)


def test_a_cancelled_job_resumed_with_tandem_resume_continues_from_its_checkpoint_exactly(
    straight_run, redis_url, tiny_model, tokenizer, tmp_path
):
    job = StoppedJob(redis_url, tiny_model, tokenizer, tmp_path)
    port = free_port()
    env = os.environ | {"TANDEM_REDIS_URL": redis_url, "TANDEM_PORT": str(port)}
    api = subprocess.Popen([sys.executable, "-m", "tandem.cli", "api"], env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: job_is_up(url), 60, "the API")
        asyncio.run(cancel(redis_url, job.job_id))
        wait_for(lambda: status(job.client, job.job_id) == "CANCELLED", 120, "the learner to end the job CANCELLED")

        resumed = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "resume", job.job_id, "--api", url],
            capture_output=True,
            text=True,
            timeout=60,
        )

        assert (resumed.returncode, resumed.stdout.strip()) == (0, "PENDING"), resumed.stderr
        record = job.ended()
        assert record["status"] == "SUCCEEDED", job.log.read_text()[-3000:]
        assert (record["resumes"], record["resumed_from"]) == (1, "CANCELLED")
        refused = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "resume", job.job_id, "--api", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 1 and "409" in refused.stderr and "SUCCEEDED" in refused.stderr
    finally:
        os.killpg(api.pid, signal.SIGTERM)
        api.wait(timeout=30)
        job.close()
    assert_continued_exactly(straight_run, job)


def job_is_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


async def cancel(redis_url: str, job_id: str) -> None:
    client = aioredis.from_url(redis_url)
    assert await jobs.cancel(client, job_id) == "RUNNING"
    await client.aclose()


def test_a_resumed_job_whose_newest_checkpoint_does_not_load_falls_back_to_the_one_before_and_says_so(
    redis_url, tiny_model, tokenizer, tmp_path
):
    """Step 3's shards torn: the job resumes from step 0 and trains 6 steps on new tasks
    (those of steps 1-3 were acknowledged and deleted), and its alerts say which checkpoint
    it used instead, and that this is not exact."""
    job = StoppedJob(redis_url, tiny_model, tokenizer, tmp_path)
    try:
        fail_by_restart(job)
        newest = job.runs / job.job_id / "checkpoints" / "step-000003"
        for shard in newest.glob("*.distcp"):
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

        assert resume_through_the_api(redis_url, job.job_id).status_code == 200
        record = job.ended(tasks=1_000)

        assert record["status"] == "SUCCEEDED", job.log.read_text()[-3000:]
        [alert] = record["alerts"]
        assert "resumed from the checkpoint at step 0, not the newest: step 3" in alert and "Not an exact" in alert
        assert [p.name.rsplit("-", 1)[0] for p in newest.parent.glob("corrupt-*")] == ["corrupt-step-000003"]
        assert [r["step"] for r in rl_steps(job.client, job.job_id)] == list(range(1, STEPS + 1))
    finally:
        job.close()
