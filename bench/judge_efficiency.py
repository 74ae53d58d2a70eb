"""Judge budget efficiency: per-candidate judging with fixed futures against group judging
plus the proxy's cache plus adaptive futures, on the judge-bound job under one TPM budget.

The job is bench/judge_bound.py's judge-bound clarify job (LLM user simulator and LLM
judge through the proxy, the stand-in provider with its latency model, one TPM/RPM budget
for both) at max_staleness 2. One warm start; then, for each seed, the two settings one
after the other on one running system (the provider's and the proxy's budgets start full
for each run):
- `baseline`: one judge call per future, no cache, S = 3 futures per response;
- `efficient`: the futures of a response judged in one call (`judge_mode: group`), the
  proxy's verdict cache on, and `futures: adaptive` (2 futures, then more while their R*
  disagree, at most 6, never more per group than S = 3 per response on average);
- `group-cache` (ablation, `--settings group-cache`): group judging and the cache with S = 3.

Per run: wall time to a target training reward (moving average) and to the end, held-out
success of the trained policy, and what the provider charged: judge (verdict) tokens and
all LLM tokens (judge and simulator) per training step, as the rollout servers counted them
and as the provider itself counted them. The table gives min / mean / max over seeds and
the efficient setting's ratios to the baseline's means; the plot, training reward against
provider tokens spent.

Run: python -m bench.judge_efficiency [--seeds 0,1,2] [--steps 25] [--tpm 400000] [--settings baseline,efficient]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import time
from pathlib import Path

from bench.harness import (
    common_args,
    evaluate_policies,
    moving_average,
    out_folder,
    pyplot,
    rig,
    spread,
    write_report,
)
from bench.judge_bound import HELD_OUT_SEED, base_spec, reached, run_judged, warm_start
from tandem.client import load_spec_file
from tandem.demo import DEMO_SPEC

SETTINGS = {
    "baseline": {"judge_mode": "single", "judge_cache": False, "futures": "fixed", "num_futures": 3},
    # The recorded runs used the `own` rule (a response's own futures decide its count), which
    # reallocates futures within a group but biases MR (docs/DESIGN.md, "Adaptive futures").
    "efficient": {
        "judge_mode": "group",
        "judge_cache": True,
        "futures": "adaptive",
        "adaptive_rule": "own",
        "num_futures": 3,
        "min_futures": 2,
        "max_futures": 6,
        "futures_se_threshold": 0.05,
    },
    # The ablation: group judging and the cache alone, S = 3 futures as the baseline.
    "group-cache": {"judge_mode": "group", "judge_cache": True, "futures": "fixed", "num_futures": 3},
}
MAX_STALENESS = 2
"""The setting bench/async_speedup.py recommends for this job."""


def train(out: Path, args: argparse.Namespace) -> tuple[Path, dict[str, dict]]:
    """The warm start, then both settings for each seed; returns the warm policy and runs."""
    base = base_spec(out, args.steps)
    base["train"]["max_staleness"] = MAX_STALENESS
    runs: dict[str, dict] = {}
    env = {"TANDEM_MAX_CONCURRENT_TASKS": str(args.max_tasks)}
    with rig(out, stand_in=(args.tpm, args.rpm, 0), env=env) as system:
        policy = Path(args.warm_policy) if args.warm_policy else warm_start(system, base)
        for seed in args.seeds:
            for label in args.settings:
                print(f"\n{label}, seed {seed}")
                spec = setting_spec(base, policy, seed, label)
                runs[f"{label}/{seed}"] = run_judged(system, spec) | {"setting": label, "seed": seed}
                (out / "training.json").write_text(json.dumps(runs))
    return policy, runs


def setting_spec(base: dict, policy: Path, seed: int, label: str) -> dict:
    """`base` from the warm policy with one of `SETTINGS`' rewards, for one seed."""
    spec = copy.deepcopy(base) | {"name": f"judge-{label}-s{seed}"}
    spec["model"]["path"] = str(policy)
    spec["warm_start"] = {"steps": 0}
    spec["train"]["seed"] = seed
    spec["reward"] |= SETTINGS[label]
    return spec


