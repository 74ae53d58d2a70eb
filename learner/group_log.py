"""Every trajectory group the learner decided on, one JSON line each.

`groups.jsonl` in the job's run folder says, per group: what was decided (trained, dropped
as over-stale, a duplicate, refused as invalid), at which learner version, how old its
tokens were, when it was dispatched and how long it took, and what it held (its rewards and
the means of its samples' task metrics, such as clarify's `asked`). These records are what
shows whether lateness and content go together: which groups come late, which are dropped
and whether dropping them skews what the learner trains on (`bench/async_groups.py`).

A resumed job first cuts the file back to its size at the checkpoint it resumes from
(`written_bytes`, kept in the checkpoint's meta): groups decided after it are decided, and
recorded, again, so each decision shows once. Records are written once per batch: a crash
or a stop loses those of the batch being collected, whose groups come again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from services import protocol
from services.stats import mean_by_key

DECISIONS = ("trained", "stale", "duplicate", "invalid")


def group_record(group: protocol.TrajectoryGroup, decision: str, version: int, arrived_s: float) -> dict:
    """The record of `group`, decided on (`decision`) while the learner was at `version`,
    `arrived_s` seconds after RL began."""
    rewards = [s.reward for s in group.samples] or [0.0]
    oldest = group.min_version()
    return {
        "task_id": group.task_id,
        "decision": decision,
        "learner_version": version,
        "dispatched_version": group.dispatched_version,
        "behaviour_version": oldest,
        "staleness": None if oldest is None else version - oldest,
        "elapsed_s": group.elapsed_s,
        "arrived_s": arrived_s,
        "server_id": group.server_id,
        "samples": len(group.samples),
        "reward_mean": sum(rewards) / len(rewards),
        "reward_spread": max(rewards) - min(rewards),
        "metrics": mean_by_key([s.metrics for s in group.samples]),
        **reward_sources(group.samples),
    }


def reward_sources(samples: list[protocol.Sample]) -> dict[str, list[dict[str, str]]]:
    """The distinct `reward_source`s of a batch (models, rubric digest, seed), if any."""
    distinct = sorted({tuple(sorted(s.reward_source.items())) for s in samples if s.reward_source})
    return {"reward_sources": [dict(source) for source in distinct]} if distinct else {}


class GroupLog:
    """Group records for `run_dir/groups.jsonl`, kept until `flush` (once per batch, so a
    batch costs one file write); times are from `start()`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "groups.jsonl"
        self.started = time.monotonic()
        self.pending: list[str] = []

    def start(self) -> None:
        self.started = time.monotonic()

    def write(self, group: protocol.TrajectoryGroup, decision: str, version: int) -> None:
        assert decision in DECISIONS, decision
        self.pending.append(json.dumps(group_record(group, decision, version, time.monotonic() - self.started)))

    def written_bytes(self) -> int:
        """The file's size: the records of every batch collected so far (what a checkpoint
        taken now covers; the pending ones are of a batch not yet trained)."""
        return self.path.stat().st_size if self.path.exists() else 0

    def trim(self, size_bytes: int) -> None:
        """Cut the file back to `size_bytes` (a checkpoint's `written_bytes`), dropping the
        records of groups decided after that checkpoint."""
        if self.path.exists():
            with open(self.path, "r+b") as f:
                f.truncate(size_bytes)

    def flush(self) -> None:
        if self.pending:
            with open(self.path, "a") as f:
                f.write("\n".join(self.pending) + "\n")
            self.pending = []


def read(path: Path) -> list[dict]:
    """The records of a `groups.jsonl`."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
