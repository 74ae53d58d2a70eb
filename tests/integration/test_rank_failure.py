"""One learner rank raising inside a step (a CUDA OOM, a bug on one shard) fails the step at
once, naming that rank's error: the other rank does not wait out the collective timeout
(1800 s) inside FSDP's gathers, and the job's reason is not rank 0's timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from learner.control import rank_errors_dir
from learner.driver import Driver
from services import jobs
from services.config import LearnerSettings, ModelSpec, RLJob
from tandem.redis_embed import free_port

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("rank_failure_worker.py")
FAILS_WITHIN_S = 60.0
"""The issue's bound. Arithmetic: rank 1 waits ALL_FAILED_WAIT_S (5 s) for rank 0's error
file, then exits; rank 0's gather fails on the closed connection at once."""


def run_ranks(tiny_model: Path, tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "rank0.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(WORKER), str(tiny_model), str(out), mode]
    env = os.environ | {"TANDEM_RUNS_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(WORKER.parent)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=FAILS_WITHIN_S + 120)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads(out.read_text())


def test_a_rank_raising_mid_step_fails_the_step_within_a_minute_naming_that_ranks_error(tiny_model, tmp_path):
    result, got = run_ranks(tiny_model, tmp_path, "one")

    assert got["kind"] == "GroupBroken"
    assert got["seconds"] < FAILS_WITHIN_S
    first, then = "rank 1 failed in 'rl': RuntimeError: a bug on rank 1's shard", "; rank 0 failed in 'rl': "
    assert got["error"].startswith(first + then)
    assert result.returncode != 0  # torchrun reports the rank that left
    error_file = tmp_path / "runs" / "broken-0000aaaa" / "rank-errors" / "rank-1.txt"
    assert error_file.read_text() == "rank 1 failed in 'rl': RuntimeError: a bug on rank 1's shard"


def test_a_rank_killed_mid_step_is_a_lost_rank_not_a_job_failure_and_leaves_no_error_to_report(tiny_model, tmp_path):
    """The OOM killer or a lost node: no rank raised, so nothing fails the job; the learner
    exits at once for its supervisor, and the restarted learner resumes the job."""
    result, got = run_ranks(tiny_model, tmp_path, "killed")

    assert got["kind"] == "RankLost"
    assert got["seconds"] < FAILS_WITHIN_S
    assert got["error"].startswith("a learner rank left the group without an error")
    assert not list((tmp_path / "runs" / "broken-0000aaaa" / "rank-errors").glob("rank-*.txt"))


def test_a_command_every_rank_fails_fails_it_as_before_and_the_ranks_go_on_to_the_next_job(tiny_model, tmp_path):
    result, got = run_ranks(tiny_model, tmp_path, "all")

    assert got["kind"] == "CommandFailed"
    assert got["error"].startswith("command 'job' failed on rank 0: ")
    assert got["went_on"]
    assert result.returncode == 0, result.stderr[-3000:]


async def test_a_job_whose_rank_error_no_rank_0_reported_fails_with_it_instead_of_resuming(
    redis_client, redis_url, tmp_path
):
    """Under NCCL torchrun may tear rank 0 down before it reports: the restarted learner
    fails the job with the error the rank left, rather than resume into the same fault."""
    settings = LearnerSettings(redis_url=redis_url, runs_dir=str(tmp_path), resume=True)
    job_id = await jobs.create_job(redis_client, RLJob(name="torn", model=ModelSpec(path="/models/none")))
    await jobs.set_status(redis_client, job_id, jobs.JobStatus.RUNNING)
    folder = rank_errors_dir(settings.runs_dir, job_id)
    folder.mkdir(parents=True)
    (folder / "rank-1.txt").write_text("rank 1 failed in 'rl': OutOfMemoryError: CUDA out of memory")

    driver = Driver(settings, worker=None)
    await driver.run_job(job_id)
    await driver.redis.aclose()

    record = await jobs.get_job(redis_client, job_id)
    assert (record["status"], record["error"]) == (
        "FAILED",
        "rank 1 failed in 'rl': OutOfMemoryError: CUDA out of memory",
    )
    assert not list(folder.iterdir())  # reported: a later claim finds nothing to report again
