"""Length-balanced partitioning vs round-robin, on long-tailed conversation lengths.

1. Balance: for many batches of lognormal lengths, max-rank tokens / mean-rank tokens
   when sequences go to ranks round-robin vs by Karmarkar-Karp (`learner.batching`).
2. Throughput: learner tokens/s of real RL steps (FSDP2, 2 ranks, gloo, the tiny model)
   on the same batches with each split, one micro-batch per rank, measured in the same
   run (ratio = balanced / round-robin). The step takes as long as the slowest rank.

Run: python -m bench.learner_balance [--steps 6] [--batch 64]; writes learner_balance.json in
`--out` (bench/results/learner_balance).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import REPO, common_args, write_report
from learner import batching

MU, SIGMA, MIN_LEN, MAX_LEN = 5.0, 1.0, 16, 1000


def lognormal_lengths(n: int, rng: random.Random) -> list[int]:
    return [min(MAX_LEN, max(MIN_LEN, int(rng.lognormvariate(MU, SIGMA)))) for _ in range(n)]


def balance_table(batches: int, batch: int) -> list[dict]:
    rows = []
    for dp in (2, 8):
        rng = random.Random(dp)
        samples = [lognormal_lengths(batch, rng) for _ in range(batches)]
        row = {"dp": dp, "batch": batch}
        for name, split in (("round_robin", batching.round_robin), ("balanced", batching.karmarkar_karp)):
            values = [batching.imbalance(lengths, split(lengths, dp)) for lengths in samples]
            row[name] = {"mean": statistics.mean(values), "max": max(values)}
        rows.append(row)
    return rows


def throughput(steps: int, batch: int, model_dir: Path) -> dict:
    """Run the torchrun worker (this module with --worker) once per split; tokens/s each."""
    results = {}
    for split in ("round_robin", "balanced"):
        out = Path(tempfile.mkdtemp()) / "result.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "-m",
                "bench.learner_balance",
                "--worker",
                split,
                str(model_dir),
                str(out),
                str(steps),
                str(batch),
            ],
            check=True,
            capture_output=True,
            cwd=REPO,
        )
        results[split] = json.loads(out.read_text())
    results["speedup"] = results["balanced"]["tokens_per_s"] / results["round_robin"]["tokens_per_s"]
    return results


def worker(split: str, model_dir: str, out: str, steps: int, batch: int) -> None:
    import torch
    import torch.distributed as dist

    from learner.micro_batch import Collator
    from learner.trainer import Trainer
    from services.config import ModelSpec, RLJob, TrainSpec
    from services.protocol import Sample

    dist.init_process_group("gloo")
    spec = RLJob(
        model=ModelSpec(path=model_dir, max_model_len=1024),
        rollout={"max_total_tokens": 1024},
        # One micro-batch per rank for both splits: with a tighter cap the unbalanced
        # split would need more, shorter rows, and on CPU a packed row's attention
        # (dense block-diagonal mask) costs the square of its length.
        train=TrainSpec(max_tokens_per_rank=65536, lr=1e-4),
    )

    trainer = Trainer(spec, torch.device("cpu"))
    if split == "round_robin":  # the baseline: sequences dealt to ranks and micro-batches round-robin
        trainer.batches = Collator(
            trainer.rank,
            trainer.world_size,
            spec.train.max_tokens_per_rank,
            trainer.can_pack,
            trainer.device,
            split=batching.round_robin,
        )
    rng = random.Random(0)
    vocab = trainer.model.config.vocab_size
    batches = []
    for _ in range(steps + 1):
        samples = []
        for i, length in enumerate(lognormal_lengths(batch, rng)):
            prompt = max(1, length // 4)
            samples.append(
                Sample(
                    sample_id=str(i),
                    tokens=[rng.randrange(vocab) for _ in range(length)],
                    mask=[0] * prompt + [1] * (length - prompt),
                    logprobs=[-2.0] * length,
                    versions=[0] * length,
                    reward=0.0,
                    advantage=rng.choice([-1.0, 1.0]),
                    num_turns=1,
                )
            )
        batches.append(samples)
    trainer.rl_step(batches[0])  # warm-up, not timed
    dist.barrier()
    started = time.perf_counter()
    for samples in batches[1:]:
        trainer.rl_step(samples)
    dist.barrier()
    seconds = time.perf_counter() - started
    tokens = sum(len(s.tokens) for samples in batches[1:] for s in samples)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--balance-batches", type=int, default=200)
    common_args(parser, "learner_balance", seeds=None)
    args = parser.parse_args()
    from devtools.tiny_model import make_tiny_model
    from rollout.tasks import clarify

    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", clarify.corpus())
    balance = balance_table(args.balance_batches, args.batch)
    speed = throughput(args.steps, args.batch, model_dir)
    print(f"\nlognormal(mu={MU}, sigma={SIGMA}) lengths in [{MIN_LEN}, {MAX_LEN}], {args.batch} sequences per batch")
    print(
        f"{'ranks':>5} {'round-robin max/mean':>21} {'balanced max/mean':>18} "
        f"{'(worst of ' + str(args.balance_batches) + ')':>16}"
    )
    for row in balance:
        print(
            f"{row['dp']:>5} {row['round_robin']['mean']:>21.3f} {row['balanced']['mean']:>18.3f} "
            f"{row['round_robin']['max']:>8.3f} / {row['balanced']['max']:.3f}"
        )
    print(
        f"\nlearner throughput, 2 ranks (FSDP2 + gloo, tiny model, {os.cpu_count()} CPU cores), {args.steps} RL steps"
    )
    for split in ("round_robin", "balanced"):
        r = speed[split]
        print(f"{split:>12}: {r['tokens_per_s']:>9.0f} tokens/s ({r['tokens']} tokens in {r['seconds']:.2f}s)")
    print(f"{'speed-up':>12}: {speed['speedup']:.2f}x")
    write_report("learner_balance", {"balance": balance, "throughput": speed, "cpu_cores": os.cpu_count()}, args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
