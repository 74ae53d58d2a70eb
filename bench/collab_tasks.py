"""CollabLLM's three tasks under the `collabllm` preset, end to end with a real model.

SmolLM2-135M-Instruct plays every part: the policy (Tandem's rollout engine and learner),
and, served by `tandem serve-model` behind the judge proxy, the user simulator (a person)
and the interactivity judge. R_ext is the task's rule (exact match, BLEU, unit tests) over
the whole conversation. Departures from the preset, each for this machine or this model:
the task's own opening request (the 135M simulator's were unrelated to the task), group
size, batch and steps, 512 new tokens per turn, responses sampled at the futures'
temperature, and one CPU thread per process (two vLLM engines share 2 cores).
Per task:
1. a `generate` job: MR-ranked conversations (at each turn `group_size` responses, each
   scored by MR over 3 futures of w = 2 turns; the best carries on);
2. an `rl` job on every turn of those conversations (`task.contexts`), GRPO on MR.
The history of the RL job is the curve: mean MR of the trained responses, the task metric
of their futures, the turn trained, tokens, and LLM tokens spent. One seed per task by
default: this shows the machinery runs and what it does with a 135M model, not a learning
result.

Needs the model (`tandem model get smollm2-135m-instruct models/smollm2-135m-instruct`,
done here if missing). Run: python -m bench.collab_tasks [--tasks math_chat,...] [--steps 10] [--seeds 0]
Writes <out>/collab_tasks.json and .png after every task (`--publish` copies them into
docs/results/); the report's other tasks are kept, so tasks can run one command at a time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.harness import REPO, Rig, common_args, out_folder, pyplot, rig, rl_steps, write_report
from rollout.tasks.contexts import turn_contexts
from tandem.cli.arguments import count
from tandem.client import follow
from tandem.launcher import local_upstream_file, served_model
from tandem.models import get

MODEL = REPO / "models" / "smollm2-135m-instruct"
SERVED = "smollm2"
METRIC = {"math_chat": "exact_match", "doc_edit_chat": "bleu", "code_chat": "has_code"}
ROLLOUT = {"max_new_tokens": 512, "max_turns": 2, "max_total_tokens": 3072}
"""A first run at 256 new tokens and temperature 1.0 had every trained math response cut at
the limit: all scored at R*'s floor, no spread, no gradient. Responses are sampled at the
preset's future temperature of their task (0.6 or 0.8), as their futures are."""


def spec(task: str, kind: str, args, seed: int, contexts: Path | None = None, num_examples: int = 0) -> dict:
    """The preset's job for `task`, its LLM parts the served model; what departs from the
    paper is written here: the group size, batch and steps this machine can afford."""
    from services.presets import collabllm

    temperature = collabllm({"name": task})["reward"]["future_temperature"]
    task_section = {"name": task} | ({"contexts": str(contexts), "num_examples": num_examples} if contexts else {})
    job = {
        "name": f"collab-{task}-{kind}",
        "kind": kind,
        "model": {"path": str(MODEL), "max_model_len": 4096},
        "task": task_section,
        "rollout": ROLLOUT | {"group_size": args.group_size, "temperature": temperature},
        "reward": {"preset": "collabllm", "judge_model": SERVED, "user_model": SERVED, "judge_mode": "group"},
        "train": {"num_steps": args.steps, "batch_size": args.batch, "lr": 2e-5, "max_staleness": 2, "seed": seed},
    }
    if kind == "generate":
        job["generate"] = {"conversations": args.conversations}
        # The preset has the simulator write the opening. SmolLM2-135M's had nothing to do
        # with the problem (a math problem's: "Not yet. Aim at 1 month and I hope you don't
        # let me go."), so the conversations open with the task's own request.
        job["task"] |= {"num_examples": args.conversations, "opening": "task"}
    return job


def run_task(r: Rig, task: str, args, seed: int) -> dict:
    """The generate job, then RL on its conversations' turns. A job that fails is recorded,
    not raised: the other tasks still run."""
    started = time.monotonic()
    generated = r.client.submit(spec(task, "generate", args, seed))["id"]
    record = follow(r.client, generated)
    if record["status"] != "SUCCEEDED":
        return {"task": task, "seed": seed, "status": f"generate {record['status']}: {record.get('error')}"}
    sft = r.runs / generated / "dataset" / "sft.jsonl"
    try:
        contexts = turn_contexts(sft, limit=10_000)
    except ValueError as err:  # no well-formed ranked conversation: nothing to train on
        return {"task": task, "seed": seed, "status": f"generate gave no contexts: {err}", "generate_job": generated}
    generate_s = time.monotonic() - started
    job_id = r.client.submit(spec(task, "rl", args, seed, sft, len(contexts)))["id"]
    record = follow(r.client, job_id)
    history = rl_steps(r.client.history(job_id))
    return {
        "task": task,
        "seed": seed,
        "status": record["status"],
        "error": record.get("error"),
        "generate_job": generated,
        "rl_job": job_id,
        "contexts": len(contexts),
        "turns": sorted({c.turn for c in contexts}),
        "generate_seconds": generate_s,
        "seconds": time.monotonic() - started,
        "spec": spec(task, "rl", args, seed, sft, len(contexts)),
        "history": history,
    }


