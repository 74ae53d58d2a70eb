"""One SGD step on 2 FSDP ranks (gloo) equals the same step on 1 rank, whatever the
partition of the batch into ranks and micro-batches (for DPO: of the pairs, after an SFT
step that moves the policy off its reference)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("fsdp_step_worker.py")


def run_step(tmp_path: Path, model: Path, ranks: int, cap: int, shuffle: int, kind: str) -> dict:
    out = tmp_path / f"{kind}-{ranks}-{cap}-{shuffle}.safetensors"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            str(WORKER),
            str(model),
            str(out),
            str(cap),
            str(shuffle),
            kind,
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return load_file(out)


def max_difference(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.mark.parametrize("kind", ["rl", "sft", "dpo"])
def test_two_ranks_take_the_same_step_as_one_whatever_the_partition(tmp_path, tiny_model, kind):
    initial = load_file(tiny_model / "model.safetensors")
    one_rank = run_step(tmp_path, tiny_model, ranks=1, cap=4096, shuffle=-1, kind=kind)
    two_ranks = run_step(tmp_path, tiny_model, ranks=2, cap=4096, shuffle=-1, kind=kind)
    # A small cap: several micro-batches per rank (a pair needs room for both its sequences);
    # shuffled: a different assignment to ranks.
    two_ranks_micro = run_step(tmp_path, tiny_model, ranks=2, cap=160 if kind == "dpo" else 64, shuffle=7, kind=kind)

    step = max_difference(one_rank, initial)
    assert step > 1e-4  # the step moved the weights
    # The worker steps by plain SGD, unclipped: each weight moves by lr times its gradient,
    # so a wrong loss scale over micro-batches or ranks (a factor 2: 0.5 * step) or one
    # token too many in the normaliser (~1e-2 * step) shows. The same sums in another order
    # differ only by fp32 rounding (u = 2^-24): the gradient's sums over ~370 tokens and two
    # ranks, within ~370 u = 2.2e-5 of the step, and each stored weight's own rounding, up to
    # 2 u |w| = 1.2e-7 for |w| <= 1 (the norms' weights), 1.6e-4 of the smallest step (rl's,
    # 7e-4). 1e-3 of the step is 5 times that worst case and at least 100 times what one
    # measures.
    bound = 1e-3 * step
    assert max_difference(one_rank, two_ranks) < bound
    assert max_difference(one_rank, two_ranks_micro) < bound
