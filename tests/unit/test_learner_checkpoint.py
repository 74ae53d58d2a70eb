"""Checkpoints: complete only with meta.json, and never rewritten in place once complete."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from learner import checkpoint


@pytest.fixture
def trainer(process_group):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, reference=None, rank=0)


def test_saving_again_at_a_complete_step_replaces_only_its_meta(trainer, tmp_path, monkeypatch):
    path = checkpoint.checkpoint_dir(tmp_path, "j", 3)
    checkpoint.save(trainer, path, {"step": 3, "counts": {"stale_dropped": 0}})
    saved = trainer.model.weight.detach().clone()

    def torn(*args, **kwargs):
        raise RuntimeError("killed while rewriting the shards under the old meta.json")

    monkeypatch.setattr(checkpoint.dcp, "save", torn)
    checkpoint.save(trainer, path, {"step": 3, "counts": {"stale_dropped": 2}})

    monkeypatch.undo()
    with torch.no_grad():
        trainer.model.weight.zero_()
    assert checkpoint.latest(tmp_path, "j") == path
    assert checkpoint.load(trainer, path)["counts"] == {"stale_dropped": 2}
    assert torch.equal(trainer.model.weight, saved)


def test_pruning_keeps_the_newest_complete_checkpoints_and_drops_torn_older_ones(tmp_path):
    def folder(step: int, complete: bool):
        path = checkpoint.checkpoint_dir(tmp_path, "job-1", step)
        path.mkdir(parents=True)
        (path / "shard.distcp").write_bytes(b"x")
        if complete:
            (path / checkpoint.META).write_text("{}")
        return path

    steps = {0: True, 5: True, 7: False, 10: True, 15: True, 20: False}  # 20: a save in progress
    paths = {step: folder(step, complete) for step, complete in steps.items()}

    removed = checkpoint.prune(tmp_path, "job-1", keep=2)

    assert removed == [paths[0], paths[5], paths[7]]
    assert sorted(p.name for p in paths[0].parent.iterdir()) == ["step-000010", "step-000015", "step-000020"]
    assert checkpoint.latest(tmp_path, "job-1") == paths[15]
    assert checkpoint.prune(tmp_path, "job-1", keep=2) == []
