"""Learner entry point: `torchrun --nproc-per-node N -m learner`.

Rank 0 claims jobs from Redis and drives them; the other ranks follow its commands.
NCCL and CUDA when a GPU is present, gloo on CPU: the same code either way.
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta


def main() -> None:
    from services.config import LearnerSettings
    from services.logs import setup_logging

    settings = LearnerSettings()
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(settings.log_level, f"learner[{rank}]")
    if rank == 0:
        logging.getLogger(__name__).info("settings: %s", settings.model_dump())

    import torch
    import torch.distributed as dist

    from learner.control import Command, Control, Worker
    from learner.driver import Driver

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(seconds=settings.collective_timeout_s))
    worker = Worker(settings, device, Control())
    try:
        if rank == 0:
            try:
                asyncio.run(Driver(settings, worker).serve())
            finally:
                worker.run(Command(kind="shutdown"))
        else:
            worker.follow()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
