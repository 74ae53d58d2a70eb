"""Checkpoints: complete only with meta.json, and never rewritten in place once complete."""

from __future__ import annotations

import os
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


def test_the_commit_marker_is_flushed_to_disk_then_renamed_and_its_folder_flushed(trainer, tmp_path, monkeypatch):
    """A power loss right after `save` must not leave a meta.json that names shards or an
    RNG file still in the page cache, nor lose the meta's rename: every file of the
    checkpoint is flushed, then the meta's folder and the folder holding it."""
    flushed: list[int] = []  # inodes, in the order os.fsync saw them
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.fstat(fd).st_ino), real_fsync(fd))[1])
    path = checkpoint.checkpoint_dir(tmp_path, "j", 3)

    checkpoint.save(trainer, path, {"step": 3})

    inode = {p: p.stat().st_ino for p in [*path.iterdir(), path, path.parent]}
    assert set(inode.values()) <= set(flushed), sorted(p.name for p in inode if inode[p] not in flushed)
    assert flushed.index(inode[path / checkpoint.META]) < flushed.index(inode[path]) < flushed.index(inode[path.parent])
    assert sorted(p.name for p in path.iterdir() if p.name.endswith(".tmp")) == []


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


def test_a_step_zero_checkpoint_leaves_training_bit_for_bit_as_without_one(tiny_model, process_group, tmp_path):
    """A save before the first step, and a resume from it, must not touch the optimizer:
    torch's `get_state_dict` gives an AdamW that has not stepped a state by stepping it on
    zero gradients, which would make the first real update AdamW's second (0.742x as large
    at betas 0.9, 0.99) and shift the bias correction of every step after it."""
    from test_numeric_guards import batch, parameters

    from learner.trainer import Trainer
    from services.config import ModelSpec, RLJob, TrainSpec

    spec = RLJob(model=ModelSpec(path=str(tiny_model)), train=TrainSpec(lr=0.01, seed=3))
    path = checkpoint.checkpoint_dir(tmp_path, "j", 0)

    def trained(before_the_first_step) -> dict[str, torch.Tensor]:
        trainer = Trainer(spec, torch.device("cpu"))
        trainer.start_rl()
        before_the_first_step(trainer)
        trainer.rl_step(batch())
        trainer.rl_step(batch(advantage=-0.5))
        return parameters(trainer)

    straight = trained(lambda trainer: None)
    saved = trained(lambda trainer: checkpoint.save(trainer, path, {"step": 0}))
    resumed = trained(lambda trainer: checkpoint.load(trainer, path))

    for name, parameter in straight.items():
        assert torch.equal(saved[name], parameter), name
        assert torch.equal(resumed[name], parameter), name