def summarize(run: dict, target: float, window: int) -> dict:
    """One run's figures from its step records and the provider's counters."""
    history = run["history"]
    steps = len(history)
    seconds = [h["rl_seconds"] for h in history]
    average = moving_average([h["reward_mean"] for h in history], window)
    at = reached(average, window, target)
    llm = [h.get("llm_tokens_step", 0.0) for h in history]
    return {
        "setting": run["setting"],
        "seed": run["seed"],
        "job_id": run["job_id"],
        "steps": steps,
        "wall_s": seconds[-1],
        "to_target_s": None if at is None else seconds[at],
        "judge_tokens_per_step": sum(h.get("judge_tokens_step", 0.0) for h in history) / steps,
        "llm_tokens_per_step": sum(llm) / steps,
        "provider_tokens_per_step": run["provider"]["tokens_accepted"] / steps,
        "provider_calls_per_step": run["provider"]["accepted"] / steps,
        "futures_per_turn": sum(h.get("futures", 0.0) for h in history) / steps,
        "futures_per_turn_max": max(h.get("futures_max", 0.0) for h in history),
        "remembered_calls_per_step": sum(h.get("remembered_calls", 0.0) * h["samples"] for h in history) / steps,
        "stale_dropped": history[-1].get("stale_dropped", 0),
        "final_reward_ma": average[-1],
        "curve": {"seconds": seconds, "reward_ma": average, "llm_tokens_cumulative": cumulative(llm)},
    }


