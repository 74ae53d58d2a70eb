"""Soak: Redis memory stays bounded over a long judge-bound run, and nothing is lost.

One judge-bound job (the clarify task with the multiturn-aware reward, user simulator and
judge on the repo's stand-in provider with its latency model: bench/judge_bound.py's job)
runs on a whole local system (`bench.harness.rig`) for `--groups` groups, in small
groups and batches so that many steps and checkpoints fit. Every `--interval-s` seconds the
bench samples Redis: INFO memory (`used_memory`, `used_memory_dataset`) and MEMORY USAGE by
key family (the job's tasks, trajectories and dead streams, its history and checkpoints
lists, the task journals, and the judge proxy's memory: `cache` and `replay` entries).

The judge proxy remembers replies for `cache_ttl_s` and `idempotency_ttl_s` (1 h each by
default): in a run shorter than that its memory would grow the whole time, while in a
week-long run it is bounded by the TTL. The bench sets both to `--memory-ttl-s` so that the
run reaches the steady state a long run has, and reports that memory's share separately.

Pass: the largest `used_memory` after the first RL checkpoint is at most 1.2x its level at
10% of the run (the step that trains the first 10% of the groups). Trajectories stay in
their stream, read but unacknowledged, until the checkpoint that covers them, so memory
is a sawtooth of period `checkpoint_every` steps; the level at 10% is therefore the peak
of the checkpoint interval holding that step (peak against peaks), and the single sample
at the mark is reported beside it. Per family: its size at the mark, its largest after the
first checkpoint and its growth in bytes per step (a least-squares slope after the first
checkpoint), which names whatever grows.

Also checked: the job SUCCEEDED, no task was trained twice, and every task dispatched was
trained or counted as replaced (dropped as over-stale, or dead-lettered).

Run: python -m bench.soak [--groups 5000] [--group-size 2] [--batch-size 16] [--checkpoint-every 10]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.harness import common_args, out_folder, pyplot, rig, write_report
from bench.judge_bound import base_spec
from services import protocol
from services.queues import FIELD, Keys
from tandem.launcher import Ports, Stack
from tandem.progress import Progress

MIB = 1 << 20
BOUND = 1.2
"""Pass: memory after the first checkpoint at most this times its level at 10% of the run."""


def families(job_id: str) -> dict[str, str]:
    """Key families measured by MEMORY USAGE: a key, or a SCAN pattern (ending in `*`). The
    judge proxy's memory is matched for every job: the bench's stack runs this one only."""
    return {
        "tasks": Keys.tasks(job_id),
        "trajectories": Keys.trajectories(job_id),
        "dead": Keys.dead(job_id),
        "history": Keys.history(job_id),
        "checkpoints": Keys.checkpoints(job_id),
        "journals": Keys.journal(job_id, "*"),
        "judge cache": Keys.judge_memory("cache", "*", "*"),
        "judge replay": Keys.judge_memory("replay", "*", "*"),
    }


INFO_FIELDS = (
    "used_memory_overhead",
    "used_memory_startup",
    "mem_clients_normal",
    "used_memory_scripts",
    "used_memory_lua",
    "db0",
)
"""More of INFO, kept per sample to tell what moves the memory no key family holds."""


class Sampler:
    """Redis memory over time, in total and by key family, with the learner's step."""

    def __init__(self, redis_url: str, job_id: str) -> None:
        import redis

        self.client = redis.Redis.from_url(redis_url)
        self.job_id = job_id
        self.started = time.time()
        self.samples: list[dict] = []
        self.checkpoints: dict[int, float] = {}
        """RL checkpoint step -> seconds since the start (the job's list keeps only the newest)."""

    def sample(self) -> dict:
        info = self.client.info("memory") | self.client.info("keyspace")
        sizes, counts = {}, {}
        for name, key in families(self.job_id).items():
            keys = list(self.client.scan_iter(match=key, count=1000)) if key.endswith("*") else [key]
            sizes[name], counts[name] = self.usage(keys), len(keys)
        self.note_checkpoints()
        row = {
            "t_s": time.time() - self.started,
            "step": int(self.client.hget(Keys.job(self.job_id), "step") or 0),
            "used_memory": info["used_memory"],
            "used_memory_dataset": info["used_memory_dataset"],
            "info": {name: info[name] for name in INFO_FIELDS},
            "bytes": sizes,
            "keys": counts,
            "history_records": self.client.llen(Keys.history(self.job_id)),
        }
        self.samples.append(row)
        return row

    def usage(self, keys: list[bytes | str]) -> int:
        """Bytes the keys take (all of a stream's or list's nodes counted; gone keys as 0)."""
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.memory_usage(key, samples=0)
            return sum(size or 0 for size in pipe.execute())

    def note_checkpoints(self) -> None:
        for raw in self.client.lrange(Keys.checkpoints(self.job_id), 0, -1):
            record = json.loads(raw)
            if record["step"] > 0:
                self.checkpoints.setdefault(record["step"], record["time"] - self.started)

    def dispatched(self) -> int:
        """Tasks dispatched in all: the newest task's id + 1 (a trimmed stream keeps its newest entry)."""
        newest = self.client.xrevrange(Keys.tasks(self.job_id), count=1)
        return protocol.decode(newest[0][1][FIELD], protocol.Task).task_id + 1 if newest else 0

    def dead_letters(self) -> int:
        return self.client.xlen(Keys.dead(self.job_id))


