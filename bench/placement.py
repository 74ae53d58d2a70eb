"""Learner ranks and threads on one machine: one rank with every learner thread, or several
gloo ranks with one thread each; and the same beside a generating vLLM engine.

Learner alone: trained tokens/s of the learner's own RL and SFT steps (`learner.trainer`,
FSDP2 over gloo, the tiny model the tests build) on the demo's batch shape (64 sequences
of 64-256 tokens), under torchrun with

  1x2  one rank, OMP_NUM_THREADS=2 (every core)
  2x1  two ranks, OMP_NUM_THREADS=1 each (what `tandem up` started before the plan)

Settings alternate within each round, each run a fresh torchrun; a cell is the median of a
setting's per-step tokens/s over every step of every round, and the ratio is taken within
each round (its spread over rounds is printed beside it), so a neighbour's load on the
shared cores falls on both sides of it alike.

With `--engine`: learner settings (1x1 too: one rank, one thread) while `tandem
serve-model` (vLLM's CPU engine with the rollout engine's options) generates beside it, 8
sampled streams at a time, at the engine thread counts ENGINE_THREADS names; the
engine's tokens/s over the learner's timed window, and each figure as a ratio to the same
process alone in the same run (`tandem.placement` chose its CPU plan from these).

Run: python -m bench.placement [--rounds 3] [--steps 6] [--engine]
Writes placement.json and the engines' logs in `--out` (bench/results/placement);
docs/results/placement.json holds the recorded run (`--publish` replaces it).
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
import threading
import time
from pathlib import Path

import httpx

from bench.harness import REPO, common_args, out_folder, spread, write_report
from tandem.launcher import served_model

LEARNER = {"1x2": (1, 2), "2x1": (2, 1), "1x1": (1, 1)}
"""name: (ranks, OMP_NUM_THREADS per rank)."""
ALONE = ("1x2", "2x1")
ENGINE_THREADS = {"2x1": (0, 1), "1x1": (1,), "1x2": (1,)}
"""Learner setting -> the engine threads it runs beside (0: vLLM's default, every core)."""
SEQUENCES, MIN_TOKENS, MAX_TOKENS = 64, 64, 256
ENGINE_STREAMS, ENGINE_TOKENS = 8, 32


# ---- the learner, one torchrun -------------------------------------------------------


def run_learner(name: str, model_dir: Path, steps: int) -> dict:
    """One torchrun of `worker` in setting `name`; per-step tokens/s of each kind of step."""
    ranks, threads = LEARNER[name]
    out = Path(tempfile.mkdtemp()) / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    subprocess.run(
        [*command, "-m", "bench.placement", "--worker", str(model_dir), str(out), str(steps)],
        check=True,
        capture_output=True,
        cwd=REPO,
        env=os.environ | {"OMP_NUM_THREADS": str(threads)},
    )
    return json.loads(out.read_text())


def demo_batch(vocab: int, rng: random.Random) -> list:
    from services.protocol import Sample

    samples = []
    for i in range(SEQUENCES):
        length = rng.randint(MIN_TOKENS, MAX_TOKENS)
        prompt = length // 4
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
    return samples


def worker(model_dir: str, out: str, steps: int) -> None:
    """Each rank: the learner's Trainer on `steps` + 1 batches per kind of step (the first
    untimed); rank 0 writes each timed step's tokens/s (the whole batch's tokens)."""
    import torch
    import torch.distributed as dist

    from learner.trainer import Trainer
    from services.config import ModelSpec, RLJob

    dist.init_process_group("gloo")
    spec = RLJob(model=ModelSpec(path=model_dir, max_model_len=512), rollout={"max_total_tokens": 512})
    trainer = Trainer(spec, torch.device("cpu"))
    rng = random.Random(0)
    batches = [demo_batch(trainer.model.config.vocab_size, rng) for _ in range(steps + 1)]
    result = {"threads": torch.get_num_threads(), "world_size": dist.get_world_size()}
    for kind, step in (("rl", trainer.rl_step), ("sft", trainer.sft_step)):
        rates = []
        for i, samples in enumerate(batches):
            dist.barrier()
            started = time.perf_counter()
            step(samples)
            dist.barrier()
            if i:  # the first step warms up
                rates.append(sum(len(s.tokens) for s in samples) / (time.perf_counter() - started))
        result[kind] = rates
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


# ---- an engine generating beside it ----------------------------------------------------


class Generating:
    """`ENGINE_STREAMS` sampled completions at a time, back to back, until stopped; the
    tokens each finished request produced and when it finished."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.finished: list[tuple[float, int]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self) -> None:
        while not self.stopping.is_set():
            reply = httpx.post(
                f"{self.url}/v1/completions",
                timeout=600,
                json={
                    "model": "m",
                    "prompt": "<|im_start|>user\nI need a gift for my sister.<|im_end|>\n<|im_start|>assistant\n",
                    "max_tokens": ENGINE_TOKENS,
                    "n": ENGINE_STREAMS,
                    "ignore_eos": True,
                    "temperature": 1.0,
                },
            )
            reply.raise_for_status()
            self.finished.append((time.monotonic(), ENGINE_STREAMS * ENGINE_TOKENS))

    def rate(self, start: float, end: float) -> float:
        """Tokens/s of the requests that finished between `start` and `end`."""
        return sum(n for t, n in self.finished if start <= t <= end) / (end - start)

    def __enter__(self) -> Generating:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join()


def engine_alone(url: str, seconds: float) -> float:
    with Generating(url) as gen:
        time.sleep(seconds / 4)  # past the first requests' warm-up
        start = time.monotonic()
        time.sleep(seconds)
        return gen.rate(start, time.monotonic())


def beside_engine(model_dir: Path, args, logs: Path) -> list[dict]:
    """Per engine thread count: the engine alone, then each learner setting beside it."""
    rows = []
    for engine_threads in sorted({t for ts in ENGINE_THREADS.values() for t in ts}):
        names = [n for n, ts in ENGINE_THREADS.items() if engine_threads in ts]
        log = logs / f"engine-{engine_threads}.log"
        with served_model(model_dir, "m", log, max_model_len=512, threads=engine_threads) as url:
            alone = engine_alone(url, 20.0)
            for _ in range(args.rounds):
                for name in names:
                    with Generating(url) as gen:
                        time.sleep(2.0)  # the engine busy before the learner starts
                        start = time.monotonic()
                        learner = run_learner(name, model_dir, args.steps)
                        engine = gen.rate(start, time.monotonic())
                    rows.append(
                        {
                            "learner": name,
                            "engine_threads": engine_threads,
                            "engine_alone_tokens_per_s": alone,
                            "engine_tokens_per_s": engine,
                            **learner,
                        }
                    )
                    print(f"  {name} beside engine threads={engine_threads}: done", file=sys.stderr, flush=True)
    return rows


# ---- report ----------------------------------------------------------------------------


def alone_table(rounds: list[dict[str, dict]]) -> tuple[str, dict]:
    """Per setting and kind of step: the median and the best step over every round, and
    the ratio to 2x1 within each round (of the rounds' medians), its median and range. The
    best step is the one a neighbour's load slowed least."""
    summary = {}
    lines = ["| learner alone | step | median tokens/s | best tokens/s | vs 2x1, per round: median (range) |"]
    lines.append("|---|---|---|---|---|")
    for name in ALONE:
        summary[name] = {}
        for kind in ("rl", "sft"):
            steps = [r for one in rounds for r in one[name][kind]]
            ratios = [statistics.median(one[name][kind]) / statistics.median(one["2x1"][kind]) for one in rounds]
            over_2x1 = spread(ratios) | {"median": statistics.median(ratios)}
            row = {"median": statistics.median(steps), "best": max(steps), "over_2x1": over_2x1}
            summary[name][kind] = row
            ratio = row["over_2x1"]
            lines.append(
                f"| {name} | {kind.upper()} | {row['median']:.0f} | {row['best']:.0f} | "
                f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}) |"
            )
    return "\n".join(lines), summary


