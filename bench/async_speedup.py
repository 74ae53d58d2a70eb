"""Judge-bound CollabLLM training: synchronous vs asynchronous, end to end.

The clarify task with the multiturn-aware reward where every LLM call is real HTTP through
the judge proxy: the user simulator plays the user in each forward-sampled future, and the
judge scores each future on the interactivity rubric (R* = success - token penalty
+ 0.5 * interactivity). The provider is the repo's stand-in (`judge_proxy.local_upstream`
with its latency model: lognormal time to first token, median 0.6 s, p99 5 s, then 80
tokens/s), with one TPM/RPM budget for the simulator and the judge together.

One warm start, then the same job, seed and steps under `max_staleness` 0 (synchronous
RL, same code), 1, 2 and 4 (pause mode abort), and 2 with pause mode keep, one after
another on one running system; the stand-in and the proxy's shared budget start full for
each run. Per run: wall time (from the first weight publish) to a target training reward
(a moving average over `--window` steps) and to the end, steps per minute, held-out
success of the trained policy (rule-based user, the same answers the simulator gives),
learner idle ratio (waiting for a batch / wall), rollout engine busy ratio, judge budget
use (tokens per minute over the TPM, as the dashboards show it; the provider's bucket
starts full, so a short run may pass 1 by up to one minute's tokens), upstream 429s, groups
dropped as over-stale, staleness histogram and mismatch KL, and the CPU seconds of every
process (2 cores: where they go decides what can overlap).

Run: python bench/async_speedup.py [--steps 30] [--tpm 1500000] [--target 1.2] [--eval 256]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from collab_clarify import evaluate_policies  # noqa: E402  (bench/ is on sys.path as the script's folder)

from tandem.client import ApiClient, follow, load_spec_file  # noqa: E402
from tandem.demo import DEMO_SPEC, prepare  # noqa: E402
from tandem.launcher import Ports, Stack  # noqa: E402
from services.queues import Keys  # noqa: E402
from tandem.redis_embed import free_port  # noqa: E402

UPSTREAM = "stand-in"
"""The one upstream: the provider's key, shared by the user simulator and the judge."""
SETTINGS = (  # label, max_staleness, pause mode
    ("sync", 0, "abort"),
    ("eta1", 1, "abort"),
    ("eta2", 2, "abort"),
    ("eta2-keep", 2, "keep"),
    ("eta4", 4, "abort"),
)
REWARD = {"mode": "multiturn", "window": 2, "num_futures": 3, "token_penalty": 5e-4,
          "extrinsic_weight": 1.0, "judge_rubric": "interactivity", "judge_weight": 0.5,
          "judge_model": "judge", "user_model": "judge", "scale_advantage_by_std": False}
WARM_START_STEPS = 400


def base_spec(out: Path, steps: int) -> dict:
    """The judge-bound job on the tiny model (deploy/configs/clarify-judge.yaml at tiny scale)."""
    spec = prepare(out, load_spec_file(DEMO_SPEC))
    spec["task"] |= {"user": "llm", "followup_share": 0.5}
    spec["rollout"] |= {"group_size": 4}
    spec["reward"] = dict(REWARD)
    spec["train"] |= {"num_steps": steps, "batch_size": 8, "lr": 5e-4, "kl_coef": 0.02}
    spec["warm_start"]["steps"] = WARM_START_STEPS
    return spec


class StandIn:
    """The stand-in provider as its own process, and the proxy's upstreams file for it."""

    def __init__(self, out: Path, tpm: int, rpm: int, seed: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tpm, self.rpm = tpm, rpm
        self.upstreams_file = out / "upstreams.yaml"
        self.upstreams_file.write_text(
            f"upstreams:\n  - name: {UPSTREAM}\n    model: judge\n    base_url: {self.url}/v1\n"
            f"    tpm: {tpm}\n    rpm: {rpm}\n    max_concurrency: 256\n    timeout_s: 60\n"
            "    limit_model: bucket\n")  # the stand-in's own rule
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self.log = open(out / "logs" / "stand-in.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "judge_proxy.local_upstream", "--port", str(self.port), "--tpm", str(tpm),
             "--rpm", str(rpm), "--model", "judge", "--latency", "--seed", str(seed)],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.stats()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"the stand-in did not start (see {out / 'logs' / 'stand-in.log'})") from None
                time.sleep(0.2)

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/admin/stats", timeout=5).json()

    def reset(self) -> None:
        httpx.post(f"{self.url}/admin/reset", timeout=5).raise_for_status()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self.log.close()


