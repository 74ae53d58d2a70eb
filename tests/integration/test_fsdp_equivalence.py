"""One optimizer step on 2 FSDP ranks (gloo) equals the same step on 1 rank, whatever the
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

    assert max_difference(one_rank, initial) > 1e-4  # the step moved the weights
    assert max_difference(one_rank, two_ranks) < 1e-5
    assert max_difference(one_rank, two_ranks_micro) < 1e-5
