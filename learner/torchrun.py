"""torchrun, keeping how the learner's ranks ended: `python -m learner.torchrun ARGS` runs
`torch.distributed.run ARGS`.

A rank killed by the kernel's OOM killer or a signal cannot say why it died; torchrun,
its parent, reaps it and knows the exit status. When ranks fail, this writes their exit
statuses to `runs/<job>/learner-exit.json` for the job rank 0 was running (rank 0 names it
in the file `TANDEM_LEARNER_JOB_FILE` points at, `note_job`), so the restarted learner can
put the reason in the job's record (`take_exit`). Nothing is written when torchrun itself
dies with its ranks (a container killed whole, a lost machine): the record then says that
no exit status was recorded. Only rank 0's node writes, since only it knows the job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

JOB_FILE_ENV = "TANDEM_LEARNER_JOB_FILE"
EXIT_FILE = "learner-exit.json"
NO_EXIT_RECORDED = (
    "no exit status was recorded: torchrun died with its ranks (the whole learner killed, "
    "e.g. its container by the OOM killer) or the machine was lost"
)


class Failure(Protocol):
    """A failed rank as torchrun reports it (its `ProcessFailure`)."""

    @property
    def exitcode(self) -> int: ...


def describe_exit(rank: int, exitcode: int) -> str:
    """What an exit status says, and no more: `rank 1: killed by SIGKILL (...)`."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "(unknown)"
        why = " (exit 137; the kernel's OOM killer sends it, as does kill -9)" if name == "SIGKILL" else ""
        return f"rank {rank}: killed by signal {-exitcode} {name}{why}"
    return f"rank {rank}: exit {exitcode}"


def note_job(job_id: str) -> None:
    """Rank 0 runs `job_id` now ('' between jobs), for torchrun to know whose run folder
    its ranks' exit statuses go to. A no-op outside `learner.torchrun`."""
    path = os.environ.get(JOB_FILE_ENV)
    if path:
        Path(path).write_text(job_id)


def write_exit(runs_dir: Path, job_file: Path, failures: Mapping[int, Failure]) -> None:
    """Record the failed ranks' exit statuses for the job rank 0 last noted, if any."""
    job_id = job_file.read_text() if job_file.exists() else ""
    if not job_id:
        return
    reasons = [describe_exit(rank, failure.exitcode) for rank, failure in sorted(failures.items())]
    folder = runs_dir / job_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXIT_FILE).write_text(json.dumps({"time": time.time(), "reason": "; ".join(reasons)}))


def take_exit(runs_dir: str, job_id: str, not_before: float) -> str:
    """How the learner that last ran `job_id` ended, as torchrun recorded it after
    `not_before` (an older record belongs to an earlier run of the job), or
    NO_EXIT_RECORDED; the record is removed, so each exit is reported once. A record torn
    by its write (a full disk leaves it empty) is no exit recorded: left in place, every
    restarted learner would fail reading it before counting its restart, and loop."""
    path = Path(runs_dir) / job_id / EXIT_FILE
    if not path.exists():
        return NO_EXIT_RECORDED
    text = path.read_text()
    path.unlink()
    try:
        record = json.loads(text)
    except ValueError:
        return NO_EXIT_RECORDED
    return record["reason"] if record["time"] >= not_before else NO_EXIT_RECORDED


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from services.config import LearnerSettings

    with tempfile.TemporaryDirectory(prefix="tandem-learner-") as folder:
        job_file = Path(folder) / "job"
        os.environ[JOB_FILE_ENV] = str(job_file)
        try:
            torchrun(sys.argv[1:])
        except ChildFailedError as err:
            write_exit(Path(LearnerSettings().runs_dir), job_file, err.failures)
            raise


if __name__ == "__main__":
    main()
