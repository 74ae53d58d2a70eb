"""CollabLLM's training recipes on the clarify task, from one warm start, same sample budget.

One warm start (SFT on asking and guessing dialogues, a job of its own), then per seed
four recipes from it, each through the whole system (REST API, rollout server, learner):

    next-turn GRPO  the next-turn reward (w = 0): R* of the conversation as it stands
    MR GRPO         the multiturn-aware reward (w = 2, S = 3), as bench.collab_clarify
    offline DPO     a generate job plays conversations with the warm policy, ranking each
                    turn's responses by MR; an offline job fine-tunes on its best
                    conversations, then trains DPO on its pairs (at a tenth of the RL rate)
    online DPO      MR as for GRPO; each group's best and worst response are a pair,
                    trained as they arrive (staleness bound as for RL)

Same budget: the RL recipes sample steps x batch x group responses; the generate job plays
half as many conversations, which rank about as many responses, since a conversation runs
to a second turn whenever the best of its first responses asks, most of the time (the
table gives each recipe's count). Futures are sampled on top in every MR recipe. Then every policy plays the same
held-out conversations from the bare request:
task success, policy tokens per conversation, share of first turns that ask.

Run: python -m bench.collab_recipes [--seeds 0,1,2] [--steps 60] [--eval 512] [--recipes ...]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import time
from pathlib import Path

from bench.clarify_runs import FOLLOWUP_SHARE, KL_COEF, LR, REWARDS, WARM_START_STEPS
from bench.harness import (
    Rig,
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
from tandem.demo import DEMO_SPEC, prepare

MR, NEXT_TURN = REWARDS["multiturn (w=2, S=3)"], REWARDS["next-turn (w=0)"]
RECIPES = ("next-turn GRPO", "MR GRPO", "offline DPO", "online DPO")
WARM = "warm start (SFT)"
DPO = {"algorithm": "dpo", "dpo_beta": 0.1, "kl_coef": 0.0}
OFFLINE = {"lr": 5e-5}
"""Offline DPO's learning rate, a tenth of the RL rate: on a fixed set of about 240 pairs, at
5e-4 both the chosen and the rejected logprob fell from about -2 to below -50 within 60
steps (DPO's known drift off the data) and the policy's replies fell apart."""
OFFLINE_SFT = {"steps": 100, "batch_size": 32, "lr": 3e-4}
"""CollabLLM's order: fine-tune on the best conversations first, then DPO on the pairs."""
PAIR_MARGIN = 0.2
"""The least MR gap for a pair: two responses that both ask differ in MR by the luck of
their futures alone, and such pairs teach nothing but noise."""


def base_spec(out: Path, steps: int) -> dict:
    """The demo job with bench.collab_clarify's training settings, on a tiny model built in `out`."""
    base = prepare(out, load_spec_file(DEMO_SPEC))
    base["train"] |= {"num_steps": steps, "kl_coef": KL_COEF, "lr": LR}
    base["task"]["followup_share"] = FOLLOWUP_SHARE
    base["warm_start"]["steps"] = WARM_START_STEPS
    return base


def recipe_spec(base: dict, recipe: str, warm: Path, seed: int) -> dict:
    """A recipe's (first) job: every one starts from the warm policy, with no warm start of its own."""
    spec = copy.deepcopy(base) | {"name": f"{recipe.lower().replace(' ', '-')}-s{seed}"}
    spec["model"]["path"] = str(warm)
    spec["warm_start"]["steps"] = 0
    spec["train"]["seed"] = seed
    reward = NEXT_TURN if recipe == "next-turn GRPO" else MR
    spec["reward"] = reward | {"scale_advantage_by_std": False}
    if recipe == "online DPO":
        spec["train"] |= DPO | {"pair_margin": PAIR_MARGIN}
    if recipe == "offline DPO":  # the generate job; the offline job follows on its pairs
        spec["kind"] = "generate"
        spec["task"]["followup_share"] = 0.0  # a generated conversation reaches every turn itself
        steps, batch = spec["train"]["num_steps"], spec["train"]["batch_size"]
        spec["generate"] = {"conversations": steps * batch // 2, "pair_margin": PAIR_MARGIN}
    return spec


def run_recipe(r: Rig, base: dict, recipe: str, warm: Path, seed: int) -> dict:
    """One recipe for one seed: its jobs, the policy it ends with, the responses it ranked."""
    first = run_job(r, recipe_spec(base, recipe, warm, seed))
    if recipe != "offline DPO":
        steps = rl_steps(first["history"])
        return {
            "job_id": first["job_id"],
            "seconds": first["seconds"],
            "curve": curve(steps),
            "responses": sum(h["samples"] for h in steps),
        }
    data = {d["name"]: d for d in r.client.datasets(first["job_id"])}
    pairs = data["pairs"]
    spec = copy.deepcopy(base) | {"name": f"offline-dpo-s{seed}", "kind": "offline"}
    spec["model"]["path"] = str(warm)
    spec["warm_start"] = OFFLINE_SFT | {"data": data["sft"]["path"]}
    spec["train"] |= DPO | OFFLINE | {"seed": seed, "data": pairs["path"]}
    second = run_job(r, spec)
    generated = [h for h in first["history"] if h.get("phase") == "generate"]
    offline = [h for h in second["history"] if h.get("phase") == "offline"]
    return {
        "job_id": second["job_id"],
        "generate_job_id": first["job_id"],
        "seconds": first["seconds"] + second["seconds"],
        "pairs": pairs["rows"],
        "responses": sum(h["responses"] for h in generated),
        "curve": curve(offline),
    }


def curve(steps: list[dict]) -> dict[str, list]:
    keys = ("reward_mean", "asked", "well_formed", "preference_accuracy", "reward_margin", "pairs")
    return {key: [h.get(key) for h in steps] for key in keys if any(key in h for h in steps)}


def train(out: Path, args: argparse.Namespace) -> tuple[Path, dict[str, list[dict]]]:
    """The shared warm start (a job of one RL step), then every recipe for every seed from
    it; returns the warm policy and, per recipe, one run per seed."""
    base = base_spec(out, args.steps)
    runs: dict[str, list[dict]] = {recipe: [] for recipe in args.recipes}
    with rig(out) as r:
        spec = copy.deepcopy(base) | {"name": "recipes-warm-start"}
        spec["train"]["num_steps"] = 1
        print(f"warm start ({WARM_START_STEPS} SFT steps)")
        warm = r.runs / run_job(r, spec)["job_id"] / "policy-warm-start"
        for seed in args.seeds:
            for recipe in args.recipes:
                print(f"\n{recipe}, seed {seed}")
                runs[recipe].append(run_recipe(r, base, recipe, warm, seed) | {"seed": seed})
                (out / "training.json").write_text(json.dumps({"warm_policy": str(warm), "runs": runs}))
    return warm, runs


FIGURES = ("success", "tokens", "asked")


def make_report(args: argparse.Namespace, runs: dict[str, list[dict]], results: dict, total_s: float) -> dict:
    rows = [
        {"policy": label, "seed": seed, **{k: result.get(k, 0.0) for k in FIGURES}}
        for (label, seed), result in results.items()
    ]
    summary = {}
    for label in (WARM, *args.recipes):
        mine = [r for r in rows if r["policy"] == label]
        summary[label] = {k: spread([r[k] for r in mine]) for k in FIGURES}
        if label in runs:
            summary[label]["responses"] = spread([run["responses"] for run in runs[label]])
            summary[label]["minutes"] = spread([run["seconds"] / 60 for run in runs[label]])
    success = {label: s["success"]["mean"] for label, s in summary.items()}
    checks = {}
    if "online DPO" in success:
        checks["online_dpo_at_least_0.85"] = summary["online DPO"]["success"]["mean"] >= 0.85
        if "next-turn GRPO" in success:
            checks["online_dpo_beats_next_turn_by_0.3"] = success["online DPO"] - success["next-turn GRPO"] >= 0.3
    if "offline DPO" in success:
        checks["offline_dpo_beats_warm_start"] = success["offline DPO"] > success[WARM]
    return {
        "steps": args.steps,
        "seeds": args.seeds,
        "eval_conversations": args.eval,
        "cpu_cores": os.cpu_count(),
        "total_seconds": total_s,
        "summary": summary,
        "checks": checks,
        "runs": rows,
        "curves": {
            recipe: [{"seed": run["seed"], **run["curve"]} for run in recipe_runs]
            for recipe, recipe_runs in runs.items()
        },
        "pairs": {"offline DPO": [run["pairs"] for run in runs.get("offline DPO", [])]},
    }


def print_report(report: dict) -> None:
    print(
        f"\nclarify task, {report['steps']} steps per recipe, {len(report['seeds'])} seed(s), "
        f"{report['eval_conversations']} held-out conversations per policy, {report['cpu_cores']} CPU cores, "
        f"{report['total_seconds'] / 60:.1f} min in all; min / mean / max over seeds"
    )
    print(
        f"{'policy':>18} {'success':>22} {'tokens/conv':>12} {'first turn asks':>16} {'responses':>10} {'minutes':>8}"
    )
    for label, s in report["summary"].items():
        cell = f"{s['success']['min']:.3f} / {s['success']['mean']:.3f} / {s['success']['max']:.3f}"
        responses = f"{s['responses']['mean']:.0f}" if "responses" in s else "-"
        minutes = f"{s['minutes']['mean']:.1f}" if "minutes" in s else "-"
        print(
            f"{label:>18} {cell:>22} {s['tokens']['mean']:>12.1f} {s['asked']['mean']:>16.3f} {responses:>10} "
            f"{minutes:>8}"
        )
    print("checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in report["checks"].items()))


def plot(report: dict, path: Path) -> None:
    """Held-out success per policy (mean and seeds), and the online recipes' asking curves."""
    plt = pyplot()
    fig, (bars, asks) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = list(report["summary"])
    for i, label in enumerate(labels):
        s = report["summary"][label]["success"]
        bars.bar(i, s["mean"], color="tab:gray" if label == WARM else "tab:blue", alpha=0.7)
        seeds = [r["success"] for r in report["runs"] if r["policy"] == label]
        bars.scatter([i] * len(seeds), seeds, color="black", s=12, zorder=3)
    bars.set_xticks(range(len(labels)), [label.replace(" ", "\n", 1) for label in labels], fontsize=8)
    bars.set_ylim(0, 1.05)
    bars.set_title("held-out task success (bar: mean; dots: seeds)")
    colours = dict(zip(RECIPES, ("tab:orange", "tab:blue", "tab:purple", "tab:green")))
    for recipe, runs in report["curves"].items():
        for run in runs:
            values = run.get("asked")
            if values:
                asks.plot(
                    range(1, len(values) + 1),
                    [float("nan") if v is None else v for v in values],
                    color=colours[recipe],
                    alpha=0.7,
                    lw=1.2,
                    label=recipe if run["seed"] == report["seeds"][0] else None,
                )
    asks.set_title("share of training responses that ask (online recipes)")
    asks.set_xlabel("learner step")
    asks.set_ylim(-0.05, 1.05)
    asks.grid(alpha=0.3)
    asks.legend(fontsize=8, loc="center right")
    fig.suptitle(f"CollabLLM recipes on the clarify task: {len(report['seeds'])} seed(s), one warm start")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, "collab_recipes", seeds="0,1,2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval", type=int, default=512, help="held-out conversations per policy")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    args = parser.parse_args()
    out = out_folder(args)
    started = time.monotonic()
    warm, runs = train(out, args)
    policies = {}
    for i, seed in enumerate(args.seeds):  # runs[recipe][i] is seed i's, in --seeds' order
        policies[(WARM, seed)] = warm
        policies |= {(recipe, seed): out / "runs" / runs[recipe][i]["job_id"] / "policy" for recipe in args.recipes}
    # Played as the demo job is (its model length and rollout settings), as the recipes were.
    results = asyncio.run(evaluate_policies(policies, load_spec_file(DEMO_SPEC), args.eval, seed=10_000))
    report = make_report(args, runs, results, time.monotonic() - started)
    print_report(report)
    write_report("collab_recipes", report, args, plot)


if __name__ == "__main__":
    main()
