"""Two learner steps under torchrun, with a checkpoint between them, for the multi-node tests.

Arguments: MODEL_DIR OUT_DIR CHECKPOINT LOAD(0|1).
LOAD=0: step 1, write `after-1.safetensors`, checkpoint to CHECKPOINT, step 2.
LOAD=1: restore CHECKPOINT (written by any number of nodes and ranks), step 2.
Either way the full parameters after step 2 go to `after-2.safetensors` (rank 0). The steps
are RL steps on fixed batches, so every layout of ranks must land on the same weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from learner import checkpoint
from learner.trainer import Trainer
from services.config import ModelSpec, RLJob, TrainSpec

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_step_worker import fixed_batch  # noqa: E402


def save_params(trainer: Trainer, path: Path) -> None:
    params = {name: p.detach().full_tensor().contiguous() for name, p in trainer.model.named_parameters()}
    if dist.get_rank() == 0:
        save_file(params, path)


def main() -> None:
    model_dir, out, ckpt, load = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1"
    dist.init_process_group("gloo")
    spec = RLJob(model=ModelSpec(path=model_dir), train=TrainSpec(lr=1e-3, max_tokens_per_rank=4096))
    trainer = Trainer(spec, torch.device("cpu"))
    first = fixed_batch(model_dir)
    # Another batch: the same sequences in reverse order, their advantages turned over.
    second = [msgspec.structs.replace(s, advantage=-s.advantage) for s in reversed(first)]
    if load:
        checkpoint.load(trainer, ckpt)
    else:
        trainer.rl_step(first)
        save_params(trainer, out / "after-1.safetensors")
        checkpoint.save(trainer, ckpt, {"step": 1})
    trainer.rl_step(second)
    save_params(trainer, out / "after-2.safetensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
