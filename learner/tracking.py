"""Experiment trackers a job's numbers also go to (the spec's `tracking`), from rank 0.

Each history record (a warm-start, RL, offline or generate step, a held-out evaluation) goes
to every tracker as scalars under its phase (`rl/reward_mean`, `eval/success`), against the
phase's own step (`sft_step` for the warm start, `step` for the rest), so the warm start's
steps and the RL steps do not collide. The spec is the run's config; each held-out round adds
a table of some of its conversations.

Both write into the job's run folder and need no network: TensorBoard's event files
(`runs/<job>/tensorboard`, torch's writer) and a W&B run (`runs/<job>/wandb`) in offline mode
unless the spec asks for online and the API allowed it. The W&B run's id is the job id, so a
resumed job goes on in the same run. A tracker that fails is closed and named in the log and
the job's alerts; the job goes on without it (its numbers are in the history regardless).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Literal

from services.config import TrackingSpec

log = logging.getLogger(__name__)

STEP_OF = {"sft": "sft_step"}
"""A phase's step counter in its records, where it is not `step`."""


def phase_step(record: dict) -> tuple[str, int]:
    phase = record.get("phase", "rl")
    return phase, int(record.get(STEP_OF.get(phase, "step"), 0))


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers (not flags, lists or nested records), under its phase."""
    phase, _ = phase_step(record)
    return {
        f"{phase}/{name}": float(value)
        for name, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and name != "time"
    }


def conversation_text(conversation: list[dict]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in conversation)


class TensorBoardSink:
    def __init__(self, folder: Path, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```")

    def log(self, record: dict) -> None:
        _, step = phase_step(record)
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def conversations(self, step: int, rows: list[dict]) -> None:
        lines = ["| example | trial | success | conversation |", "|---|---|---|---|"]
        for row in rows:
            text = conversation_text(row["conversation"]).replace("|", "\\|").replace("\n", "<br>")
            lines.append(f"| {row['example']} | {row['trial']} | {row['success']:.2f} | {text} |")
        self.writer.add_text("eval/conversations", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(
        self, folder: Path, config: dict, project: str, mode: Literal["offline", "online"], job_id: str
    ) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(
            project=project,
            dir=str(folder),
            mode=mode,
            config=config,
            name=job_id,
            id=job_id,
            resume="allow",
            settings=wandb.Settings(disable_git=True, x_disable_stats=True, console="off"),
        )
        for phase in ("sft", "rl", "offline", "generate", "eval"):
            counter = f"{phase}/{STEP_OF.get(phase, 'step')}"
            self.run.define_metric(counter)
            self.run.define_metric(f"{phase}/*", step_metric=counter)

    def log(self, record: dict) -> None:
        self.run.log(scalars(record))

    def conversations(self, step: int, rows: list[dict]) -> None:
        table = self.wandb.Table(columns=["step", "example", "trial", "success", "conversation"])
        for row in rows:
            table.add_data(step, row["example"], row["trial"], row["success"], conversation_text(row["conversation"]))
        self.run.log({"eval/conversations": table, "eval/step": step})

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The job's trackers (none when its spec sets no `tracking`)."""

    def __init__(self, spec: TrackingSpec | None, run_dir: Path, job_id: str, config: dict) -> None:
        self.spec, self.run_dir, self.job_id, self.config = spec, run_dir, job_id, config
        self.sinks: list = []
        self.failures: list[str] = []
        """Why a tracker stopped, for the job's alerts (taken by whoever reports them)."""
        self.opened = False

    @property
    def conversations_kept(self) -> int:
        return self.spec.conversations if self.spec else 0

    def open(self) -> None:
        """Open the trackers the spec asks for (once, at the first record)."""
        self.opened, spec = True, self.spec
        if spec is None:
            return
        if spec.tensorboard:
            self.guarded(
                "TensorBoard", lambda: self.sinks.append(TensorBoardSink(self.run_dir / "tensorboard", self.config))
            )
        if spec.wandb is not None:
            wandb = spec.wandb
            self.guarded(
                "W&B",
                lambda: self.sinks.append(WandbSink(self.run_dir, self.config, wandb.project, wandb.mode, self.job_id)),
            )

    def log(self, record: dict) -> None:
        if not self.opened:
            self.open()
        for sink in list(self.sinks):
            self.guarded(type(sink).__name__, lambda: sink.log(record), sink)

    def conversations(self, step: int, rows: list[dict]) -> None:
        for sink in list(self.sinks):
            self.guarded(type(sink).__name__, lambda: sink.conversations(step, rows), sink)

    def take_failures(self) -> list[str]:
        failures, self.failures = self.failures, []
        return failures

    def close(self) -> None:
        for sink in self.sinks:
            self.guarded(type(sink).__name__, sink.close)
        self.sinks = []

    def guarded(self, name: str, call, sink=None) -> None:
        """`call()`; a failure drops `sink` (if any) and is kept for the job's alerts."""
        try:
            call()
        except Exception as err:  # a tracker must not take the job down: its numbers are in the history
            log.exception("job %s: tracker %s failed; the job goes on without it", self.job_id, name)
            self.failures.append(f"tracker {name} stopped: {type(err).__name__}: {err}"[:500])
            if sink is not None and sink in self.sinks:
                self.sinks.remove(sink)
