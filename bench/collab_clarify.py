"""CollabLLM on the clarify task: the multiturn-aware reward vs a next-turn reward.

One warm start (a mix of asking and guessing dialogues), then RL twice through the whole
system (REST API, rollout server, learner), same steps and seed, differing only in the
reward: MR (window 2, 3 futures, lambda 5e-4) and its next-turn counterpart (window 0,
the same R*: task metric and token penalty). As CollabLLM trains every turn j, half the
training contexts stop after the user's clarification. The three policies (warm start,
MR, next-turn) are then evaluated on whole conversations that start from the bare request,
with held-out examples: task success, policy tokens per conversation, share of first turns
that ask.

With `--seeds 0,1,2` every reward is trained once per seed (train.seed, each job with its own
warm start) and the table gives every run and, per policy, the mean, min and max over seeds,
with the longest stretch of steps whose mean reward sat at R*'s floor.

With `--preset`, the MR run is the `collabllm` reward preset instead (services/presets.py:
the paper's w, S, lambda over every token from the response on, the interactivity judge,
here the stand-in provider, future temperature 0.8), and only it is trained. One departure
from the preset: no system prompt, since the tiny model's vocabulary, built from the task's
own corpus, spells the collaborative prompt in 417 tokens of its 512-token window.

Run: python -m bench.collab_clarify [--seeds 0,1,2,3,4] [--steps 60] [--eval 512] [--preset]
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

PRESET = {"MR, collabllm preset": {"preset": "collabllm"}}
WARM = "warm start (SFT)"
STAND_IN = (100_000_000, 1_000_000, 0)
"""The judge's stand-in provider (tpm, rpm, seed): limits no run reaches."""


def train(out: Path, steps: int, seeds: list[int], rewards: dict[str, dict]) -> dict[str, list[dict]]:
    """Every reward's RL job for every seed, one after the other, on one running system:
    per reward, one record per seed (job id, seconds, RL history). A judged reward gets the
    stand-in provider as its judge."""
    base = prepare(out, load_spec_file(DEMO_SPEC))
    base["train"] |= {"num_steps": steps, "kl_coef": KL_COEF, "lr": LR}
    base["task"]["followup_share"] = FOLLOWUP_SHARE
    base["task"]["system_prompt"] = None  # the preset's departure, see the docstring
    base["warm_start"]["steps"] = WARM_START_STEPS
    runs: dict[str, list[dict]] = {label: [] for label in rewards}
    with rig(out, stand_in=STAND_IN) as r:
        for seed in seeds:
            for label, reward in rewards.items():
                spec = copy.deepcopy(base) | {"name": f"clarify-{label.split()[0].strip(',')}-s{seed}"}
                spec["train"]["seed"] = seed
                spec["reward"] = reward | {"scale_advantage_by_std": False}
                done = run_job(r, spec)
                runs[label].append(
                    {
                        "seed": seed,
                        "job_id": done["job_id"],
                        "seconds": done["seconds"],
                        "history": rl_steps(done["history"]),
                    }
                )
    return runs


def floor_stretch(rewards: list[float], floor: float = -1.0, within: float = 0.05) -> int:
    """The longest run of consecutive steps whose mean reward sits at R*'s floor."""
    longest = current = 0
    for reward in rewards:
        current = current + 1 if reward <= floor + within else 0
        longest = max(longest, current)
    return longest


def policy_folders(out: Path, runs: dict[str, list[dict]], seeds: list[int], rewards: dict) -> dict:
    """(label, seed) -> the policy folder to evaluate: every reward's final policy, and the
    warm start of the first reward's job."""
    policies = {}
    for seed in seeds:
        job = {label: next(run["job_id"] for run in runs[label] if run["seed"] == seed) for label in rewards}
        policies[(WARM, seed)] = out / "runs" / job[next(iter(rewards))] / "policy-warm-start"
        policies |= {(label, seed): out / "runs" / job[label] / "policy" for label in rewards}
    return policies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, "collab_clarify", seeds="0")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval", type=int, default=512, help="held-out conversations per policy")
    parser.add_argument("--preset", action="store_true", help="train only MR under the collabllm preset")
    parser.add_argument(
        "--evaluate-only",
        action="store_true",
        help="evaluate the runs recorded in OUT/training.json instead of training",
    )
    args = parser.parse_args()
    rewards = PRESET if args.preset else REWARDS
    out = out_folder(args)
    started = time.monotonic()
    if args.evaluate_only:
        runs = json.loads((out / "training.json").read_text())
    else:
        runs = train(out, args.steps, args.seeds, rewards)
        (out / "training.json").write_text(json.dumps(runs))  # the runs, should evaluation fail
    policies = policy_folders(out, runs, args.seeds, rewards)
    # Played as the demo job is (its model length and rollout settings), as the runs were.
    results = asyncio.run(evaluate_policies(policies, load_spec_file(DEMO_SPEC), args.eval, seed=10_000))
    report = make_report(args, runs, results, time.monotonic() - started, rewards)
    print_report(report)
    write_report("collab_clarify", report, args, plot)