def memory_now(row: dict) -> dict[str, str]:
    """What the progress line shows beside the groups trained: Redis's memory now."""
    judge_keys = row["keys"]["judge cache"] + row["keys"]["judge replay"]
    return {"redis": f"{row['used_memory'] / MIB:.2f} MiB", "judge memory": f"{judge_keys} keys"}


def soak_spec(out: Path, args: argparse.Namespace) -> dict:
    spec = base_spec(out, steps=math.ceil(args.groups / args.batch_size))
    spec["name"] = "soak"
    spec["warm_start"]["steps"] = 20  # memory, not learning: a short warm start
    spec["rollout"]["group_size"] = args.group_size
    spec["train"] |= {
        "batch_size": args.batch_size,
        "checkpoint_every": args.checkpoint_every,
        "max_staleness": 4,
        "seed": args.seeds[0],
    }
    return spec


def run(args: argparse.Namespace, out: Path) -> dict:
    """The soak job on one system, sampled until it ends: its samples, history and books."""
    env = {
        "TANDEM_MAX_CONCURRENT_TASKS": str(args.max_tasks),
        "TANDEM_CACHE_TTL_S": str(args.memory_ttl_s),
        "TANDEM_IDEMPOTENCY_TTL_S": str(args.memory_ttl_s),
    }
    spec = soak_spec(out, args)
    total_steps = spec["train"]["num_steps"]
    started = time.monotonic()
    stand_in = (args.tpm, args.rpm, args.seeds[0])
    with rig(out, stand_in=stand_in, env=env, ports=Ports.free(rollout_servers=1)) as system:
        stack = system.stack
        api = httpx.Client(base_url=stack.api_url, timeout=10)
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        print(
            f"job {job_id}: {total_steps} steps x {args.batch_size} groups of {args.group_size}; "
            f"judge proxy memory TTL {args.memory_ttl_s:.0f} s; logs in {out / 'logs'}"
        )
        sampler = Sampler(stack.redis_url, job_id)
        status = watch(api, stack, sampler, job_id, total_steps, args)
        record = api.get(f"/v1/jobs/{job_id}").json()
        history = api.get(f"/v1/jobs/{job_id}/history").json()
        books = {"dispatched": sampler.dispatched(), "dead_letters": sampler.dead_letters()}
    return {
        "job_id": job_id,
        "status": status,
        "error": record.get("error"),
        "spec": spec,
        "samples": sampler.samples,
        "checkpoints": sampler.checkpoints,
        "history": history,
        "books": books,
        "wall_s": time.monotonic() - started,
    }


