"""The trackers a job's records go to, read back by each tracker's own reader: scalars under
their phase against the phase's own step, the spec as config, held-out conversations as a
table; a tracker that fails is named and dropped while the others go on."""

from __future__ import annotations

from trackers import tensorboard_scalars, tensorboard_texts, wandb_run

from learner.tracking import Trackers
from services.config import TrackingSpec

RECORDS = [
    {"phase": "sft", "sft_step": 1, "loss": 2.0, "time": 1.0},
    {"phase": "sft", "sft_step": 2, "loss": 1.5, "time": 2.0},
    {"phase": "rl", "step": 1, "version": 1, "reward_mean": 0.25, "task_ids": [0, 1], "complete": True},
    {"phase": "eval", "step": 0, "success": 0.5, "pass^2": 0.25, "complete": True},
    {"phase": "rl", "step": 2, "version": 2, "reward_mean": 0.75},
]
ROWS = [{"example": 3, "trial": 0, "success": 1.0, "conversation": [{"role": "user", "content": "a fruit | please"}]}]


def test_records_and_conversations_read_back_from_tensorboard_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: nothing here may reach a server
    spec = TrackingSpec(tensorboard=True, wandb={"project": "tandem-test"})
    trackers = Trackers(spec, tmp_path, "job-0123abcd", {"name": "job", "train": {"lr": 0.001}})
    for record in RECORDS:
        trackers.log(record)
    trackers.conversations(0, ROWS)
    trackers.close()
    assert trackers.take_failures() == []

    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["sft/loss"] == [(1, 2.0), (2, 1.5)]
    assert scalars["rl/reward_mean"] == [(1, 0.25), (2, 0.75)]
    assert scalars["eval/success"] == [(0, 0.5)] and scalars["eval/pass^2"] == [(0, 0.25)]
    assert not any(tag.endswith(("/time", "/complete", "/task_ids")) for tag in scalars)
    [(step, table)] = tensorboard_texts(tmp_path / "tensorboard", "eval/conversations")
    assert step == 0 and "user: a fruit \\| please" in table

    config, rows = wandb_run(tmp_path)
    assert config["train"] == {"lr": 0.001} and config["name"] == "job"
    rl = [(r["rl/step"], r["rl/reward_mean"]) for r in rows if "rl/reward_mean" in r]
    assert rl == [(1, 0.25), (2, 0.75)]
    assert [(r["eval/step"], r["eval/success"]) for r in rows if "eval/success" in r] == [(0, 0.5)]
    [table] = [r for r in rows if "eval/conversations/_type" in r]
    assert table["eval/conversations/_type"] == "table-file" and table["eval/conversations/nrows"] == 1


def test_a_failing_tracker_is_named_and_dropped_and_the_others_go_on(tmp_path):
    trackers = Trackers(TrackingSpec(tensorboard=True), tmp_path, "job-0123abcd", {})
    trackers.log(RECORDS[0])

    class Broken:
        def log(self, record):
            raise OSError("disk full")

    trackers.sinks.append(Broken())
    trackers.log(RECORDS[1])
    trackers.log(RECORDS[2])
    trackers.close()

    assert trackers.take_failures() == ["tracker Broken stopped: OSError: disk full"]
    assert tensorboard_scalars(tmp_path / "tensorboard")["rl/reward_mean"] == [(1, 0.25)]


def test_no_tracking_writes_nothing(tmp_path):
    trackers = Trackers(None, tmp_path, "job-0123abcd", {})
    trackers.log(RECORDS[2])
    trackers.close()
    assert list(tmp_path.iterdir()) == []
