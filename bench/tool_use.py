"""Learning to use a tool: the multiply task with a calculator, trained asynchronously.

The tiny model cannot multiply a 4-digit by a 3-digit number from its weights; the
calculator can. One tiny model (tokenizer trained on the task's text, digits one token
each), one warm start (SFT on demonstrations of which `--tool-share` call the calculator;
the rest answer at once), then per seed GRPO from it through the whole system (REST API,
rollout server with the job's tool box, learner) with ARTIST's composite reward
(`deploy/configs/multiply-tools.yaml`).

Held-out conversations (examples the runs never saw) are played by three policies per
seed: the warm start with the calculator, the RL policy with it, and the RL policy with
tools withheld (no tool box and no tool list in the prompt: the baseline that shows what
the weights alone can do). The warm start is one policy played once per seed, so its
spread is the evaluation's own (sampling at the job's temperature). Per policy: success, the share of episodes with a
call that ran
(a well-formed call of a tool that exists, with valid arguments), calls per episode and
policy tokens. The table gives min / mean / max over seeds; the plot, per RL step, the
training reward and the share of episodes with a call that ran.

Run: python -m bench.tool_use [--seeds 0,1,2] [--steps 80] [--eval 256] [--warm-policy DIR]
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
    REPO,
    common_args,
    evaluate_policies,
    out_folder,
    pyplot,
    rig,
    rl_steps,
    run_job,
    spread,
    write_report,
)
from tandem.client import load_spec_file

SPEC = REPO / "deploy" / "configs" / "multiply-tools.yaml"
POLICIES = ("warm start, calculator", "RL, calculator", "RL, tools withheld")


def prepare(out: Path, spec: dict, tool_share: float) -> dict:
    """The tiny model (tokenizer trained on the task's text) and the warm-start data."""
    from devtools.tiny_model import CHATML_TEMPLATE, make_tiny_model
    from rollout.tasks import multiply

    model_dir = out / "tiny-model"
    if not (model_dir / "model.safetensors").exists():
        make_tiny_model(model_dir, multiply.corpus(CHATML_TEMPLATE), individual_digits=True)
    data = out / "warm_start.jsonl"
    rows = multiply.demonstrations(3000, tool_share, seed=1)
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec["model"]["path"] = str(model_dir.resolve())
    spec["warm_start"]["data"] = str(data.resolve())
    return spec


def train(out: Path, base: dict, args: argparse.Namespace) -> tuple[Path, list[dict]]:
    """The warm start (a job of one RL step, unless `--warm-policy` names one), then one RL
    job per seed from it; returns the warm policy and the runs."""
    runs = []
    with rig(out) as r:
        if args.warm_policy:
            warm = Path(args.warm_policy).resolve()
        else:
            spec = copy.deepcopy(base) | {"name": "tool-use-warm-start"}
            spec["train"]["num_steps"] = 1
            print(f"warm start ({spec['warm_start']['steps']} SFT steps)")
            warm = r.runs / run_job(r, spec)["job_id"] / "policy-warm-start"
        for seed in args.seeds:
            spec = copy.deepcopy(base) | {"name": f"tool-use-s{seed}"}
            spec["model"]["path"] = str(warm)
            spec["warm_start"]["steps"] = 0
            spec["train"] |= {"seed": seed, "num_steps": args.steps}
            print(f"\nRL, seed {seed}")
            runs.append(run_job(r, spec) | {"seed": seed})
            (out / "training.json").write_text(json.dumps({"warm_policy": str(warm), "runs": runs}))
    return warm, runs


FIGURES = ("success", "tool_used", "tool_calls", "tokens")


def make_report(args: argparse.Namespace, runs: list[dict], results: dict, total_s: float) -> dict:
    rows = [
        {"policy": label, "seed": seed, **{k: result.get(k, 0.0) for k in FIGURES}}
        for (label, seed), result in results.items()
    ]
    summary = {label: {k: spread([r[k] for r in rows if r["policy"] == label]) for k in FIGURES} for label in POLICIES}
    warm, rl = summary[POLICIES[0]]["success"]["mean"], summary[POLICIES[1]]["success"]["mean"]
    steps = [(run["seed"], rl_steps(run["history"])) for run in runs]
    curves = [
        {
            "seed": seed,
            "reward_mean": [h["reward_mean"] for h in rl],
            "tool_used": [h.get("tool_used", 0.0) for h in rl],
            "success": [h.get("success", 0.0) for h in rl],
        }
        for seed, rl in steps
    ]
    return {
        "steps": args.steps,
        "seeds": args.seeds,
        "tool_share": args.tool_share,
        "eval_conversations": args.eval,
        "cpu_cores": os.cpu_count(),
        "total_seconds": total_s,
        "train_seconds": [run["seconds"] for run in runs],
        "summary": summary,
        "runs": rows,
        "curves": curves,
        "checks": {
            "rl_success_at_least_0.8": summary[POLICIES[1]]["success"]["min"] >= 0.8,
            "rl_at_least_0.4_above_warm_start": rl - warm >= 0.4,
            "call_share_rises": summary[POLICIES[1]]["tool_used"]["mean"] > summary[POLICIES[0]]["tool_used"]["mean"],
        },
    }


def print_report(report: dict) -> None:
    print(
        f"\nmultiply with a calculator: {report['steps']} RL steps, {len(report['seeds'])} seed(s), warm start with "
        f"{report['tool_share']:.0%} tool demonstrations, {report['eval_conversations']} held-out conversations "
        f"per policy, {report['total_seconds'] / 60:.1f} min in all; min / mean / max over seeds"
    )
    names = {
        "success": "success",
        "tool_used": "episodes with a call that ran",
        "tool_calls": "calls/episode",
        "tokens": "policy tokens/episode",
    }
    print(f"{'policy':>24} " + " ".join(f"{name:>30}" for name in names.values()))
    for label, figures in report["summary"].items():
        cells = [f"{s['min']:.3g} / {s['mean']:.3g} / {s['max']:.3g}" for s in (figures[k] for k in names)]
        print(f"{label:>24} " + " ".join(f"{c:>30}" for c in cells))
    print("checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in report["checks"].items()))


def plot(report: dict, path: Path) -> None:
    """Per RL step and seed: the training reward and the share of episodes with a call that ran."""
    plt = pyplot()
    fig, (reward, used) = plt.subplots(1, 2, figsize=(11, 4))
    for curve in report["curves"]:
        steps = range(1, len(curve["reward_mean"]) + 1)
        label = f"seed {curve['seed']}"
        reward.plot(steps, curve["reward_mean"], lw=1.3, label=label)
        used.plot(steps, curve["tool_used"], lw=1.3, label=label)
    reward.set_title("mean training reward (success + 0.1 format + 0.1 tool success)")
    used.set_title("share of training episodes with a call that ran")
    for ax in (reward, used):
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    used.set_ylim(-0.05, 1.05)
    reward.legend(loc="lower right", fontsize=8)
    fig.suptitle("Multiply with a calculator: one line per seed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, "tool_use", seeds="0,1,2")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--eval", type=int, default=256, help="held-out conversations per policy")
    parser.add_argument("--tool-share", type=float, default=0.3, help="warm-start demonstrations that call")
    parser.add_argument("--warm-policy", help="start every run from this policy folder (skips the warm start)")
    args = parser.parse_args()
    out = out_folder(args)
    started = time.monotonic()
    spec = prepare(out, load_spec_file(SPEC), args.tool_share)
    warm, runs = train(out, spec, args)
    policies = {(POLICIES[0], run["seed"]): warm for run in runs}
    for run in runs:
        policies[(POLICIES[1], run["seed"])] = out / "runs" / run["job_id"] / "policy"
        policies[(POLICIES[2], run["seed"])] = out / "runs" / run["job_id"] / "policy"
    results = asyncio.run(
        evaluate_policies(policies, spec, args.eval, seed=10_000, without_tools=lambda key: key[0].endswith("withheld"))
    )
    report = make_report(args, runs, results, time.monotonic() - started)
    print_report(report)
    write_report("tool_use", report, args, plot)


if __name__ == "__main__":
    main()
