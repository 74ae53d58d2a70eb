"""CollabLLM on the clarify task: the multiturn-aware reward vs a next-turn reward.

One warm start (a mix of asking and guessing dialogues), then RL twice through the whole
system (REST API, rollout server, learner), same steps and seed, differing only in the
reward: MR (window 2, 3 futures, lambda 5e-4) and its next-turn counterpart (window 0,
the same R*: task metric and token penalty). As CollabLLM trains every turn j, half the
training contexts stop after the user's clarification. The three policies (warm start,
MR, next-turn) are then evaluated on whole conversations that start from the bare request,
with held-out examples: task success, policy tokens per conversation, share of first turns
that ask.

Run: python bench/collab_clarify.py [--steps 60] [--eval 512]
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

from services.client import ApiClient, follow, load_spec_file  # noqa: E402
from services.demo import DEMO_SPEC, prepare  # noqa: E402
from services.launcher import Ports, Stack  # noqa: E402

# Both runs: half the contexts are follow-ups (the question already asked and answered),
# so the answer turn is trained too. Advantages are centred but not divided by the group's
# std (Dr. GRPO): when every response in a group asks, their MRs differ only by the luck of
# the futures, and std scaling turned that luck into full-size updates that garbled the
# wording of the question; a small KL penalty to the warm start does the rest.
FOLLOWUP_SHARE = 0.5
KL_COEF = 0.0
LR = 5e-4
WARM_START_STEPS = 400
REWARDS = {
    "multiturn (w=2, S=3)": {"mode": "multiturn", "window": 2, "num_futures": 3, "token_penalty": 5e-4},
    "next-turn (w=0)": {"mode": "multiturn", "window": 0, "token_penalty": 5e-4},
}


def train(out: Path, steps: int) -> dict[str, dict]:
    """Both RL jobs, one after the other, on one running system; their history and runs."""
    base = prepare(out, load_spec_file(DEMO_SPEC))
    base["train"] |= {"num_steps": steps, "kl_coef": KL_COEF, "lr": LR}
    base["task"]["followup_share"] = FOLLOWUP_SHARE
    base["warm_start"]["steps"] = WARM_START_STEPS
    jobs = {}
    with Stack(out / "logs", ports=Ports.free(), extra_env={"TANDEM_RUNS_DIR": str(out / "runs")}) as stack:
        client = ApiClient(stack.api_url)
        for label, reward in REWARDS.items():
            spec = copy.deepcopy(base) | {"name": "clarify-" + label.split()[0]}
            spec["reward"] = reward | {"scale_advantage_by_std": False}
            job_id = client.submit(spec)["id"]
            started = time.monotonic()
            record = follow(client, job_id)
            if record["status"] != "SUCCEEDED":
                raise RuntimeError(f"{label}: {record['status']} {record.get('error')} (logs in {out / 'logs'})")
            jobs[label] = {"job_id": job_id, "seconds": time.monotonic() - started,
                           "history": [h for h in client.history(job_id) if h.get("phase") == "rl"]}
    return jobs


async def evaluate_policies(policies: dict[str, Path], examples: int, seed: int) -> dict[str, dict]:
    from transformers import AutoTokenizer

    from rollout.engine import Engine
    from rollout.episode import EpisodeRunner
    from rollout.evaluate import evaluate
    from rollout.tasks.clarify_task import ClarifyTask
    from services.config import ModelSpec, RolloutSpec, TaskSpec
    from services.tokenization import ChatTokenizer

    spec = load_spec_file(DEMO_SPEC)
    first = next(iter(policies.values()))
    engine = Engine.start(ModelSpec(path=str(first), max_model_len=spec["model"]["max_model_len"]), kv_cache_gib=1.0)
    task = ClarifyTask(TaskSpec(num_examples=examples), seed=seed)
    runner = EpisodeRunner(engine, ChatTokenizer(AutoTokenizer.from_pretrained(first)), task.rule_user,
                           RolloutSpec(**spec["rollout"]))
    results = {}
    try:
        for label, path in policies.items():
            await engine.reload_from_disk(str(path))
            results[label] = await evaluate(runner, task, list(range(examples)))
    finally:
        engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval", type=int, default=512, help="held-out conversations per policy")
    parser.add_argument("--out", default="bench/results/collab_clarify")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    jobs = train(out, args.steps)
    runs = out / "runs"
    policies = {"warm start (SFT)": runs / jobs[next(iter(REWARDS))]["job_id"] / "policy-warm-start"}
    policies |= {label: runs / job["job_id"] / "policy" for label, job in jobs.items()}
    results = asyncio.run(evaluate_policies(policies, args.eval, seed=10_000))
    total = time.monotonic() - started

    mr, nt = (results[label]["success"] for label in REWARDS)
    print(f"\nclarify task, {args.steps} RL steps per reward, {args.eval} held-out conversations per policy, "
          f"{os.cpu_count()} CPU cores, {total / 60:.1f} min in all")
    print(f"{'policy':>22} {'success':>8} {'tokens/conv':>12} {'first turn asks':>16} {'train min':>10}")
    for label, r in results.items():
        minutes = f"{jobs[label]['seconds'] / 60:.1f}" if label in jobs else "-"
        print(f"{label:>22} {r['success']:>8.3f} {r['tokens']:>12.1f} {r.get('asked', 0.0):>16.3f} {minutes:>10}")
    print(f"multiturn - next-turn success: {mr - nt:+.3f}")
    report = {"steps": args.steps, "eval_conversations": args.eval, "cpu_cores": os.cpu_count(),
              "total_seconds": total, "results": results, "mr_minus_next_turn": mr - nt,
              "training": {label: {"job_id": j["job_id"], "seconds": j["seconds"],
                                   "asked": [h.get("asked") for h in j["history"]],
                                   "reward": [h["reward_mean"] for h in j["history"]]}
                           for label, j in jobs.items()}}
    (out / "collab_clarify.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "collab_clarify.png")
    print(f"wrote {out / 'collab_clarify.json'} and {out / 'collab_clarify.png'}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, run in report["training"].items():
        ax.plot(range(1, len(run["asked"]) + 1), run["asked"], label=f"{label}: share of responses that ask")
    ax.set_xlabel("learner step")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right")
    ax.set_title("Clarify task: what each reward teaches the first turn")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
