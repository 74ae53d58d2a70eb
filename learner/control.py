"""Rank 0 tells every learner rank what to do next; all ranks then do it together.

Rank 0 alone talks to Redis. Each command (build the trainer for a job, an SFT step, an
RL step, a weight sync...) is msgpack-encoded and broadcast over a gloo group (CPU
tensors, whatever the training backend). Every rank executes it and the ranks agree,
with an all-reduce, on whether it succeeded.

With several ranks, a rank whose command raises cannot just go on to agree: the others
may be waiting for it inside a collective of the default group (FSDP's gathers, DCP), and
would wait there for the whole collective timeout. So it writes its error into the job's
run folder (`rank-errors/`); if every rank's error is there within seconds, they all
failed and agree as before. Otherwise it leaves: a follower exits at once, which breaks
the group (gloo peers fail their collective on the closed connection; under NCCL torchrun
tears the ranks down), and rank 0 raises `GroupBroken` for the driver to fail the job with
every rank's error before the learner exits for its supervisor to start it afresh. A rank-error
file that no rank 0 got to report (it was torn down first) fails the job when a restarted
learner claims it, instead of resuming into the same fault.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Literal, NoReturn

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

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


class GroupBroken(CommandFailed):
    """A command raised on a rank while the others may be inside a collective: the ranks
    cannot go on together. The message names every rank's error known to rank 0."""


class NoJob(RuntimeError):
    """A job's command came to a worker with no job: a `job` command builds the trainer and
    the weight sender, `end` drops them."""


class RankLost(CommandFailed):
    """A rank left the group without leaving an error (killed): nothing to fail the job
    with; the learner exits for its supervisor, and the restarted learner resumes."""


LOST_PEER_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
"""How a gloo collective reports a peer that vanished: the error is the group's, not this
rank's, and names no fault of the job. (Under NCCL torchrun tears the ranks down first.)"""


def is_lost_peer(error: BaseException) -> bool:
    return any(sign in str(error) for sign in LOST_PEER_SIGNS)


RANK_ERRORS = "rank-errors"
"""The folder in a job's run folder where a failing rank leaves its error."""
ALL_FAILED_WAIT_S = 5.0
"""How long a failing rank waits for every rank's error file before it takes the group for
broken (a failure every rank meets, a bad checkpoint, leaves them all at `agree`)."""


class Control:
    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

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
        self.job_id = ""
        """The job the commands are for (its run folder takes a failing rank's error)."""

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
        except (Exception, CheckpointException) as err:  # DCP's errors derive from BaseException
            log.exception("rank %d: command %s failed", self.control.rank, command.kind)
            if self.control.world_size > 1 and command.kind not in ("end", "shutdown"):
                self.report(command, err)
            error = err
        if not self.agree(error is None, command):
            reason = f"{type(error).__name__}: {error}" if error else "see the other ranks' logs"
            raise CommandFailed(f"command {command.kind!r} failed on rank {self.control.rank}: {reason}")
        return result

    def agree(self, ok: bool, command: Command) -> bool:
        """Whether every rank succeeded; a rank that left the group (it failed and took the
        group for broken) breaks it here too."""
        try:
            return self.control.agree(ok)
        except RuntimeError as err:
            self.leave(command, err)

    def leave(self, command: Command, error: BaseException) -> NoReturn:
        """The group is broken. A follower exits. Rank 0 raises `GroupBroken` with every
        rank's error left in the run folder, its own last; or `RankLost` when no other rank
        left one and its own error is the broken connection: a peer died without a word
        (the OOM killer, a lost node), and a restarted learner resumes the job."""
        if self.control.rank != 0:
            logging.shutdown()
            os._exit(1)
        folder = rank_errors_dir(self.settings.runs_dir, self.job_id)
        found = rank_errors(folder)
        others = [m for m in found if not m.startswith("rank 0 ")]
        if not others and is_lost_peer(error):
            (folder / "rank-0.txt").unlink(missing_ok=True)  # not a fault of this job's to report
            raise RankLost(f"a learner rank left the group without an error ({type(error).__name__}: {error})")
        if len(others) == len(found):  # the agree broke: rank 0's first error
            found.append(f"rank 0 failed in {command.kind!r}: {type(error).__name__}: {error}")
        raise GroupBroken("; ".join(sorted(found, key=lambda m: m.startswith("rank 0 ")))) from error

    def report(self, command: Command, error: BaseException) -> None:
        """This rank's `command` raised. Leave the error for rank 0 and see whether every
        rank failed it too: then all of them are at `agree`, and the job fails as usual.
        Otherwise some rank may be waiting in a collective for this one: break the group
        (a follower exits; rank 0 raises `GroupBroken` with every rank's error)."""
        rank, folder = self.control.rank, rank_errors_dir(self.settings.runs_dir, self.job_id)
        message = f"rank {rank} failed in {command.kind!r}: {type(error).__name__}: {error}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank-{rank}.txt").write_text(message[:4000])
        if len(wait_for_rank_errors(folder, self.control.world_size, ALL_FAILED_WAIT_S)) < self.control.world_size:
            self.leave(command, error)

    def execute(self, command: Command) -> dict:
        match command.kind:
            case "job":
                self.job_id = command.job_id
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
                return self.job_trainer().sft_step(command.samples)
            case "start_rl":
                self.job_trainer().start_rl()
                return {}
            case "rl":
                return self.job_trainer().rl_step(command.samples)
            case "dpo":
                return self.job_trainer().dpo_step(command.samples)
            case "sync":
                if command.plan is None:
                    raise ValueError("a sync command carries the weight plan")
                return self.job_sender().send(command.plan)
            case "save":
                checkpoint.save(self.job_trainer(), Path(command.path), json.loads(command.meta_json))
                return {}
            case "load":
                return checkpoint.load(self.job_trainer(), Path(command.path))
            case "export":
                self.job_trainer().export(command.path)
                return {}
            case "end" | "shutdown":
                if self.sender is not None:
                    self.sender.close()
                self.trainer = self.sender = None
                # The model sits in reference cycles (FSDP hooks): free it before the next
                # job loads its own, and hand its cached blocks back to the device.
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                return {}
        raise ValueError(f"unknown command {command.kind}")

    def job_trainer(self) -> Trainer:
        """The current job's trainer."""
        if self.trainer is None:
            raise NoJob("no trainer: no job command came before this one")
        return self.trainer

    def job_sender(self) -> WeightSender:
        """The current job's weight sender."""
        if self.sender is None:
            raise NoJob("no weight sender: no job command came before this one")
        return self.sender


def rank_errors_dir(runs_dir: str, job_id: str) -> Path:
    return Path(runs_dir) / (job_id or "no-job") / RANK_ERRORS


def rank_errors(folder: Path) -> list[str]:
    """The errors failing ranks left in `folder`, by rank. A file its rank could not write
    (a full disk leaves it empty) says that much, not nothing."""
    return [
        path.read_text() or f"{path.stem.replace('-', ' ')} failed; its error could not be written (a full disk?)"
        for path in sorted(folder.glob("rank-*.txt"))
    ]


def wait_for_rank_errors(folder: Path, count: int, timeout_s: float) -> list[str]:
    """The errors ranks left in `folder`, once `count` are there or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while len(found := rank_errors(folder)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return found