def watch(
    api: httpx.Client, stack: Stack, sampler: Sampler, job_id: str, total_steps: int, args: argparse.Namespace
) -> str:
    """Sample every `interval_s` until the job ends; its final status."""
    with Progress(total_steps * args.batch_size, "  soak", "groups", file=sys.stdout) as progress:
        while True:
            tick = time.monotonic()
            row = sampler.sample()
            progress.update(row["step"] * args.batch_size, postfix=memory_now(row))
            status = api.get(f"/v1/jobs/{job_id}").json()["status"]
            if status not in ("PENDING", "RUNNING"):
                sampler.sample()
                return status
            stack.check_alive()
            time.sleep(max(0.0, args.interval_s - (time.monotonic() - tick)))


def fit_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x (0 with fewer than two distinct x)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / max(n, 1)
    mean_y = sum(y for _, y in points) / max(n, 1)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


REST = {
    "unattributed": lambda s: s["used_memory_dataset"] - sum(s["bytes"].values()),
    "overhead": lambda s: s["used_memory"] - s["used_memory_dataset"],
}
"""What the families leave of used_memory. Overhead: Redis's start-up memory, key tables and
the client buffers it has counted. Unattributed: the other keys (job and fleet records, the
judge budget: what is left when the system is idle) and client buffers Redis has not counted
yet (Redis 6.2 counts a client's buffers in its cron, so a burst of pipelined trajectories
or a batch read shows up in the dataset until then)."""


def parts(sample: dict) -> dict[str, Callable[[dict], int]]:
    """Each part of used_memory: the families, then what they leave."""
    return {name: (lambda s, name=name: s["bytes"][name]) for name in sample["bytes"]} | REST


def figures(values: list[int], at_mark: int, level: int, after: list[dict]) -> dict:
    """One part's size at the 10% mark and level, after the first checkpoint, its growth."""
    return {
        "at_mark_bytes": at_mark,
        "level_bytes": level,
        "max_after_bytes": max(values),
        "end_bytes": values[-1],
        "bytes_per_step": fit_slope([(s["step"], v) for s, v in zip(after, values)]),
        "share_of_used_mean": sum(v / s["used_memory"] for s, v in zip(after, values)) / len(after),
    }


