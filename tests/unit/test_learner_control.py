"""The learner's control channel: follower ranks wait for rank 0's commands."""

from __future__ import annotations

import gc
import weakref

import torch
from ranks import run_two_ranks

from learner.control import Command, Worker
from services.config import LearnerSettings

RANK = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

rank, port = int(sys.argv[1]), sys.argv[2]
c10d.default_pg_timeout = timedelta(seconds=1)  # stands in for torch's 30-minute default
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
from learner.control import Command, Control

control = Control()
if rank == 0:
    time.sleep(3)  # no job queued: longer than the default timeout
    control.broadcast(Command(kind="shutdown"))
else:
    print("got", control.broadcast(None).kind, flush=True)
dist.barrier()  # both ranks done before either tears gloo down (an early exit can abort the other)
dist.destroy_process_group()
"""


def test_a_follower_waits_for_the_next_command_longer_than_the_default_group_timeout():
    outputs = run_two_ranks(RANK, timeout_s=60)
    assert "got shutdown" in outputs[1]


class Model:
    def __init__(self) -> None:
        self.hooks = [self]  # a reference cycle, as FSDP's hooks make one


def test_ending_a_job_frees_its_model_and_the_device_cache(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    worker = Worker(LearnerSettings(), torch.device("cpu"), control=None)
    worker.trainer = Model()
    model = weakref.ref(worker.trainer)
    gc.disable()
    try:
        worker.execute(Command(kind="end"))
        assert model() is None
    finally:
        gc.enable()
    assert emptied == [True]