def engine_table(rows: list[dict], learner_alone: dict) -> tuple[str, list[dict]]:
    """Each (learner, engine threads) pair: learner RL/SFT as a ratio to the best learner
    setting alone, the engine as a ratio to itself alone, medians over rounds."""
    best = {kind: max(learner_alone[n][kind]["median"] for n in ALONE) for kind in ("rl", "sft")}
    lines = ["| learner | engine threads | learner RL | learner SFT | engine | RL + engine |"]
    lines.append("|---|---|---|---|---|---|")
    summary = []
    for key in sorted({(r["learner"], r["engine_threads"]) for r in rows}):
        mine = [r for r in rows if (r["learner"], r["engine_threads"]) == key]
        rl = statistics.median([x for r in mine for x in r["rl"]]) / best["rl"]
        sft = statistics.median([x for r in mine for x in r["sft"]]) / best["sft"]
        engine = statistics.median([r["engine_tokens_per_s"] / r["engine_alone_tokens_per_s"] for r in mine])
        summary.append({"learner": key[0], "engine_threads": key[1], "rl": rl, "sft": sft, "engine": engine})
        threads = key[1] or "all"
        lines.append(f"| {key[0]} | {threads} | {rl:.2f} | {sft:.2f} | {engine:.2f} | {rl + engine:.2f} |")
    return "\n".join(lines), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--engine", action="store_true", help="also measure beside a generating engine")
    common_args(parser, "placement", seeds=None)
    args = parser.parse_args()
    from devtools.tiny_model import make_tiny_model
    from rollout.tasks import clarify

    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", clarify.corpus())
    logs = out_folder(args) / "logs"
    logs.mkdir(exist_ok=True)
    rounds = []
    for i in range(args.rounds):
        order = ALONE if i % 2 == 0 else ALONE[::-1]
        rounds.append({name: run_learner(name, model_dir, args.steps) for name in order})
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    text, learner_alone = alone_table(rounds)
    print(f"\n{os.cpu_count()} CPU cores, tiny model, {SEQUENCES} sequences of {MIN_TOKENS}-{MAX_TOKENS} tokens")
    print(text)
    report = {
        "settings": vars(args) | {"out": str(args.out)},
        "cpus": os.cpu_count(),
        "alone": learner_alone,
        "alone_rounds": rounds,
    }
    if args.engine:
        rows = beside_engine(model_dir, args, logs)
        text, report["beside_engine"] = engine_table(rows, learner_alone)
        report["beside_engine_rows"] = rows
        print("\nbeside a generating engine (ratios to each process alone in this run)")
        print(text)
    write_report("placement", report, args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