def scrape(url: str, metric: str, job_id: str) -> float:
    """The sample of a Prometheus metric labelled with `job_id` (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(url, timeout=5).text)
    return next((sample.value for family in families for sample in family.samples
                 if sample.name == metric and sample.labels.get("job") == job_id), 0.0)


def run_job(client: ApiClient, stack: Stack, stand_in: StandIn, spec: dict) -> dict:
    """Submit `spec` with the provider and the shared budget fresh; its record and figures."""
    import redis

    stand_in.reset()
    redis.Redis.from_url(stack.redis_url).delete(Keys.judge_budget(UPSTREAM), Keys.judge_budget(UPSTREAM) + ":leases")
    before, cpu_before = stand_in.stats(), cpu_seconds(stack, stand_in)
    job_id = client.submit(spec)["id"]
    record = follow(client, job_id)
    if record["status"] != "SUCCEEDED":
        raise RuntimeError(f"{spec['name']}: {record['status']} {record.get('error')} (logs in {stack.log_dir})")
    after, cpu_after = stand_in.stats(), cpu_seconds(stack, stand_in)
    rollout_metrics = f"http://127.0.0.1:{stack.ports.rollout[0]}/metrics"
    return {"job_id": job_id, "history": [h for h in client.history(job_id) if h.get("phase") == "rl"],
            "provider": {k: after[k] - before[k] for k in ("requests", "accepted", "rejected_429", "recognised",
                                                            "tokens_accepted", "latency_s_total")},
            "engine_busy_s": scrape(rollout_metrics, "tandem_rollout_engine_busy_seconds_total", job_id),
            "cpu_s": {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}}


def cpu_seconds(stack: Stack, stand_in: StandIn) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process and its children (the
    learner's ranks, the rollout server's engine processes): where the cores go."""
    import psutil

    from tandem.launcher import process_tree

    roots = {name: process.pid for name, process in stack.processes.items()} | {"stand-in": stand_in.process.pid}
    used: dict[str, float] = {}
    for name, pid in roots.items():
        for process in process_tree(pid):
            try:
                times = process.cpu_times()
                part = name if process.pid == pid or name == "learner" else f"{name} {process.name()}"
            except psutil.NoSuchProcess:
                continue
            used[part] = used.get(part, 0.0) + times.user + times.system
    return used


def train(out: Path, args: argparse.Namespace) -> tuple[Path, dict[str, dict]]:
    """The warm start, then one run per setting; returns the warm policy and the runs."""
    base = base_spec(out, args.steps)
    stand_in = StandIn(out, args.tpm, args.rpm, seed=args.seed)
    env = {"TANDEM_RUNS_DIR": str(out / "runs"), "TANDEM_UPSTREAMS": str(stand_in.upstreams_file),
           "TANDEM_MAX_CONCURRENT_TASKS": str(args.max_tasks)}
    runs: dict[str, dict] = {}
    try:
        with Stack(out / "logs", ports=Ports.free(), extra_env=env) as stack:
            client = ApiClient(stack.api_url)
            policy = Path(args.warm_policy) if args.warm_policy else warm_start(client, stack, stand_in, base, out)
            for label, eta, pause in (s for s in SETTINGS if s[0] in args.settings):
                spec = copy.deepcopy(base) | {"name": f"async-eta{eta}-{pause}"}
                spec["model"]["path"] = str(policy)
                spec["warm_start"] = {"steps": 0}
                spec["train"] |= {"max_staleness": eta, "seed": args.seed}
                spec["rollout"]["pause_mode"] = pause
                print(f"\n{label}")
                runs[label] = run_job(client, stack, stand_in, spec) | {"max_staleness": eta, "pause_mode": pause}
                (out / "training.json").write_text(json.dumps(runs))
    finally:
        stand_in.stop()
    return policy, runs


