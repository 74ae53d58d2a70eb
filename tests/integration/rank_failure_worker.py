"""Two learner ranks under torchrun where rank 1 hits a bug inside an RL step, for
tests/integration/test_rank_failure.py: python -m torch.distributed.run ... this file.

Arguments: MODEL_DIR OUT.json. Rank 1's step raises before its first collective (as a
CUDA OOM or a bug on one shard would), while rank 0 is inside the step's collectives.
Rank 0 writes what it got ({"error", "seconds"}) to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from fsdp_step_worker import fixed_batch

from learner.control import Command, Control, GroupBroken, Worker
from services.config import LearnerSettings, ModelSpec, RLJob, TrainSpec


def fail_on_this_shard(samples) -> dict:
    raise RuntimeError("a bug on rank 1's shard")


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    settings = LearnerSettings()
    # The default collective timeout, as a learner runs with it: the failure must not wait it out.
    dist.init_process_group("gloo", timeout=timedelta(seconds=settings.collective_timeout_s))
    worker = Worker(settings, torch.device("cpu"), Control())
    spec = RLJob(name="broken", model=ModelSpec(path=model_dir), train=TrainSpec(lr=1e-3))
    if worker.control.rank != 0:
        command = worker.control.broadcast(None)  # the job
        worker._execute_and_agree(command)
        worker.trainer.rl_step = fail_on_this_shard
        worker.follow()
        return
    worker.run(Command(kind="job", job_id="broken-0000aaaa", spec_json=spec.model_dump_json()))
    started = time.monotonic()
    try:
        worker.run(Command(kind="rl", samples=fixed_batch(model_dir)))
        error = ""
    except GroupBroken as err:
        error = str(err)
    with open(out, "w") as f:
        json.dump({"error": error, "seconds": time.monotonic() - started}, f)
    os._exit(0)  # as the learner does: the group is broken, nothing to tear down


if __name__ == "__main__":
    main()
