"""Attention over one packed row on this machine: which way of keeping sequences apart is
fastest, forward and backward, for one layer of SmolLM2-135M's shape (9 query heads, 3
key/value heads, head dim 64).

  mask     transformers' sdpa on a packed row: one SDPA call with a dense block-diagonal
           causal mask over the whole row (the learner's path before `train.packing`);
  varlen   `learner.attention.varlen_attention`, the learner's path: on CPU causal SDPA
           per sequence, sequences of similar length batched into one call;
  per_sequence  the same with one call for every sequence (no batching);
  padded   the sequences padded to the longest inside attention, one batched causal call
           (what capping or padding rows costs in attention);
  flex     torch's flex attention with a block mask, compiled; recorded with its error
           where this torch cannot run it (no backward on CPU in torch 2.13).

Rows are 4096 tokens: uniform (4 x 1024, 8 x 512, 16 x 256) and mixed (one long and many
short). Each cell is the median of `--repeats` timed calls after one untimed call; the
baseline is `mask` on the same row in the same run, and the table gives its time over each
method's (above 1: faster than the dense mask). Every method's output is checked against
`mask`'s.

Run: python -m bench.packed_attention [--repeats 5] [--publish]; writes packed_attention.json
in `--out` (bench/results/packed_attention), and with `--publish` in docs/results/ too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench.harness import common_args, write_report
from learner import attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
ROWS = {
    "4 x 1024": [1024] * 4,
    "8 x 512": [512] * 8,
    "16 x 256": [256] * 16,
    "1 x 2048 + 16 x 128": [2048] + [128] * 16,
    "1 x 3072 + 16 x 64": [3072] + [64] * 16,
}


def inputs(lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """query [1, H, T, D], key and value [1, Hkv, T, D] (requiring grad) and position ids [1, T]."""
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(1, HEADS, total, HEAD_DIM, generator=generator).requires_grad_()
    k, v = (torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=generator).requires_grad_() for _ in range(2))
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    return q, k, v, positions


def block_causal_mask(lengths: list[int]) -> torch.Tensor:
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    total = sum(lengths)
    return (seq[:, None] == seq[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()


def repeat_kv(x: torch.Tensor) -> torch.Tensor:
    return x.repeat_interleave(HEADS // KV_HEADS, dim=1)


def methods(lengths: list[int]) -> dict:
    """name -> (q, k, v, positions) -> [1, T, H, D]."""
    mask = block_causal_mask(lengths)

    def dense(q, k, v, positions):
        out = F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask[None, None])
        return out.transpose(1, 2)

    def varlen(q, k, v, positions):
        return attention.varlen_attention(None, q, k, v, None, position_ids=positions)[0]

    def per_sequence(q, k, v, positions):
        grouping, attention.GROUP_SLACK = attention.GROUP_SLACK, 0.0
        try:
            return varlen(q, k, v, positions)
        finally:
            attention.GROUP_SLACK = grouping

    def padded(q, k, v, positions):
        longest = max(lengths)
        bounds = attention.sequence_bounds(positions[0], sum(lengths)).tolist()

        def rows(x):
            return torch.stack([F.pad(x[0, :, a:b], (0, 0, 0, longest - (b - a))) for a, b in zip(bounds, bounds[1:])])

        out = F.scaled_dot_product_attention(rows(q), rows(repeat_kv(k)), rows(repeat_kv(v)), is_causal=True)
        return torch.cat([out[i, :, :n] for i, n in enumerate(lengths)], dim=1)[None].transpose(1, 2)

    def flex(q, k, v, positions):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        blocks = create_block_mask(
            lambda b, h, i, j: (seq[i] == seq[j]) & (i >= j), None, None, sum(lengths), sum(lengths), device="cpu"
        )
        out = torch.compile(flex_attention)(q, repeat_kv(k), repeat_kv(v), block_mask=blocks)
        return out.transpose(1, 2)

    return {"mask": dense, "varlen": varlen, "per_sequence": per_sequence, "padded": padded, "flex": flex}


def timed(method, args: tuple, repeats: int) -> tuple[float, torch.Tensor]:
    """Median seconds of forward + backward, and the output."""

    def once() -> torch.Tensor:
        for x in args[:3]:
            x.grad = None
        out = method(*args)
        out.float().square().sum().backward()
        return out.detach()

    out = once()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        once()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), out


def measure(repeats: int) -> dict:
    table = {}
    for name, lengths in ROWS.items():
        args = inputs(lengths)
        row, reference = {}, None
        for method_name, method in methods(lengths).items():
            try:
                seconds, out = timed(method, args, repeats)
            except Exception as error:  # noqa: BLE001 - a method this torch cannot run is a result
                row[method_name] = {"error": str(error).splitlines()[0][:160]}
                continue
            reference = out if reference is None else reference
            row[method_name] = {"seconds": seconds, "max_abs_error": float((out - reference).abs().max())}
        base = row["mask"]["seconds"]
        for cell in row.values():
            if "seconds" in cell:
                cell["speedup_over_mask"] = base / cell["seconds"]
        table[name] = {"lengths": lengths, "tokens": sum(lengths), "sum_sq_over_row_sq": sq_share(lengths)} | row
    return table


def sq_share(lengths: list[int]) -> float:
    """Attention work a per-sequence path needs, as a share of the dense row's."""
    return sum(n * n for n in lengths) / sum(lengths) ** 2


def print_table(table: dict) -> None:
    names = ("mask", "varlen", "per_sequence", "padded", "flex")
    print(f"\nattention fwd+bwd, one layer, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}, {os.cpu_count()} cores, fp32")
    print(f"{'row':>22} {'sum s^2/T^2':>12} " + " ".join(f"{n:>14}" for n in names))
    for row_name, row in table.items():
        cells = []
        for n in names:
            cell = row[n]
            cells.append(
                "n/a" if "error" in cell else f"{cell['seconds'] * 1e3:.0f}ms x{cell['speedup_over_mask']:.2f}"
            )
        print(f"{row_name:>22} {row['sum_sq_over_row_sq']:>12.3f} " + " ".join(f"{c:>14}" for c in cells))
    errors = {n: row[n]["error"] for row in table.values() for n in names if "error" in row[n]}
    for n, error in errors.items():
        print(f"{n}: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    common_args(parser, "packed_attention", seeds=None)
    args = parser.parse_args()
    table = measure(args.repeats)
    print_table(table)
    report = {
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "rows": table,
    }
    write_report("packed_attention", report, args)


if __name__ == "__main__":
    main()
