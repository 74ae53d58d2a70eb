"""CollabLLM on the clarify task: the multiturn-aware reward vs a next-turn reward.

One warm start (a mix of asking and guessing dialogues), then RL twice through the whole
system (REST API, rollout server, learner), same steps and seed, differing only in the
reward: MR (window 2, 3 futures, lambda 5e-4) and its next-turn counterpart (window 0,
the same R*: task metric and token penalty). As CollabLLM trains every turn j, half the
training contexts stop after the user's clarification. The three policies (warm start,
MR, next-turn) are then evaluated on whole conversations that start from the bare request,
with held-out examples: task success, policy tokens per conversation, share of first turns
that ask.

With `--seeds N` every reward is trained N times (train.seed 0..N-1, each job with its own
warm start) and the table gives every run and, per policy, the mean, min and max over seeds,
with the longest stretch of steps whose mean reward sat at R*'s floor.

With `--preset`, the MR run is the `collabllm` reward preset instead (services/presets.py:
the paper's w, S, lambda over every token from the response on, the interactivity judge,
here the stand-in provider, future temperature 0.8), and only it is trained. One departure
from the preset: no system prompt, since the tiny model's vocabulary, built from the task's
own corpus, spells the collaborative prompt in 417 tokens of its 512-token window.

Run: python bench/collab_clarify.py [--seeds 5] [--steps 60] [--eval 512] [--preset]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tandem.client import ApiClient, follow, load_spec_file  # noqa: E402
from tandem.demo import DEMO_SPEC, prepare  # noqa: E402
from tandem.launcher import Ports, Stack  # noqa: E402

# Both runs: half the contexts are follow-ups (the question already asked and answered),
# so the answer turn is trained too. Advantages are centred but not divided by the group's
# std (Dr. GRPO): when every response in a group asks, their MRs differ only by the luck of
# the futures, and std scaling turned that luck into full-size updates that garbled the
# wording of the question. A small KL penalty to the warm start (k3, per token) holds in
# place what the reward barely looks at: with w = 2 a second question scores almost as well
# as the answer (the future answers instead), and without the anchor one seed in five let
# its answer turn drift (held-out success 0.656; 0.914 with the anchor).
FOLLOWUP_SHARE = 0.5
KL_COEF = 0.02
LR = 5e-4
WARM_START_STEPS = 400
REWARDS = {
    "multiturn (w=2, S=3)": {"mode": "multiturn", "window": 2, "num_futures": 3, "token_penalty": 5e-4},
    "next-turn (w=0)": {"mode": "multiturn", "window": 0, "token_penalty": 5e-4},
}
PRESET = {"MR, collabllm preset": {"preset": "collabllm"}}


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
    from async_speedup import StandIn  # here: async_speedup imports this module

    stand_in = StandIn(out, tpm=100_000_000, rpm=1_000_000, seed=0)
    env = {"TANDEM_RUNS_DIR": str(out / "runs"), "TANDEM_UPSTREAMS": str(stand_in.upstreams_file)}
    try:
        with Stack(out / "logs", ports=Ports.free(), extra_env=env) as stack:
            client = ApiClient(stack.api_url)
            for seed in seeds:
                for label, reward in rewards.items():
                    spec = copy.deepcopy(base) | {"name": f"clarify-{label.split()[0].strip(',')}-s{seed}"}
                    spec["train"]["seed"] = seed
                    spec["reward"] = reward | {"scale_advantage_by_std": False}
                    job_id = client.submit(spec)["id"]
                    started = time.monotonic()
                    record = follow(client, job_id)
                    if record["status"] != "SUCCEEDED":
                        raise RuntimeError(
                            f"{label} seed {seed}: {record['status']} {record.get('error')} (logs in {out / 'logs'})"
                        )
                    runs[label].append(
                        {
                            "seed": seed,
                            "job_id": job_id,
                            "seconds": time.monotonic() - started,
                            "history": [h for h in client.history(job_id) if h.get("phase") == "rl"],
                        }
                    )
    finally:
        stand_in.stop()
    return runs


def floor_stretch(rewards: list[float], floor: float = -1.0, within: float = 0.05) -> int:
    """The longest run of consecutive steps whose mean reward sits at R*'s floor."""
    longest = current = 0
    for reward in rewards:
        current = current + 1 if reward <= floor + within else 0
        longest = max(longest, current)
    return longest


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