def warm_start(client: ApiClient, stack: Stack, stand_in: StandIn, base: dict, out: Path) -> Path:
    """The warm-start policy every run starts from: SFT in a job of one RL step."""
    warm = copy.deepcopy(base) | {"name": "warm-start"}
    warm["train"] |= {"num_steps": 1, "max_staleness": 0}
    print(f"warm start ({WARM_START_STEPS} SFT steps)")
    warm_run = run_job(client, stack, stand_in, warm)
    return out / "runs" / warm_run["job_id"] / "policy-warm-start"


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i + 1 - window):i + 1]) / len(values[max(0, i + 1 - window):i + 1])
            for i in range(len(values))]


def summarize(run: dict, target: float, window: int, tpm: int) -> dict:
    """The figures of one run, from its step records and the provider's counters."""
    history = run["history"]
    seconds = [h["rl_seconds"] for h in history]
    average = moving_average([h["reward_mean"] for h in history], window)
    reached = next((i for i, value in enumerate(average) if i + 1 >= window and value >= target), None)
    wall = seconds[-1]
    staleness: dict[str, int] = {}
    for h in history:
        for value, count in h["staleness_counts"].items():
            staleness[value] = staleness.get(value, 0) + count
    return {
        "max_staleness": run["max_staleness"], "pause_mode": run["pause_mode"], "job_id": run["job_id"],
        "steps": len(history), "wall_s": wall, "steps_per_min": len(history) / wall * 60,
        "target_step": None if reached is None else reached + 1,
        "to_target_s": None if reached is None else seconds[reached],
        "final_reward_ma": average[-1],
        "learner_idle_ratio": history[-1]["idle_ratio"],
        "engine_busy_ratio": run["engine_busy_s"] / wall,
        "budget_use": run["provider"]["tokens_accepted"] / (tpm * wall / 60),
        "provider_calls": run["provider"]["accepted"], "upstream_429": run["provider"]["rejected_429"],
        "stale_dropped": history[-1].get("stale_dropped", 0),
        "cpu_s": run["cpu_s"],
        "provider_latency_mean_s": run["provider"]["latency_s_total"] / max(run["provider"]["accepted"], 1),
        "staleness_histogram": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "mismatch_kl_mean": sum(h.get("mismatch_kl", 0.0) for h in history) / len(history),
        "curve": {"seconds": seconds, "reward_ma": average, "reward": [h["reward_mean"] for h in history]},
    }


def make_report(args: argparse.Namespace, runs: dict[str, dict], held_out: dict, total_s: float) -> dict:
    rows = {label: summarize(run, args.target, args.window, args.tpm) | {"held_out": held_out[(label, args.seed)]}
            for label, run in runs.items()}
    sync = rows[SETTINGS[0][0]]
    for row in rows.values():
        row["speedup_to_target"] = (sync["to_target_s"] / row["to_target_s"]
                                    if sync["to_target_s"] and row["to_target_s"] else None)
        row["speedup_to_end"] = sync["wall_s"] / row["wall_s"]
        row["held_out_vs_sync"] = row["held_out"]["success"] - sync["held_out"]["success"]
    best = best_async(rows)
    return {"steps": args.steps, "seed": args.seed, "target_reward": args.target, "window": args.window,
            "tpm": args.tpm, "rpm": args.rpm, "max_concurrent_tasks": args.max_tasks,
            "eval_conversations": args.eval, "cpu_cores": os.cpu_count(), "total_seconds": total_s,
            "held_out_warm_start": held_out[("warm start", args.seed)], "best_async": best, "runs": rows}


QUALITY_TOLERANCE = 0.05
"""Asynchrony must not cost quality: held-out success within this of sync's."""


def best_async(rows: dict[str, dict]) -> str | None:
    """The asynchronous setting that reached the target soonest among those whose held-out
    success is within QUALITY_TOLERANCE of sync's (None when none is)."""
    fit = [label for label, row in rows.items() if row["max_staleness"] > 0 and row["speedup_to_target"]
           and row["held_out_vs_sync"] >= -QUALITY_TOLERANCE]
    return max(fit, key=lambda label: rows[label]["speedup_to_target"], default=None)