def recorded(path: Path, task: str, seed: int) -> list[dict]:
    """The report's other runs (task and seed), so that tasks can run one command at a time."""
    if not path.is_file():
        return []
    return [r for r in json.loads(path.read_text())["results"] if (r["task"], r.get("seed", 0)) != (task, seed)]


def title(result: dict) -> str:
    """A run's name in the table and the figure: its task, and its seed unless 0."""
    return result["task"] + (f", seed {result['seed']}" if result.get("seed") else "")


def table(results: list[dict]) -> str:
    rows = [
        "| task | contexts (turns) | steps | MR first 3 -> last 3 steps | task metric | turn trained | "
        "well-formed | LLM tokens / step | wall time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        h = r.get("history", [])
        if not h:
            rows.append(f"| {title(r)} | - | 0 | {r['status']} | | | | | |")
            continue
        mean = lambda key, part: sum(s.get(key, 0.0) for s in part) / len(part)  # noqa: E731
        metric = METRIC[r["task"]]
        rows.append(
            f"| {title(r)} | {r['contexts']} ({', '.join(map(str, r['turns']))}) | {len(h)} | "
            f"{mean('reward_mean', h[:3]):.3f} -> {mean('reward_mean', h[-3:]):.3f} | "
            f"{metric} {mean(metric, h[:3]):.2f} -> {mean(metric, h[-3:]):.2f} | {mean('turn', h):.2f} | "
            f"{mean('well_formed', h):.2f} | {mean('llm_tokens_step', h) / 1000:.1f}k | {r['seconds'] / 60:.1f} min |"
        )
    return "\n".join(rows)


def plot(report: dict, path: Path) -> None:
    """Per run and RL step: MR of the trained responses, the task metric and the well-formed share."""
    plt = pyplot()
    results = report["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        h = r.get("history", [])
        steps = [s["step"] for s in h]
        ax.plot(steps, [s.get("reward_mean", 0) for s in h], marker="o", label="MR (trained responses)")
        ax.plot(steps, [s.get(METRIC[r["task"]], 0) for s in h], marker="s", label=f"{METRIC[r['task']]} (futures)")
        ax.plot(steps, [s.get("well_formed", 0) for s in h], ls=":", label="well-formed")
        ax.set_title(f"{title(r)} ({r.get('contexts', 0)} contexts)")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("collabllm preset, SmolLM2-135M-Instruct as policy, simulator and judge (one seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(parser, "collab_tasks", seeds="0")
    parser.add_argument("--tasks", default="math_chat,doc_edit_chat,code_chat")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=3, help="Ranked conversations per task.")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--threads",
        type=count,
        default=1,
        help="CPU threads of each process (the served model, the policy engine, the learner); 0: all",
    )
    args = parser.parse_args()
    out = out_folder(args)
    settings = vars(args) | {"out": str(out)}  # the report is JSON
    if not MODEL.is_dir():
        get("smollm2-135m-instruct", MODEL)
    upstreams = out / "upstreams.yaml"
    report = {"settings": settings, "results": []}
    # Two vLLM engines (the policy's and the served model) share this machine's cores: one
    # OpenMP thread each, or their spinning threads slow each to a fourteenth of its speed
    # (bench.shared_cpu_engines).
    threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    with served_model(MODEL, SERVED, out / "serve-model.log", max_model_len=4096, threads=args.threads) as url:
        local_upstream_file(upstreams, "smollm2-local", SERVED, url, MODEL / "tokenizer.json", structured_output=True)
        with rig(out, env={"TANDEM_UPSTREAMS": str(upstreams)} | threads) as r:
            for task in args.tasks.split(","):
                for seed in args.seeds:
                    done = run_task(r, task, args, seed)
                    report["results"] = recorded(out / "collab_tasks.json", task, seed) + [done]
                    write_report("collab_tasks", report, args, plot)
    print(table(report["results"]))


if __name__ == "__main__":
    main()
