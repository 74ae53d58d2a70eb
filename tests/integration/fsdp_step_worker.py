"""One learner step under torchrun, for tests: python -m torch.distributed.run ... this file.

Arguments: MODEL_DIR OUT.safetensors MAX_TOKENS_PER_RANK SHUFFLE_SEED(-1 = none) KIND(rl|sft|dpo).
Builds a fixed batch from the clarify task, optionally shuffles it (another partition),
takes one optimizer step and writes the full parameters (rank 0). For dpo, consecutive
samples form pairs (chosen, rejected) and a shuffle moves whole pairs.
"""

from __future__ import annotations

import math
import random
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoTokenizer

from learner.trainer import Trainer
from rollout.tasks import clarify
from services.config import ModelSpec, RLJob, TrainSpec
from services.protocol import Sample
from services.tokenization import ChatTokenizer


def fixed_batch(model_dir: str) -> list[Sample]:
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(model_dir))
    rng = random.Random(0)
    samples = []
    for i, messages in enumerate(clarify.demonstrations(12, seed=3, ask_share=0.5)):
        tokens, mask = chat.encode_demonstration(messages)
        behaviour = [rng.uniform(-4.0, -0.5) if m else 0.0 for m in mask]
        samples.append(
            Sample(
                sample_id=str(i),
                tokens=tokens,
                mask=mask,
                logprobs=behaviour,
                versions=[0 if m else -1 for m in mask],
                reward=0.0,
                advantage=rng.choice([-1.0, -0.5, 0.5, 1.0]),
                num_turns=1,
            )
        )
    return samples


def plain_sgd(trainer: Trainer) -> None:
    """The trainer's AdamW swapped for plain SGD, so that (with no clipping) the step is the
    learning rate times the gradient. AdamW's first step is about lr * sign(gradient): it
    would hide a wrong scale of the gradient, which is what a wrong normalisation gives."""
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=trainer.spec.train.lr)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)


def main() -> None:
    model_dir, out, cap, shuffle, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo")
    algorithm = "dpo" if kind == "dpo" else "grpo"
    spec = RLJob(
        model=ModelSpec(path=model_dir),
        train=TrainSpec(lr=0.1, max_grad_norm=math.inf, max_tokens_per_rank=cap, algorithm=algorithm, dpo_beta=0.5),
    )
    trainer = Trainer(spec, torch.device("cpu"))
    plain_sgd(trainer)
    samples = fixed_batch(model_dir)
    if kind == "dpo":
        trainer.start_rl()  # the reference: a frozen copy of the starting policy
        plain_sgd(trainer)
        # An SFT step first moves the policy off the reference, so that the DPO step's
        # log ratios are not all 0 and the reference's logprobs matter.
        trainer.sft_step(samples)
        pairs = [samples[i : i + 2] for i in range(0, len(samples), 2)]
        if shuffle >= 0:
            random.Random(shuffle).shuffle(pairs)
        trainer.dpo_step([s for pair in pairs for s in pair])
    else:
        if shuffle >= 0:
            random.Random(shuffle).shuffle(samples)
        (trainer.rl_step if kind == "rl" else trainer.sft_step)(samples)
    params = {name: p.detach().full_tensor().contiguous() for name, p in trainer.model.named_parameters()}
    if dist.get_rank() == 0:
        save_file(params, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
