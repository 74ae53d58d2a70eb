"""Learner entry point: `torchrun --nproc-per-node N -m learner`.

Rank 0 claims jobs from Redis and drives them; the other ranks follow its commands.
NCCL and CUDA when a GPU is present, gloo on CPU: the same code either way. A job found
RUNNING (this learner died or was stopped) continues from its newest checkpoint with
`--resume`, and is marked FAILED without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from datetime import timedelta


def choose_device(environ: dict[str, str], gpus: int):
    """This rank's device, given the environment and the GPUs torch sees: `cuda:LOCAL_RANK`,
    or the CPU when there are none and none were asked for. GPUs asked for
    (CUDA_VISIBLE_DEVICES) and not seen, or fewer than the ranks here, stop the learner
    with the reason: it would otherwise train on CPU, or two ranks would share a GPU,
    without a word."""
    import torch

    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ranks_here = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus == 0:
        if visible and visible != "-1":
            raise SystemExit(
                f"CUDA_VISIBLE_DEVICES={visible!r} names GPUs for the learner, but torch sees none: "
                "name GPUs this host has (compose: LEARNER_GPUS; `tandem placement` prints this host's plan), "
                "or unset it to train on CPU"
            )
        return torch.device("cpu")
    if gpus < ranks_here:
        raise SystemExit(
            f"{ranks_here} learner ranks on this host but {gpus} GPU(s) visible to them "
            f"(CUDA_VISIBLE_DEVICES={visible!r}): each rank needs its own GPU"
        )
    return torch.device("cuda", int(environ.get("LOCAL_RANK", "0")))


def main() -> None:
    import argparse

    from services.config import LearnerSettings
    from services.logs import setup_logging

    parser = argparse.ArgumentParser(prog="python -m learner")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue a job left RUNNING from its newest checkpoint (else it is failed)",
    )
    args = parser.parse_args()
    settings = LearnerSettings()
    if args.resume:
        settings.resume = True
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(settings.log_level, f"learner[{rank}]")
    if rank == 0:
        logging.getLogger(__name__).info("settings: %s", settings.loggable())

    import torch
    import torch.distributed as dist

    from learner.control import Command, Control, GroupBroken, RankLost, Worker
    from learner.driver import Driver

    device = choose_device(dict(os.environ), torch.cuda.device_count() if torch.cuda.is_available() else 0)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    logging.getLogger(__name__).info("rank %d trains on %s", rank, device)
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(seconds=settings.collective_timeout_s))
    worker = Worker(settings, device, Control())
    try:
        if rank == 0:
            driver = Driver(settings, worker)
            # torchrun forwards SIGTERM to every rank: rank 0 checkpoints and then tells the
            # others to shut down; they must not die in the middle of a collective.
            signal.signal(signal.SIGTERM, lambda *_: driver.request_stop())
            try:
                asyncio.run(driver.serve())
            except (GroupBroken, RankLost):
                # The job is FAILED with every rank's error (or, a rank killed, left RUNNING
                # to resume). The other ranks have left or wait in a collective that will
                # never end: no shutdown to send them, no group to destroy. Exit for torchrun
                # to tear them down and a supervisor to start the learner afresh.
                logging.getLogger(__name__).critical("the learner's ranks cannot go on together; exiting")
                logging.shutdown()
                os._exit(1)
            finally:
                worker.run(Command(kind="shutdown"))
        else:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            worker.follow()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
