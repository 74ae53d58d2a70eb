"""Two learner ranks under torchrun meeting a failure, for tests/integration/test_rank_failure.py:
python -m torch.distributed.run ... this file MODEL_DIR OUT.json MODE.

MODE `one`: rank 1's RL step raises before its first collective (as a CUDA OOM or a bug on
one shard would) while rank 0 is inside the step's collectives. MODE `killed`: rank 1 is
SIGKILLed there instead (the OOM killer), leaving no error. MODE `all`: every rank fails
to build the job's trainer (no such model), then both go on to the next job.
Rank 0 writes what it got ({"error", "kind", "seconds", "went_on"}) to OUT.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from fsdp_step_worker import fixed_batch

from learner.control import Command, CommandFailed, Control, Worker
from services.config import LearnerSettings, ModelSpec, RLJob, TrainSpec


def fail_on_this_shard(samples) -> dict:
    raise RuntimeError("a bug on rank 1's shard")


def killed_on_this_shard(samples) -> dict:
    os.kill(os.getpid(), signal.SIGKILL)


def job(job_id: str, model_dir: str) -> Command:
    spec = RLJob(name="broken", model=ModelSpec(path=model_dir), train=TrainSpec(lr=1e-3))
    return Command(kind="job", job_id=job_id, spec_json=spec.model_dump_json())


def main() -> None:
    model_dir, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    settings = LearnerSettings()
    # The default collective timeout, as a learner runs with it: the failure must not wait it out.
    dist.init_process_group("gloo", timeout=timedelta(seconds=settings.collective_timeout_s))
    worker = Worker(settings, torch.device("cpu"), Control())
    if worker.control.rank != 0:
        if mode in ("one", "killed"):
            worker._execute_and_agree(worker.control.broadcast(None))  # the job
            worker.trainer.rl_step = fail_on_this_shard if mode == "one" else killed_on_this_shard
        worker.follow()
        return
    # As the learner's rank 0: torchrun's SIGTERM (sent when another rank dies) only asks it to stop.
    signal.signal(signal.SIGTERM, lambda *_: None)
    started, error, went_on = time.monotonic(), None, False
    try:
        if mode in ("one", "killed"):
            worker.run(job("broken-0000aaaa", model_dir))
            started = time.monotonic()
            worker.run(Command(kind="rl", samples=fixed_batch(model_dir)))
        else:
            worker.run(job("broken-0000aaaa", "/no/such/model"))
    except CommandFailed as err:
        error = err
    seconds = time.monotonic() - started
    if mode == "all":  # the ranks are still together: the next job runs
        worker.run(job("next-0000bbbb", model_dir))
        went_on = True
        worker.run(Command(kind="shutdown"))
    with open(out, "w") as f:
        json.dump({"error": str(error), "kind": type(error).__name__, "seconds": seconds, "went_on": went_on}, f)
    if mode == "all":
        dist.destroy_process_group()
        return
    os._exit(0)  # as the learner does: the group is broken, nothing to tear down


if __name__ == "__main__":
    main()