def print_report(report: dict) -> None:
    print(f"\njudge-bound clarify, {report['steps']} RL steps per run, seed {report['seed']}, "
          f"target: reward moving average ({report['window']} steps) >= {report['target_reward']}, "
          f"TPM {report['tpm']}, {report['cpu_cores']} CPU cores, {report['total_seconds'] / 60:.1f} min in all")
    print(f"{'setting':>13} {'to target':>10} {'speedup':>8} {'to end':>8} {'steps/min':>10} {'held-out':>9} "
          f"{'vs sync':>8} {'idle':>6} {'engine':>7} {'budget':>7} {'429s':>5} {'dropped':>8} {'mism. KL':>9}"
          "  staleness")
    for label, r in report["runs"].items():
        to_target = f"{r['to_target_s']:.0f} s" if r["to_target_s"] else "never"
        speedup = f"{r['speedup_to_target']:.2f}x" if r["speedup_to_target"] else "-"
        print(f"{label:>13} {to_target:>10} {speedup:>8} {r['wall_s']:>6.0f} s {r['steps_per_min']:>10.1f} "
              f"{r['held_out']['success']:>9.3f} {r['held_out_vs_sync']:>+8.3f} {r['learner_idle_ratio']:>6.2f} "
              f"{r['engine_busy_ratio']:>7.2f} {r['budget_use']:>7.2f} {r['upstream_429']:>5} {r['stale_dropped']:>8} "
              f"{r['mismatch_kl_mean']:>9.2e}  {r['staleness_histogram']}")
    print(f"warm start held-out success {report['held_out_warm_start']['success']:.3f}; "
          f"fastest asynchronous setting within {QUALITY_TOLERANCE} of sync's held-out success: "
          f"{report['best_async']}")
    print("\nCPU seconds per RL step, by process (2 cores):")
    for label, r in report["runs"].items():
        parts = ", ".join(f"{name} {seconds / r['steps']:.2f}" for name, seconds in
                          sorted(r["cpu_s"].items(), key=lambda kv: -kv[1]) if seconds >= 0.005 * r["steps"])
        print(f"{label:>13}: {parts}")


def plot(report: dict, path: Path) -> None:
    """Training reward (moving average) against wall time, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    first = report["window"] - 1  # from the first full window on
    for label, run in report["runs"].items():
        ax.plot(run["curve"]["seconds"][first:], run["curve"]["reward_ma"][first:], label=label, lw=1.6,
                ls="--" if run["max_staleness"] == 0 else "-")
    ax.axhline(report["target_reward"], color="grey", lw=0.8, ls=":", label="target")
    ax.set_xlabel("wall time since the first weight publish (s)")
    ax.set_ylabel(f"training reward, moving average of {report['window']} steps")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Judge-bound clarify (LLM user + judge via the proxy): reward vs wall time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tpm", type=int, default=1_500_000, help="the provider's tokens per minute")
    parser.add_argument("--rpm", type=int, default=10_000, help="the provider's requests per minute")
    parser.add_argument("--max-tasks", type=int, default=32, help="rollout server: tasks in flight")
    parser.add_argument("--target", type=float, default=1.2,
                        help="training reward (moving average) to reach; R* is at most about 1.41 here")
    parser.add_argument("--window", type=int, default=5, help="moving average window in steps")
    parser.add_argument("--eval", type=int, default=256, help="held-out conversations per policy")
    parser.add_argument("--settings", default=",".join(s[0] for s in SETTINGS),
                        help="which runs, comma-separated (the first must be sync)")
    parser.add_argument("--warm-policy", help="start every run from this policy folder (skips the warm start)")
    parser.add_argument("--out", default="bench/results/async_speedup")
    args = parser.parse_args()
    args.settings = args.settings.split(",")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    warm_policy, runs = train(out, args)
    policies = {("warm start", args.seed): warm_policy}
    policies |= {(label, args.seed): out / "runs" / run["job_id"] / "policy" for label, run in runs.items()}
    held_out = asyncio.run(evaluate_policies(policies, args.eval, seed=10_000))
    report = make_report(args, runs, held_out, time.monotonic() - started)
    print_report(report)
    (out / "async_speedup.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "async_speedup.png")
    print(f"wrote {out / 'async_speedup.json'} and {out / 'async_speedup.png'}")


if __name__ == "__main__":
    main()
