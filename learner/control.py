"""Rank 0 tells every learner rank what to do next; all ranks then do it together.

Rank 0 alone talks to Redis. Each command (build the trainer for a job, an SFT step, an
RL step, a weight sync...) is msgpack-encoded and broadcast over a gloo group (CPU
tensors, whatever the training backend). Every rank executes it and the ranks agree,
with an all-reduce, on whether it succeeded, so one failing rank fails the job on rank 0
instead of leaving the others blocked in a collective.
"""

from __future__ import annotations

import gc
import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Literal

import msgspec
import torch
import torch.distributed as dist

from learner import checkpoint
from learner.trainer import Trainer
from learner.weight_sender import WeightSender
from services.config import LearnerSettings, parse_job_spec_json
from services.protocol import Sample, WeightPlan

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=365)
"""How long a rank may wait for the next command. Followers idle in `broadcast` for as
long as no job is queued, so torch's 30-minute default would kill them; a dead rank 0
still ends the wait, since torchrun then tears down every rank."""


class Command(msgspec.Struct, kw_only=True):
    kind: Literal["job", "sft", "start_rl", "rl", "dpo", "sync", "save", "load", "export", "end", "shutdown"]
    job_id: str = ""
    spec_json: str = ""
    samples: list[Sample] = []
    plan: WeightPlan | None = None
    path: str = ""
    meta_json: str = ""


class CommandFailed(RuntimeError):
    pass


class Control:
    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.rank = dist.get_rank()

    def broadcast(self, command: Command | None) -> Command:
        """Rank 0 passes the command, the others None; every rank gets it back."""
        data = msgspec.msgpack.encode(command) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == 0
            else torch.empty(int(size), dtype=torch.uint8)
        )
        dist.broadcast(buf, src=0, group=self.group)
        return msgspec.msgpack.decode(buf.numpy().tobytes(), type=Command)

    def agree(self, ok: bool) -> bool:
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag) == 0


class Worker:
    """The per-rank state (trainer, weight sender) and what each command does to it."""

    def __init__(self, settings: LearnerSettings, device: torch.device, control: Control) -> None:
        self.settings = settings
        self.device = device
        self.control = control
        self.trainer: Trainer | None = None
        self.sender: WeightSender | None = None

    def run(self, command: Command) -> dict:
        """Rank 0: broadcast `command`, execute it here too, and fail if any rank failed."""
        self.control.broadcast(command)
        return self._execute_and_agree(command)

    def follow(self) -> None:
        """Ranks > 0: execute commands until `shutdown`."""
        while True:
            command = self.control.broadcast(None)
            try:
                self._execute_and_agree(command)
            except CommandFailed:
                pass  # rank 0 decides what happens next; it logged the failure
            if command.kind == "shutdown":
                return

    def _execute_and_agree(self, command: Command) -> dict:
        result, error = {}, None
        try:
            result = self.execute(command)
        except Exception as err:
            log.exception("rank %d: command %s failed", self.control.rank, command.kind)
            error = err
        if not self.control.agree(error is None):
            reason = f"{type(error).__name__}: {error}" if error else "see the other ranks' logs"
            raise CommandFailed(f"command {command.kind!r} failed on rank {self.control.rank}: {reason}")
        return result

    def execute(self, command: Command) -> dict:
        match command.kind:
            case "job":
                spec = parse_job_spec_json(command.spec_json)
                self.trainer = Trainer(spec, self.device)
                self.sender = WeightSender(
                    self.trainer,
                    command.job_id,
                    self.settings.weight_bucket_mib,
                    self.settings.weight_timeout_s,
                    self.settings.advertise_host,
                    self.settings.weight_store_port,
                )
                return {"can_pack": self.trainer.can_pack}
            case "sft":
                return self.trainer.sft_step(command.samples)
            case "start_rl":
                self.trainer.start_rl()
                return {}
            case "rl":
                return self.trainer.rl_step(command.samples)
            case "dpo":
                return self.trainer.dpo_step(command.samples)
            case "sync":
                return self.sender.send(command.plan)
            case "save":
                checkpoint.save(self.trainer, Path(command.path), json.loads(command.meta_json))
                return {}
            case "load":
                return checkpoint.load(self.trainer, Path(command.path))
            case "export":
                self.trainer.export(command.path)
                return {}
            case "end" | "shutdown":
                self.trainer = self.sender = None
                # The model sits in reference cycles (FSDP hooks): free it before the next
                # job loads its own, and hand its cached blocks back to the device.
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                return {}
        raise ValueError(f"unknown command {command.kind}")