def cumulative(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


FIGURES = (
    "to_target_s",
    "wall_s",
    "held_out_success",
    "judge_tokens_per_step",
    "llm_tokens_per_step",
    "provider_tokens_per_step",
    "provider_calls_per_step",
    "futures_per_turn",
)


def seed_spread(rows: list[dict], figure: str) -> dict | None:
    """min / mean / max of a figure over seeds (None when a run never reached it)."""
    over_seeds = spread([r[figure] for r in rows])
    return None if over_seeds["missing"] else {key: over_seeds[key] for key in ("min", "mean", "max")}


def make_report(args: argparse.Namespace, runs: dict[str, dict], held_out: dict, total_s: float) -> dict:
    rows = {
        key: summarize(run, args.target, args.window) | {"held_out_success": held_out[key]["success"]}
        for key, run in runs.items()
    }
    settings = {
        label: {figure: seed_spread([r for r in rows.values() if r["setting"] == label], figure) for figure in FIGURES}
        for label in args.settings
    }
    ratios, checks = {}, {}
    if {"baseline", "efficient"} <= settings.keys():
        base, eff = settings["baseline"], settings["efficient"]
        ratios = {
            figure: eff[figure]["mean"] / base[figure]["mean"]
            for figure in FIGURES
            if base[figure] and eff[figure] and base[figure]["mean"] and figure != "held_out_success"
        }
        checks = {
            # the quality bar is one-sided: spending less may not cost more than 0.05 of held-out success
            "held_out_at_most_0.05_below": eff["held_out_success"]["mean"] >= base["held_out_success"]["mean"] - 0.05,
            "judge_tokens_per_step_at_most_half": ratios.get("judge_tokens_per_step", 1.0) <= 0.5,
            "to_target_at_most_0.6x": ratios.get("to_target_s", 1.0) <= 0.6,
        }
    return {
        "steps": args.steps,
        "seeds": args.seeds,
        "tpm": args.tpm,
        "rpm": args.rpm,
        "max_staleness": MAX_STALENESS,
        "target_reward": args.target,
        "window": args.window,
        "eval_conversations": args.eval,
        "cpu_cores": os.cpu_count(),
        "total_seconds": total_s,
        "held_out_warm_start": held_out["warm start"]["success"],
        "settings": {label: SETTINGS[label] for label in args.settings},
        "spread": settings,
        "ratios_efficient_to_baseline": ratios,
        "checks": checks,
        "runs": rows,
    }


def print_report(report: dict) -> None:
    print(
        f"\njudge-bound clarify, eta {report['max_staleness']}, {report['steps']} RL steps, "
        f"seeds {report['seeds']}, TPM {report['tpm']}, {report['total_seconds'] / 60:.1f} min in all; "
        f"min / mean / max over seeds"
    )
    names = {
        "to_target_s": "to target (s)",
        "wall_s": "to the end (s)",
        "held_out_success": "held-out success",
        "judge_tokens_per_step": "judge tokens/step",
        "llm_tokens_per_step": "LLM tokens/step",
        "provider_tokens_per_step": "provider tokens/step",
        "provider_calls_per_step": "provider calls/step",
        "futures_per_turn": "futures per turn",
    }
    labels = list(report["spread"])
    print(f"{'':>22} " + " ".join(f"{label:>26}" for label in labels) + f" {'ratio':>7}")
    for figure, name in names.items():
        cells = []
        for label in labels:
            s = report["spread"][label][figure]
            cells.append("never (some seed)" if s is None else f"{s['min']:.3g} / {s['mean']:.3g} / {s['max']:.3g}")
        ratio = report["ratios_efficient_to_baseline"].get(figure)
        print(f"{name:>22} " + " ".join(f"{c:>26}" for c in cells) + f" {'' if ratio is None else f'{ratio:.2f}x':>7}")
    print(f"warm start held-out success {report['held_out_warm_start']:.3f}")
    print("checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in report["checks"].items()))


def plot(report: dict, path: Path) -> None:
    """Training reward (moving average) against the LLM tokens the runs had spent."""
    plt = pyplot()
    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colours = {"baseline": "tab:grey", "efficient": "tab:blue", "group-cache": "tab:green"}
    first = report["window"] - 1
    for row in report["runs"].values():
        curve, colour = row["curve"], colours[row["setting"]]
        label = row["setting"] if row["seed"] == report["seeds"][0] else None
        by_tokens.plot(
            [t / 1e6 for t in curve["llm_tokens_cumulative"][first:]],
            curve["reward_ma"][first:],
            color=colour,
            lw=1.4,
            label=label,
        )
        by_time.plot(curve["seconds"][first:], curve["reward_ma"][first:], color=colour, lw=1.4, label=label)
    for ax in (by_tokens, by_time):
        ax.axhline(report["target_reward"], color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    by_tokens.set_xlabel("judge + simulator tokens charged (millions)")
    by_time.set_xlabel("wall time since the first weight publish (s)")
    by_tokens.set_ylabel(f"training reward, moving average of {report['window']} steps")
    by_tokens.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"Judge-bound clarify under {report['tpm'] // 1000}k TPM: one line per seed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--tpm", type=int, default=400_000, help="the provider's tokens per minute")
    parser.add_argument("--rpm", type=int, default=10_000, help="the provider's requests per minute")
    parser.add_argument("--max-tasks", type=int, default=32, help="rollout server: tasks in flight")
    parser.add_argument("--target", type=float, default=1.2, help="training reward (moving average) to reach")
    parser.add_argument("--window", type=int, default=5, help="moving average window in steps")
    parser.add_argument("--eval", type=int, default=256, help="held-out conversations per policy")
    parser.add_argument(
        "--settings",
        default="baseline,efficient",
        help=f"comma-separated, of {list(SETTINGS)}; ratios need baseline and efficient",
    )
    parser.add_argument("--warm-policy", help="start every run from this policy folder (skips the warm start)")
    common_args(parser, "judge_efficiency", seeds="0,1,2")
    args = parser.parse_args()
    args.settings = args.settings.split(",")
    out = out_folder(args)
    started = time.monotonic()
    warm_policy, runs = train(out, args)
    policies = {"warm start": warm_policy} | {key: out / "runs" / run["job_id"] / "policy" for key, run in runs.items()}
    held_out = asyncio.run(evaluate_policies(policies, load_spec_file(DEMO_SPEC), args.eval, seed=HELD_OUT_SEED))
    report = make_report(args, runs, held_out, time.monotonic() - started)
    print_report(report)
    write_report("judge_efficiency", report, args, plot)


if __name__ == "__main__":
    main()