async def evaluate_policies(
    policies: dict[tuple[str, int], Path], examples: int, seed: int, job: dict | None = None
) -> dict:
    """Each policy ((label, seed) -> folder) on the same held-out conversations, one engine,
    played with the model length and rollout settings of `job` (a job spec; default the demo's)."""
    from transformers import AutoTokenizer

    from rollout.engine import Engine
    from rollout.episode import EpisodeRunner
    from rollout.evaluate import evaluate
    from rollout.tasks.clarify.task import ClarifyTask
    from services.config import ClarifySpec, ModelSpec, RolloutSpec
    from services.tokenization import ChatTokenizer

    spec = job or load_spec_file(DEMO_SPEC)
    first = next(iter(policies.values()))
    engine = Engine.start(ModelSpec(path=str(first), max_model_len=spec["model"]["max_model_len"]), kv_cache_gib=1.0)
    task = ClarifyTask(ClarifySpec(num_examples=examples), seed=seed)
    runner = EpisodeRunner(
        engine, ChatTokenizer(AutoTokenizer.from_pretrained(first)), task.rule_user, RolloutSpec(**spec["rollout"])
    )
    results = {}
    try:
        for key, path in policies.items():
            await engine.reload_from_disk(str(path))
            results[key] = await evaluate(runner, task, list(range(examples)))
    finally:
        engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=1, help="runs per reward, train.seed = 0..N-1")
    parser.add_argument("--eval", type=int, default=512, help="held-out conversations per policy")
    parser.add_argument("--out", default="bench/results/collab_clarify")
    parser.add_argument("--preset", action="store_true", help="train only MR under the collabllm preset")
    parser.add_argument(
        "--evaluate-only",
        action="store_true",
        help="evaluate the runs recorded in OUT/training.json instead of training",
    )
    args = parser.parse_args()
    rewards = PRESET if args.preset else REWARDS
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    seeds = list(range(args.seeds))
    if args.evaluate_only:
        runs = json.loads((out / "training.json").read_text())
    else:
        runs = train(out, args.steps, seeds, rewards)
        (out / "training.json").write_text(json.dumps(runs))  # the runs, should evaluation fail
    policies = {}
    for i, seed in enumerate(seeds):
        first = runs[next(iter(rewards))][i]["job_id"]
        policies[(WARM, seed)] = out / "runs" / first / "policy-warm-start"
        policies |= {(label, seed): out / "runs" / runs[label][i]["job_id"] / "policy" for label in rewards}
    results = asyncio.run(evaluate_policies(policies, args.eval, seed=10_000))
    total = time.monotonic() - started
    report = make_report(args, runs, results, total, rewards)
    print_report(report)
    (out / "collab_clarify.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "collab_clarify.png", rewards)
    print(f"wrote {out / 'collab_clarify.json'} and {out / 'collab_clarify.png'}")


WARM = "warm start (SFT)"


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
        f"\nclarify task, {report['steps']} RL steps per run, {report['seeds']} seed(s) per reward, "
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


def plot(report: dict, path: Path, rewards: dict[str, dict]) -> None:
    """Per step, for every run: the share of first turns that ask and the mean reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (asks, reward) = plt.subplots(1, 2, figsize=(11, 4))
    colours = dict(zip(rewards, ("tab:blue", "tab:orange")))
    for run in report["runs"]:
        if run["policy"] not in colours:
            continue
        label = run["policy"] if run["seed"] == 0 else None
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
    fig.suptitle(f"Clarify task: {report['seeds']} seed(s) per reward, one line per run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
