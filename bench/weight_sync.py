"""Weight sync throughput: the bucketed sender vs one raw broadcast vs tensor by tensor.

One sender (the learner's rank 0 in the weight group) and N receivers (rollout engines)
on a gloo group over loopback, as in production on CPU. For each model size, three ways
to move the same bytes, each timed from the first byte to a barrier after the last:

  raw         one broadcast of a single flat tensor already holding every weight: the
              transport's ceiling, the baseline of the ratios (median over rounds of
              raw time / method time, each round timing all three back to back);
  bucketed    Tandem's path (`services.weight_group.send_buckets/receive_buckets`): named
              tensors packed into flat buckets (512 MiB), packing overlapped with sending;
  per-tensor  one broadcast per parameter, as per-parameter weight-update loops do.

Then the cost as servers grow: the raw and bucketed broadcasts of one model to 1, 2, 4 and
8 receivers, and two models fitted to the bucketed times by least squares,

  linear in N     t = a + b N         (the root sends the whole model to each receiver)
  linear in lg N  t = a + b log2(N)   (a tree: each hop doubles the receivers)

with the better fit's projection to 64 receivers. The baseline of that table is the
one-receiver broadcast of the same run (ratios t(N) / t(1)).

Run: python -m bench.weight_sync [--sizes-mb 100 1000] [--receivers 2] [--repeats 3]
       [--scaling-receivers 1 2 4 8] [--scaling-size-mb 200]
Writes weight_sync.json, and each measurement's raw timings, in `--out`
(bench/results/weight_sync).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.harness import common_args, out_folder, write_report
from services import weight_group
from tandem.redis_embed import free_port

TIMEOUT_S = 600.0
METHODS = ("raw", "bucketed", "per-tensor")


def model_shapes(target_bytes: int) -> list[tuple[str, list[int]]]:
    """A Llama-like float32 parameter list of about `target_bytes`: embeddings, then
    layers of attention (4 H x H) and MLP (3 H x 8H/3) matrices and norms."""
    hidden = 512 if target_bytes < 400e6 else 1024
    vocab = 8000 if hidden == 512 else 32000
    shapes = [("embed_tokens.weight", [vocab, hidden]), ("lm_head.weight", [vocab, hidden])]
    inner = hidden * 8 // 3
    layer = 0
    while sum(_numel(s) for _, s in shapes) * 4 < target_bytes:
        prefix = f"layers.{layer}."
        shapes += [(prefix + n, [hidden, hidden]) for n in ("q.weight", "k.weight", "v.weight", "o.weight")]
        shapes += [
            (prefix + "gate.weight", [inner, hidden]),
            (prefix + "up.weight", [inner, hidden]),
            (prefix + "down.weight", [hidden, inner]),
            (prefix + "norm.weight", [hidden]),
        ]
        layer += 1
    return shapes


def _numel(shape: list[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def worker(
    rank: int,
    world: int,
    port: int,
    size_bytes: int,
    repeats: int,
    bucket_mib: int,
    out: str,
    methods: tuple[str, ...] = METHODS,
) -> None:
    torch.set_num_threads(1)
    store = (
        weight_group.host_store(port, TIMEOUT_S)
        if rank == 0
        else weight_group.connect_store("127.0.0.1", port, TIMEOUT_S)
    )
    group = weight_group.open_group(store, "gloo", 1, rank, world, TIMEOUT_S)
    shapes = model_shapes(size_bytes)
    buckets = weight_group.plan_buckets([(n, s, "float32") for n, s in shapes], bucket_mib << 20)
    total = sum(b.nbytes for b in buckets)
    generator = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=generator) for n, s in shapes} if rank == 0 else None
    flat = torch.empty(total, dtype=torch.uint8).fill_(0)
    buffers: list = [None, None] if rank == 0 else []
    per_tensor = tensors if rank == 0 else {n: torch.empty(s) for n, s in shapes}
    timings: dict[str, list[float]] = {m: [] for m in methods}
    for repeat in range(repeats + 1):  # the first round warms buffers up and is not counted
        shift = repeat % len(methods)  # rotate the order: no method always runs first
        for method in methods[shift:] + methods[:shift]:
            group.barrier().wait()
            started = time.perf_counter()
            if method == "raw":
                weight_group.broadcast(group, flat, TIMEOUT_S)
            elif method == "bucketed" and rank == 0:
                weight_group.send_buckets(group, buckets, lambda b: tensors, TIMEOUT_S, torch.device("cpu"), buffers)
            elif method == "bucketed":
                weight_group.receive_buckets(group, buckets, TIMEOUT_S, torch.device("cpu"), buffers)
            else:
                for name, _ in shapes:
                    weight_group.broadcast(group, per_tensor[name], TIMEOUT_S)
            group.barrier().wait()
            if repeat:
                timings[method].append(time.perf_counter() - started)
    if rank == 0:
        Path(out).write_text(
            json.dumps({"bytes": total, "tensors": len(shapes), "buckets": len(buckets), "seconds": timings})
        )


def measure(
    size_mb: int, receivers: int, repeats: int, bucket_mib: int, tmp: Path, methods: tuple[str, ...] = METHODS
) -> dict:
    out = tmp / f"weight_sync_{size_mb}_{receivers}.json"
    port = free_port()
    world = receivers + 1
    mp.start_processes(
        worker,
        args=(world, port, size_mb * 10**6, repeats, bucket_mib, str(out), methods),
        nprocs=world,
        start_method="spawn",
    )
    result = json.loads(out.read_text())
    seconds = result["seconds"]
    rows = {}
    for method, times in seconds.items():
        median = statistics.median(times)
        # Paired: each round times every method back to back, so the ratio to the raw
        # broadcast of the same round cancels most of the machine's noise.
        ratios = [raw / t for raw, t in zip(seconds["raw"], times)]
        rows[method] = {
            "seconds": median,
            "gb_per_s": result["bytes"] / median / 1e9,
            "ratio_to_raw": statistics.median(ratios),
            "rounds": times,
        }
    return {
        "size_mb": size_mb,
        "bytes": result["bytes"],
        "tensors": result["tensors"],
        "buckets": result["buckets"],
        "methods": rows,
    }


def fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = a + b x; the coefficients and the root-mean-square residual."""
    n, mean_x, mean_y = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    a = mean_y - b * mean_x
    rms = math.sqrt(sum((a + b * x - y) ** 2 for x, y in zip(xs, ys)) / n)
    return {"a": a, "b": b, "rms_residual": rms}


