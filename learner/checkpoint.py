"""Sharded checkpoints that make a resumed job continue exactly where it stopped.

`runs/<job>/checkpoints/step-000003/` holds the FSDP shards of the policy, the optimizer
(and the KL reference if any) written by torch.distributed.checkpoint, each rank's RNG
state, and `meta.json` (written last, by rank 0): step, version, scheduler, dispatcher
cursor, trained task ids and counters. A checkpoint without `meta.json` is incomplete and
ignored. Trajectories trained since the previous checkpoint stay unacknowledged in Redis
until this one is complete, so after a crash they are delivered again, in stream order,
and retrained from the restored state: the resumed run trains what the uninterrupted run
would have.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from learner import durable
from learner.trainer import Trainer

META = "meta.json"
SPEC = "job.json"
"""The job's spec, beside its checkpoints (runs/<job>/job.json)."""


def checkpoint_dir(runs_dir: str | Path, job_id: str, step: int) -> Path:
    return Path(runs_dir) / job_id / "checkpoints" / f"step-{step:06d}"


def steps(runs_dir: str | Path, job_id: str) -> list[int]:
    """Steps of a job's complete checkpoints, oldest first."""
    root = Path(runs_dir) / job_id / "checkpoints"
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*") if (p / META).exists())


def latest(runs_dir: str | Path, job_id: str) -> Path | None:
    """The newest complete checkpoint of a job, if any."""
    complete = steps(runs_dir, job_id)
    return checkpoint_dir(runs_dir, job_id, complete[-1]) if complete else None


def prune(runs_dir: str | Path, job_id: str, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints of a job, and any incomplete one
    older than the newest complete (a save a kill cut short); the deleted folders, oldest
    first. A job resumes from the newest, so older ones only fill the disk."""
    newest = latest(runs_dir, job_id)
    if newest is None:
        return []
    folders = sorted(newest.parent.glob("step-*"))
    complete = [p for p in folders if (p / META).exists()]
    doomed = [p for p in folders if p < newest and (p not in complete or p in complete[:-keep])]
    for path in doomed:
        (path / META).unlink(missing_ok=True)  # first, so a kill mid-way leaves it incomplete, never torn
        shutil.rmtree(path)
    return doomed


def _state(trainer: Trainer, with_optimizer: bool) -> dict:
    """The state dicts a checkpoint holds; the optimizer's only `with_optimizer`.

    An optimizer that has not stepped yet has no state, and none is saved for it (meta
    `optimizer_state` false): torch's `get_state_dict` would make one by stepping it on zero
    gradients, turning AdamW's first real update into its second (0.742x as large at betas
    0.9, 0.99) and shifting its bias correction for tens of steps after."""
    model, optim = get_state_dict(trainer.model, trainer.optimizer if with_optimizer else [])
    state = {"model": model} | ({"optim": optim} if with_optimizer else {})
    if trainer.reference is not None:
        state["reference"], _ = get_state_dict(trainer.reference, [])
    return state


def save(trainer: Trainer, path: Path, meta: dict) -> None:
    """All ranks: write the shards and RNG; rank 0 then writes meta.json, the commit marker,
    atomically and durably (temp file, fsync, rename, folder fsync; DCP syncs its shards).

    A checkpoint already complete at this step (a stop right after a scheduled checkpoint)
    holds exactly the current state, since only a training step changes it: only its meta
    is replaced. Rewriting its shards in place, a kill could leave them torn under the old
    meta.json; removing that first would make a kill fall back to an older checkpoint
    whose trained groups this one has already acknowledged."""
    with_optimizer = bool(trainer.optimizer.state)  # the same on every rank: all step together
    if not (path / META).exists():
        path.mkdir(parents=True, exist_ok=True)
        dcp.save(_state(trainer, with_optimizer), checkpoint_id=str(path))
        rng = path / f"rng-{trainer.rank}.safetensors"
        save_file({"cpu": torch.get_rng_state()}, rng)
        durable.fsync(rng)
    dist.barrier()
    if trainer.rank == 0:
        meta = meta | {"scheduler": trainer.scheduler.state_dict(), "optimizer_state": with_optimizer}
        durable.write_text(path / META, json.dumps(meta))
        durable.fsync(path.parent)  # the step folder's own entry
    dist.barrier()


def load(trainer: Trainer, path: Path) -> dict:
    """All ranks: restore shards, optimizer (left fresh when the checkpoint was written
    before its first step), reference, RNG and scheduler; returns the meta."""
    meta = json.loads((path / META).read_text())
    with_optimizer = meta.get("optimizer_state", True)
    state = _state(trainer, with_optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        trainer.model,
        trainer.optimizer if with_optimizer else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    if trainer.reference is not None:
        set_state_dict(trainer.reference, [], model_state_dict=state["reference"], optim_state_dict={})
    # Resumed on more ranks than wrote the checkpoint (a learner on more nodes): the new
    # ranks take rank 0's generator; the training step itself draws no random numbers.
    rng = path / f"rng-{trainer.rank}.safetensors"
    torch.set_rng_state(load_file(rng if rng.exists() else path / "rng-0.safetensors")["cpu"])
    trainer.scheduler.load_state_dict(meta["scheduler"])
    return meta


def export(runs_dir: str | Path, job_id: str, step: int, out_dir: Path) -> Path:
    """The policy of a job's complete checkpoint at `step` as a Hugging Face folder at
    `out_dir`, in one process (no process group): the model the job names in `job.json`,
    its parameters replaced by the checkpoint's, saved as the learner exports."""
    from transformers import AutoModelForCausalLM

    from learner.policy import save_hf_folder
    from services.config import parse_job_spec_json

    path = checkpoint_dir(runs_dir, job_id, step)
    if not (path / META).exists():
        have = ", ".join(map(str, steps(runs_dir, job_id))) or "none"
        raise FileNotFoundError(
            f"job {job_id} has no complete checkpoint at step {step} under {runs_dir} (complete checkpoints: {have})"
        )
    spec = parse_job_spec_json((Path(runs_dir) / job_id / SPEC).read_text())
    model = AutoModelForCausalLM.from_pretrained(spec.model.local_folder(), dtype=torch.float32)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    save_hf_folder(model, state["model"], spec.model.path, out_dir)
    return out_dir
