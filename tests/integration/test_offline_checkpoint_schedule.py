"""When an offline job writes its periodic checkpoints, on real Redis with the ranks' work
stood in for (what is under test is the run's schedule, not the training): by time as an RL
job does (`train.checkpoint_every_s`), and a final one at the end."""

from __future__ import annotations

import json
from types import SimpleNamespace

from learner.control import Command
from learner.runs.offline import OfflineRun
from services.config import LearnerSettings, ModelSpec, OfflineJob

STEP_S = 1000.0
"""How long each stood-in training step takes, on the checkpoint clock."""


class TimedRanks:
    """The ranks' side of the commands: each DPO step takes `STEP_S` seconds of the run's
    checkpoint clock (moved back rather than waited for); every command is kept."""

    def __init__(self) -> None:
        self.run: OfflineRun | None = None
        self.commands: list[Command] = []

    def run_command(self, command: Command) -> dict:
        self.commands.append(command)
        if command.kind == "dpo":
            self.run.checkpoints.written_s -= STEP_S
            return {"loss": 0.5}
        return {}


async def test_an_offline_job_checkpoints_once_checkpoint_every_s_has_passed_and_at_its_end(
    redis_client, tiny_model, tmp_path
):
    """Steps of 1000 s, a checkpoint due every 1800 s and never by steps: after steps 2 and 4
    (2000 s after the last), then the final one after step 5."""
    pairs = tmp_path / "pairs.jsonl"
    row = {"context_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8], "chosen_score": 1.0, "rejected_score": 0.0}
    pairs.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    spec = OfflineJob(
        kind="offline",
        model=ModelSpec(path=str(tiny_model), max_model_len=512),
        train={"algorithm": "dpo", "data": str(pairs), "batch_size": 1, "num_steps": 5, "checkpoint_every_s": 1800.0},
    )
    ranks = TimedRanks()
    learner = SimpleNamespace(
        settings=LearnerSettings(runs_dir=str(tmp_path / "runs")),
        worker=SimpleNamespace(run=ranks.run_command),
        redis=redis_client,
        stop_requested=False,
    )
    ranks.run = OfflineRun(learner, "job-0123abcd", spec)

    await ranks.run.run()

    saved = [c.path for c in ranks.commands if c.kind == "save"]
    assert saved == [str(ranks.run.checkpoints.path(step)) for step in (2, 4, 5)]