def scaling(size_mb: int, receivers: list[int], repeats: int, bucket_mib: int, tmp: Path) -> dict:
    """Raw and bucketed broadcasts to each receiver count; both models fitted to the
    bucketed medians, and the better one's projection to 64 receivers."""
    runs = [measure(size_mb, n, repeats, bucket_mib, tmp, methods=("raw", "bucketed")) for n in receivers]
    times = [run["methods"]["bucketed"]["seconds"] for run in runs]
    models = {
        "linear in N": fit([float(n) for n in receivers], times),
        "linear in log2 N": fit([math.log2(n) for n in receivers], times),
    }
    best = min(models, key=lambda name: models[name]["rms_residual"])
    x64 = 64.0 if best == "linear in N" else 6.0
    return {
        "size_mb": size_mb,
        "bytes": runs[0]["bytes"],
        "receivers": receivers,
        "runs": runs,
        "models": models,
        "best": best,
        "projected_64_s": models[best]["a"] + models[best]["b"] * x64,
    }


def print_scaling(result: dict, cores: int) -> None:
    base = result["runs"][0]["methods"]["bucketed"]["seconds"]
    print(f"\nweight sync as receivers grow, {result['size_mb']} MB, gloo over loopback, {cores} CPU cores")
    print(f"{'receivers':>9} {'raw s':>8} {'bucketed s':>11} {'vs 1 receiver':>14} {'GB/s per receiver':>18}")
    for n, run in zip(result["receivers"], result["runs"]):
        raw, bucketed = run["methods"]["raw"]["seconds"], run["methods"]["bucketed"]["seconds"]
        print(
            f"{n:>9} {raw:>8.3f} {bucketed:>11.3f} {bucketed / base:>13.2f}x {result['bytes'] / bucketed / 1e9:>18.2f}"
        )
    for name, model in result["models"].items():
        print(f"  {name:>16}: t = {model['a']:.3f} + {model['b']:.3f} x  (rms residual {model['rms_residual']:.3f} s)")
    print(
        f"  best fit: {result['best']}; projected to 64 receivers on this transport: {result['projected_64_s']:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument(
        "--scaling-receivers",
        type=int,
        nargs="*",
        default=[1, 2, 4, 8],
        help="receiver counts of the scaling table (none: skip it)",
    )
    parser.add_argument("--scaling-size-mb", type=int, default=200)
    common_args(parser, "weight_sync", seeds=None)
    args = parser.parse_args()
    out = out_folder(args)
    results = [measure(size, args.receivers, args.repeats, args.bucket_mib, out) for size in args.sizes_mb]
    print(
        f"\nweight sync, gloo over loopback, 1 sender -> {args.receivers} receivers, "
        f"{os.cpu_count()} CPU cores, median of {args.repeats} rounds"
    )
    print(f"{'size':>8} {'tensors':>8} {'method':>11} {'seconds':>9} {'GB/s':>7} {'vs raw':>7}")
    for r in results:
        for method, row in r["methods"].items():
            print(
                f"{r['size_mb']:>6}MB {r['tensors']:>8} {method:>11} {row['seconds']:>9.3f} "
                f"{row['gb_per_s']:>7.2f} {row['ratio_to_raw']:>6.0%}"
            )
    scaled = None
    if args.scaling_receivers:
        scaled = scaling(args.scaling_size_mb, args.scaling_receivers, args.repeats, args.bucket_mib, out)
        print_scaling(scaled, os.cpu_count())
    report = {
        "receivers": args.receivers,
        "bucket_mib": args.bucket_mib,
        "cpu_cores": os.cpu_count(),
        "results": results,
        "scaling": scaled,
    }
    write_report("weight_sync", report, args)


if __name__ == "__main__":
    main()
