"""The learner with one fault injected, for bench.chaos's learner-oom-batch: the rank
`TANDEM_CHAOS_KILL_RANK` SIGKILLs itself as it starts training RL step
`TANDEM_CHAOS_KILL_AT_STEP`, every time a learner trains that step (the kernel's OOM killer
on one batch: nothing is said, the rank is gone).

Run by torchrun in place of `-m learner` (same arguments): `torchrun ... -m
bench.chaos_learner --resume`, from the repo root (the ranks inherit bench.chaos's working
folder, where `bench` is found). The step a rank is on is counted from its commands: 0 at a
job's start, the checkpoint's step after a `load`, one more per `rl` command (one per
step). Fault injection for the bench only; the learner's own code has no such setting.
"""

from __future__ import annotations

import os
import signal

from learner import __main__ as entry
from learner.control import Command, Worker

KILL_AT_STEP = int(os.environ["TANDEM_CHAOS_KILL_AT_STEP"])
KILL_RANK = int(os.environ.get("TANDEM_CHAOS_KILL_RANK", "1"))
execute = Worker.execute


def execute_or_die(self: Worker, command: Command) -> dict:
    if command.kind == "job":
        self.chaos_step = 0
    if command.kind == "rl":
        self.chaos_step += 1
        if self.chaos_step == KILL_AT_STEP and self.control.rank == KILL_RANK:
            os.kill(os.getpid(), signal.SIGKILL)
    result = execute(self, command)
    if command.kind == "load":
        self.chaos_step = int(result["step"])
    return result


Worker.execute = execute_or_die

if __name__ == "__main__":
    entry.main()
