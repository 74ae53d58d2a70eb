"""Two vLLM engines on one CPU: how many OpenMP threads each should have.

A judge-bound job on one machine runs two engines at once: the policy's (the rollout
server) and a served model playing simulator and judge (`tandem serve-model`). Each CPU
engine starts a thread per core, and OpenMP threads spin while they wait for the others.
Two such engines on the same cores slow each other far more than twofold. This benchmark
serves SmolLM2-135M-Instruct twice and times one stream of sampled tokens per engine,
first on each engine alone, then on both at once, for each setting:

  all-cores  vLLM's default: OpenMP threads on every core (the baseline's setting);
  threads=1  `tandem serve-model --threads 1`: one OpenMP thread per engine;
  passive    every core, but OMP_WAIT_POLICY=PASSIVE: waiting threads sleep, not spin.

The baseline is one all-cores engine alone, measured in the same run; every cell is a
ratio to it (median over repeats), with tokens/s beside it. Two engines sharing the cores
fairly would each run at about 0.5 of it.

Needs the model (`tandem model get smollm2-135m-instruct models/smollm2-135m-instruct`).
Run: python -m bench.shared_cpu_engines [--repeats 3] [--tokens 128] [--publish]
Writes shared_cpu_engines.json and the engines' logs in `--out`
(bench/results/shared_cpu_engines); `--publish` copies the report into docs/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.harness import REPO, common_args, out_folder, write_report
from tandem.launcher import served_model

MODEL = REPO / "models" / "smollm2-135m-instruct"
SETTINGS = {"all-cores": ({}, 0), "threads=1": ({}, 1), "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 0)}
"""name: (environment of both servers, --threads)."""


def tokens_per_s(url: str, tokens: int) -> float:
    """One completion of exactly `tokens` sampled tokens (end-of-text ignored)."""
    started = time.monotonic()
    reply = httpx.post(
        f"{url}/v1/completions",
        timeout=600,
        json={
            "model": "m",
            "prompt": "Tell me a long story about a lighthouse keeper.",
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 1.0,
        },
    )
    reply.raise_for_status()
    return tokens / (time.monotonic() - started)


def together(urls: list[str], tokens: int) -> list[float]:
    """Each engine's tokens/s while both generate at once."""
    rates = [0.0] * len(urls)

    def one(i: int) -> None:
        rates[i] = tokens_per_s(urls[i], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rates


@contextlib.contextmanager
def two_engines(environment: dict, threads: int, logs: Path):
    """Two servers of the model under `environment`, started one after the other."""
    with (
        served_model(MODEL, "m", logs / "a.log", threads=threads, env=environment) as a,
        served_model(MODEL, "m", logs / "b.log", threads=threads, env=environment) as b,
    ):
        yield [a, b]


def measure(name: str, args, logs: Path) -> dict:
    environment, threads = SETTINGS[name]
    alone, both = [], []
    with two_engines(environment, threads, logs) as urls:
        for url in urls:
            tokens_per_s(url, 8)  # first request: warm-up
        for _ in range(args.repeats):
            alone += [tokens_per_s(url, args.tokens) for url in urls]
            both += together(urls, args.tokens)
    return {"setting": name, "threads": threads, "environment": environment, "alone": alone, "together": both}


def table(rows: list[dict], baseline: float) -> str:
    lines = [
        f"baseline: one all-cores engine alone, {baseline:.1f} tokens/s",
        "",
        "| setting | one engine alone | each of two at once | two at once, together |",
        "|---|---|---|---|",
    ]
    for r in rows:
        alone, each = statistics.median(r["alone"]), statistics.median(r["together"])
        lines.append(
            f"| {r['setting']} | {alone / baseline:.2f} ({alone:.1f} tok/s) | "
            f"{each / baseline:.2f} ({each:.1f} tok/s) | {2 * each / baseline:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="all-cores is always measured: the baseline")
    common_args(parser, "shared_cpu_engines", seeds=None)
    args = parser.parse_args()
    if not MODEL.is_dir():
        sys.exit(f"no model at {MODEL}: tandem model get smollm2-135m-instruct {MODEL}")
    logs = out_folder(args) / "logs"
    logs.mkdir(exist_ok=True)
    rows = []
    names = ["all-cores"] + [n for n in args.settings.split(",") if n != "all-cores"]
    for name in names:
        print(f"{name}: starting two engines", file=sys.stderr, flush=True)
        rows.append(measure(name, args, logs))
    baseline = statistics.median(rows[0]["alone"])
    print(table(rows, baseline))
    settings = vars(args) | {"out": str(args.out)}
    report = {"settings": settings, "cpus": os.cpu_count(), "baseline_tokens_per_s": baseline, "rows": rows}
    write_report("shared_cpu_engines", report, args)


if __name__ == "__main__":
    main()