def make_report(
    args: argparse.Namespace, runs: dict[str, list[dict]], results: dict, total: float, rewards: dict[str, dict]
) -> dict:
    """Every run (policy x seed) with its held-out results and training curve, and per
    policy the spread over seeds."""
    rows = []
    for (label, seed), result in results.items():
        run = next((r for r in runs.get(label, []) if r["seed"] == seed), None)
        step_rewards = [h["reward_mean"] for h in run["history"]] if run else []
        rows.append(
            {
                "policy": label,
                "seed": seed,
                **result,
                "train_seconds": run["seconds"] if run else None,
                "job_id": run["job_id"] if run else None,
                "floor_stretch": floor_stretch(step_rewards) if run else None,
                "curve": {
                    key: [h.get(key) for h in run["history"]]
                    for key in (
                        "reward_mean",
                        "asked",
                        "zero_spread_share",
                        "well_formed",
                        "futures_malformed",
                        "entropy",
                        "is_capped_tokens",
                    )
                }
                if run
                else {},
            }
        )
    summary = {
        label: {
            "success": spread([r["success"] for r in rows if r["policy"] == label]),
            "asked": spread([r.get("asked", 0.0) for r in rows if r["policy"] == label]),
        }
        for label in [WARM, *rewards]
    }
    report = {
        "steps": args.steps,
        "seeds": args.seeds,
        "eval_conversations": args.eval,
        "cpu_cores": os.cpu_count(),
        "total_seconds": total,
        "rewards": rewards,
        "summary": summary,
        "runs": rows,
    }
    if rewards is REWARDS:
        mr, nt = (summary[label]["success"]["mean"] for label in REWARDS)
        report["mr_minus_next_turn_mean"] = mr - nt
    return report


def print_report(report: dict) -> None:
    print(
        f"\nclarify task, {report['steps']} RL steps per run, {len(report['seeds'])} seed(s) per reward, "
        f"{report['eval_conversations']} held-out conversations per policy, {report['cpu_cores']} CPU cores, "
        f"{report['total_seconds'] / 60:.1f} min in all"
    )
    print(
        f"{'policy':>22} {'seed':>4} {'success':>8} {'tokens/conv':>12} {'first turn asks':>16} "
        f"{'floor stretch':>14} {'train min':>10}"
    )
    for r in report["runs"]:
        minutes = f"{r['train_seconds'] / 60:.1f}" if r["train_seconds"] else "-"
        stretch = "-" if r["floor_stretch"] is None else str(r["floor_stretch"])
        print(
            f"{r['policy']:>22} {r['seed']:>4} {r['success']:>8.3f} {r['tokens']:>12.1f} "
            f"{r.get('asked', 0.0):>16.3f} {stretch:>14} {minutes:>10}"
        )
    print(f"\n{'policy':>22} {'success mean':>13} {'min':>6} {'max':>6}")
    for label, s in report["summary"].items():
        print(f"{label:>22} {s['success']['mean']:>13.3f} {s['success']['min']:>6.3f} {s['success']['max']:>6.3f}")
    if "mr_minus_next_turn_mean" in report:
        print(f"multiturn - next-turn success (means): {report['mr_minus_next_turn_mean']:+.3f}")


def plot(report: dict, path: Path) -> None:
    """Per step, for every run: the share of first turns that ask and the mean reward."""
    plt = pyplot()
    fig, (asks, reward) = plt.subplots(1, 2, figsize=(11, 4))
    colours = dict(zip(report["rewards"], ("tab:blue", "tab:orange")))
    for run in report["runs"]:
        if run["policy"] not in colours:
            continue
        label = run["policy"] if run["seed"] == report["seeds"][0] else None  # one legend entry per reward
        for ax, key in ((asks, "asked"), (reward, "reward_mean")):
            values = run["curve"][key]
            ax.plot(
                range(1, len(values) + 1),
                [float("nan") if v is None else v for v in values],
                color=colours[run["policy"]],
                alpha=0.6,
                lw=1.2,
                label=label,
            )
    asks.set_title("share of first turns that ask")
    reward.set_title("mean training reward (R* floor = -1)")
    for ax in (asks, reward):
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    asks.set_ylim(-0.05, 1.05)
    top = max((v for run in report["runs"] for v in run["curve"].get("reward_mean", []) if v is not None), default=1.0)
    reward.set_ylim(-1.05, max(1.05, top + 0.05))  # a judged reward reaches 2 (R_ext + R_llm)
    asks.legend(loc="center right", fontsize=8)
    fig.suptitle(f"Clarify task: {len(report['seeds'])} seed(s) per reward, one line per run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