def analyse(result: dict) -> dict:
    """The memory figures, the books, and the verdict."""
    samples, train = result["samples"], result["spec"]["train"]
    every, total_steps = train["checkpoint_every"], train["num_steps"]
    mark_step = math.ceil(0.1 * total_steps)
    mark = next(s for s in samples if s["step"] >= mark_step)
    interval = [s for s in samples if s["step"] // every == mark["step"] // every]
    level = max(interval, key=lambda s: s["used_memory"])
    first_checkpoint_s = result["checkpoints"][min(result["checkpoints"], key=int)]
    after = [s for s in samples if s["t_s"] >= first_checkpoint_s]
    peak = max(after, key=lambda s: s["used_memory"])
    end = samples[-1]
    by_family = {
        name: figures([part(s) for s in after], part(mark), part(level), after) for name, part in parts(end).items()
    }
    return {
        "mark_step": mark_step,
        "mark_t_s": mark["t_s"],
        "first_checkpoint_s": first_checkpoint_s,
        "first_checkpoint_step": min(result["checkpoints"], key=int),
        "used_at_mark": mark["used_memory"],
        "level_at_10pct": level["used_memory"],
        "level_interval_steps": [min(s["step"] for s in interval), max(s["step"] for s in interval)],
        "used_after_first_checkpoint": after[0]["used_memory"],
        "max_after_first_checkpoint": peak["used_memory"],
        "max_after_t_s": peak["t_s"],
        "max_after_step": peak["step"],
        "used_at_end": end["used_memory"],
        "ratio": peak["used_memory"] / level["used_memory"],
        "ratio_to_sample_at_mark": peak["used_memory"] / mark["used_memory"],
        "used_bytes_per_step": fit_slope([(s["step"], s["used_memory"]) for s in after]),
        "families": by_family,
        "history_bytes_per_record": end["bytes"]["history"] / max(end["history_records"], 1),
        "books": books(result),
    }


def books(result: dict) -> dict:
    """Every task dispatched was trained once, or replaced (over-stale, dead-lettered)."""
    rl = [r for r in result["history"] if r["phase"] == "rl"]
    trained = [task_id for r in rl for task_id in r["task_ids"]]
    last = rl[-1] if rl else {}
    dispatched = result["books"]["dispatched"]
    replaced = last.get("stale_dropped", 0) + result["books"]["dead_letters"]
    return {
        "steps": len(rl),
        "groups_trained": len(trained),
        "groups_trained_twice": len(trained) - len(set(trained)),
        "dispatched": dispatched,
        "stale_dropped": last.get("stale_dropped", 0),
        "duplicates_refused": last.get("duplicates", 0),
        "dead_letters": result["books"]["dead_letters"],
        "trained_outside_dispatched": sum(not 0 <= t < dispatched for t in trained),
        "unaccounted": dispatched - len(set(trained)) - replaced,
    }


def make_report(result: dict, figures: dict, args: argparse.Namespace) -> dict:
    b = figures["books"]
    passed = {
        "bounded": figures["ratio"] <= BOUND,
        "succeeded": result["status"] == "SUCCEEDED",
        "none_trained_twice": b["groups_trained_twice"] == 0,
        "none_lost": b["unaccounted"] == 0,
        "enough_groups": b["groups_trained"] >= args.groups,
    }
    return {
        "job_id": result["job_id"],
        "status": result["status"],
        "error": result["error"],
        "groups": args.groups,
        "group_size": args.group_size,
        "batch_size": args.batch_size,
        "num_steps": result["spec"]["train"]["num_steps"],
        "checkpoint_every": args.checkpoint_every,
        "judge_memory_ttl_s": args.memory_ttl_s,
        "interval_s": args.interval_s,
        "max_tasks": args.max_tasks,
        "cpu_cores": os.cpu_count(),
        "wall_s": result["wall_s"],
        "bound": BOUND,
        "passed": passed,
        "pass": all(passed.values()),
        **figures,
        "checkpoints": result["checkpoints"],
        "samples": result["samples"],
    }


def print_report(report: dict) -> None:
    b = report["books"]
    print(
        f"\nsoak: judge-bound clarify, {b['groups_trained']} groups of {report['group_size']} in "
        f"{b['steps']} steps of {report['batch_size']}, checkpoint every {report['checkpoint_every']} steps, "
        f"judge proxy memory TTL {report['judge_memory_ttl_s']:.0f} s, {report['cpu_cores']} CPU cores, "
        f"{report['wall_s'] / 60:.1f} min"
    )
    print(
        f"used_memory: at 10% (step {report['mark_step']}) {report['used_at_mark'] / MIB:.2f} MiB, level "
        f"(peak of steps {report['level_interval_steps'][0]}-{report['level_interval_steps'][1]}) "
        f"{report['level_at_10pct'] / MIB:.2f} MiB; after the first checkpoint (step "
        f"{report['first_checkpoint_step']}) {report['used_after_first_checkpoint'] / MIB:.2f} MiB, max "
        f"{report['max_after_first_checkpoint'] / MIB:.2f} MiB (step {report['max_after_step']}), end "
        f"{report['used_at_end'] / MIB:.2f} MiB"
    )
    print(
        f"ratio max / level at 10%: {report['ratio']:.3f} (bound {report['bound']}; to the single sample "
        f"at the mark: {report['ratio_to_sample_at_mark']:.3f}); growth {report['used_bytes_per_step']:+.0f} B/step"
    )
    print(
        f"{'family':>14} {'at 10% KiB':>11} {'level KiB':>10} {'max after KiB':>14} {'end KiB':>9} "
        f"{'B/step':>8} {'share':>6}"
    )
    for name, f in report["families"].items():
        print(
            f"{name:>14} {f['at_mark_bytes'] / 1024:>11.1f} {f['level_bytes'] / 1024:>10.1f} "
            f"{f['max_after_bytes'] / 1024:>14.1f} {f['end_bytes'] / 1024:>9.1f} {f['bytes_per_step']:>+8.0f} "
            f"{100 * f['share_of_used_mean']:>5.1f}%"
        )
    print(
        f"history: {report['history_bytes_per_record']:.0f} B per record (one per step, kept until the job "
        f"expires): {report['history_bytes_per_record'] * 100_000 / MIB:.0f} MiB per 100,000 steps"
    )
    print(
        f"books: status {report['status']}; dispatched {b['dispatched']}, trained {b['groups_trained']}, twice "
        f"{b['groups_trained_twice']}, over-stale {b['stale_dropped']}, dead {b['dead_letters']}, "
        f"duplicates refused {b['duplicates_refused']}, unaccounted {b['unaccounted']}"
    )
    print("PASS" if report["pass"] else f"FAIL: {[name for name, ok in report['passed'].items() if not ok]}")


def plot(report: dict, path: Path) -> None:
    """used_memory and the families over time, the 10% mark, the first checkpoint, the band."""
    plt = pyplot()
    samples = report["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.plot(minutes, [s["used_memory"] / MIB for s in samples], color="black", lw=1.8, label="used_memory")
    ax.plot(
        minutes, [s["used_memory_dataset"] / MIB for s in samples], color="grey", lw=1.0, label="used_memory_dataset"
    )
    for name, part in parts(samples[-1]).items():
        values = [part(s) / MIB for s in samples]
        if max(values) >= 0.01 * max(s["used_memory"] for s in samples) / MIB:
            ax.plot(minutes, values, lw=1.0, label=name)
    level = report["level_at_10pct"] / MIB
    ax.axhspan(
        level, report["bound"] * level, color="tab:green", alpha=0.12, label=f"level at 10% .. {report['bound']}x"
    )
    ax.axvline(report["mark_t_s"] / 60, color="tab:green", ls="--", lw=1, label=f"10% (step {report['mark_step']})")
    ax.axvline(
        report["first_checkpoint_s"] / 60,
        color="tab:red",
        ls=":",
        lw=1,
        label=f"first checkpoint (step {report['first_checkpoint_step']})",
    )
    ax.set_xlabel("minutes since the job was submitted")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(
        f"Redis memory, judge-bound soak: {report['books']['groups_trained']} groups, "
        f"max/level {report['ratio']:.2f} (judge memory TTL {report['judge_memory_ttl_s']:.0f} s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=5000, help="groups to train (steps = groups / batch size)")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument(
        "--memory-ttl-s", type=float, default=60.0, help="the judge proxy's cache_ttl_s and idempotency_ttl_s"
    )
    parser.add_argument("--interval-s", type=float, default=2.0, help="between Redis samples")
    parser.add_argument("--max-tasks", type=int, default=32, help="rollout server: tasks in flight")
    parser.add_argument("--tpm", type=int, default=1_500_000)
    parser.add_argument("--rpm", type=int, default=10_000)
    common_args(parser, "soak")  # --seeds: one, the job's and the stand-in's (argparse reads `--seed` as short for it)
    args = parser.parse_args()
    if len(args.seeds) != 1:
        parser.error("one job, one seed")
    out = out_folder(args)  # the system's logs and the raw run, beside the report
    result = run(args, out)
    (out / "result.json").write_text(json.dumps(result))  # the raw run, for another analysis
    report = make_report(result, analyse(result), args)
    print_report(report)
    write_report("soak", report, args, plot)


if __name__ == "__main__":
    main()
