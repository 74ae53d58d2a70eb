"""A fingerprint of the learner's steps on a fixed batch, to show a refactor changed nothing.

Builds the tiny model, runs a warm-start (SFT) step and two RL steps (two minibatches each,
against a KL reference) on batches made from fixed seeds, on a gloo group of `--ranks` processes, and
prints every metric and a SHA-256 of the final parameters. Run it before and after a
change: the two outputs must be identical, digit for digit. `--check` compares with a
fingerprint kept from before (docs/results/learner_fingerprint.json was taken on a 2-core
AMD EPYC with AVX-512 and torch 2.13). The kernels torch picks depend on the CPU: on another
model the same code can differ in the last bits from the first step on, so take the before
and the after on one machine.

    python scripts/learner_fingerprint.py [--ranks 2] [--out F] [--check docs/results/learner_fingerprint.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fixed_samples(count: int, vocab: int, seed: int, tag: str):
    """`count` samples of 20-60 tokens, the second half trained, with made-up behaviour
    logprobs and advantages: the same on every run for the same seed."""
    from services.protocol import Sample

    rng = random.Random(seed)
    samples = []
    for i in range(count):
        length = rng.randint(20, 60)
        context = length // 2
        mask = [0] * context + [1] * (length - context)
        samples.append(
            Sample(
                sample_id=f"{tag}:{i}",
                tokens=[rng.randrange(3, vocab) for _ in range(length)],
                mask=mask,
                logprobs=[-rng.uniform(0.5, 4.0) * m for m in mask],
                versions=[0 if m else -1 for m in mask],
                reward=rng.random(),
                advantage=rng.uniform(-1, 1),
                num_turns=1,
            )
        )
    return samples


def run_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    from learner.trainer import Trainer
    from services.config import parse_job_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    spec = parse_job_spec(
        {
            "model": {"path": model},
            "warm_start": {"steps": 1, "lr": 1e-3},
            "train": {"lr": 1e-4, "kl_coef": 0.05, "num_minibatches": 2, "max_tokens_per_rank": 128, "seed": 3},
        }
    )
    trainer = Trainer(spec, torch.device("cpu"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    steps = {"sft": trainer.sft_step(fixed_samples(8, vocab, 1, "sft"))}
    trainer.start_rl()
    steps["rl_1"] = trainer.rl_step(fixed_samples(12, vocab, 2, "rl1"))
    steps["rl_2"] = trainer.rl_step(fixed_samples(12, vocab, 3, "rl2"))
    digest = hashlib.sha256()
    for name, parameter in sorted(trainer.model.state_dict().items()):
        full = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
        digest.update(name.encode() + full.detach().cpu().float().numpy().tobytes())
    if rank == 0:
        Path(out).write_text(json.dumps({"steps": steps, "parameters_sha256": digest.hexdigest()}, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the fingerprint here")
    parser.add_argument("--check", default=None, help="exit 1 unless the fingerprint equals this file's")
    args = parser.parse_args()
    from devtools.tiny_model import make_tiny_model
    from rollout.tasks import clarify

    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "model", clarify.corpus())
        result = Path(folder) / "fingerprint.json"
        mp.spawn(run_rank, args=(args.ranks, free_port(), str(model), str(result)), nprocs=args.ranks)
        text = result.read_text()
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.check:
        same = json.loads(Path(args.check).read_text()) == json.loads(text)
        print("identical to" if same else "DIFFERS from", args.check)
        raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
