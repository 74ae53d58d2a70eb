"""τ²-bench's mock domain with a real model: untrained, after a warm start, after RL.

SmolLM2-135M-Instruct is the policy (Tandem's engine and learner). The benchmark's user,
behind the judge proxy, is one of (`--simulator`):
- `smollm2`: the same model, served by `tandem serve-model`. At 135M it does not play a
  customer: it answers the greeting as an assistant would and never states the request
  (README), so nothing can be learned from its conversations;
- `scripted`: the repo's stand-in provider, which states the scenario's instructions as its
  request and ends the conversation at the agent's first answer (`###STOP###`). The task
  is then learnable: make the right calls in that answer, as the oracle does.
Per seed:
1. an `rl` job on the mock train split (6 tasks) that first fine-tunes on the oracle's
   conversations of those tasks (`rollout.tasks.tau2.oracle`: the expected calls with the
   environment's answers, then what the task expects said), then trains with GRPO on the
   benchmark's verdict;
2. `tandem eval` of the warm-started policy (`runs/<job>/policy-warm-start`) and of the
   final one on the test split (3 tasks, one of each kind), `--trials` conversations each.
The untrained model is evaluated once, as the baseline of the same run. Quoted: pass^1 on
the test split over seeds (min, mean, max), and each RL step's pass rate on the train split.

Two vLLM engines share this machine's 2 cores (the policy's and the simulator's): one OpenMP
thread each (bench.shared_cpu_engines). Needs the model (fetched here if missing).
Run: python -m bench.tau2_mock [--seeds 0,1,2] [--steps 6] [--warm-steps 12] [--trials 4]
(about 20 minutes a seed here: a warm-start step takes about a minute on 2 cores).
Writes <out>/tau2_mock.json, after the baseline and after every seed, and at the end
<out>/tau2_mock.png; `--publish` copies them into docs/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench.harness import REPO, common_args, out_folder, pyplot, rig, rl_steps, spread, write_report
from tandem.client import follow
from tandem.launcher import local_upstream_file, served_model
from tandem.models import get

MODEL = REPO / "models" / "smollm2-135m-instruct"
SERVED = "smollm2-user"
MAX_LEN = 3072
"""The mock context is about 1,100 SmolLM2 tokens (the policy and the tools in the system
turn); a conversation of a few turns with tool answers fits in the rest."""


def demonstrations(path: Path) -> int:
    """The oracle's conversations of the train split, with the tools they were had with.
    A task that lists no expected call, only an end state (an environment assertion), is
    left out: its oracle would claim success without acting."""
    from rollout.tasks.tau2 import Tau2Task
    from rollout.tasks.tau2.oracle import demonstration
    from services.config import Tau2Spec

    task_set = Tau2Task(Tau2Spec(domain="mock", split="train"))
    tools = [tool.schema() for tool in task_set.tools()]
    rows = [
        {"messages": demonstration(task_set, i), "tools": tools}
        for i, task in enumerate(task_set.tasks)
        if task.evaluation_criteria.actions or not task.evaluation_criteria.env_assertions
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def job(seed: int, args, warm: Path) -> dict:
    """One seed's RL job on the train split, with its warm start on the oracle's conversations."""
    return {
        "name": f"tau2-mock-{seed}",
        "model": {"path": str(MODEL), "max_model_len": MAX_LEN},
        "task": {"name": "tau2", "domain": "mock", "split": "train"},
        "tools": {"max_calls_per_episode": 8, "max_rounds_per_turn": 3},
        "rollout": {
            "group_size": args.group_size,
            "max_new_tokens": 256,
            "max_turns": 4,
            "max_total_tokens": MAX_LEN,
            "temperature": 1.0,
        },
        "reward": {"user_model": SERVED},
        # 4,096 tokens a micro-batch: SmolLM2's 49k-word logits over the default 16k took the
        # learner past this machine's memory beside two engines (it was killed at its first step).
        "train": {
            "num_steps": args.steps,
            "batch_size": args.batch,
            "lr": args.lr,
            "max_staleness": 2,
            "seed": seed,
            "max_tokens_per_rank": 4096,
        },
        "warm_start": {"data": str(warm), "steps": args.warm_steps, "batch_size": 4, "lr": 5e-5},
    }


def evaluate(policy: Path, judge_url: str, args, out: Path, env: dict) -> dict:
    """`tandem eval` of a policy folder on the test split; its result for the domain."""
    command = [
        sys.executable,
        "-m",
        "tandem.cli",
        "eval",
        str(policy),
        "--domains",
        "mock",
        "--split",
        "test",
        "--trials",
        str(args.trials),
        "--judge-url",
        judge_url,
        "--user-model",
        SERVED,
        "--max-model-len",
        str(MAX_LEN),
        "--max-new-tokens",
        "256",
        "--max-turns",
        "4",
        "--concurrency",
        "6",
        "--kv-cache-gib",
        "1",
        "--seed",
        "0",
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True, env=os.environ | env)
    [result] = json.loads(out.read_text())["results"]
    return result


@contextlib.contextmanager
def simulator(kind: str, out: Path) -> Iterator[str]:
    """The base URL of the user simulator's provider (no /v1)."""
    if kind == "smollm2":
        with served_model(MODEL, SERVED, out / "serve-model.log", max_model_len=4096, threads=1) as url:
            yield url
        return
    from devtools.provider import LocalUpstreamConfig, create_app, serve_in_thread
    from tandem.redis_embed import free_port

    config = LocalUpstreamConfig(tpm=10_000_000, rpm=100_000, models=[SERVED])
    with serve_in_thread(create_app(config), free_port()) as url:
        yield url


def plot(record: dict, path: Path) -> None:
    """Each seed's pass rate per RL step, and pass^1 on the test split per stage."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in record["seeds"]:
        steps = [h["step"] for h in run["history"]]
        left.plot(steps, [h["reward_mean"] for h in run["history"]], marker="o", label=f"seed {run['seed']}")
    left.set(
        xlabel="RL step", ylabel="pass rate (train split, sampled)", title="GRPO on the verdict", ylim=(-0.05, 1.05)
    )
    left.legend()
    stages = ["untrained", "warm start", "after RL"]
    values = [
        [record["untrained"]["pass^1"]["value"]],
        [r["warm_start"]["pass^1"]["value"] for r in record["seeds"]],
        [r["after_rl"]["pass^1"]["value"] for r in record["seeds"]],
    ]
    for x, ys in enumerate(values):
        right.scatter([x] * len(ys), ys, color="C0")
        if ys:
            right.hlines(statistics.mean(ys), x - 0.2, x + 0.2, color="C1")
    right.set(
        xticks=range(3),
        xticklabels=stages,
        ylabel="pass^1 (test split)",
        ylim=(-0.05, 1.05),
        title="held-out tasks (dots: seeds, bar: mean)",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(record: dict) -> str:
    rows = ["| stage | pass^1 on test, min / mean / max over seeds | pass^2 mean |", "|---|---|---|"]

    def row(name: str, results: list[dict]) -> None:
        s = spread([r["pass^1"]["value"] for r in results])
        p2 = statistics.mean(r["pass^2"]["value"] for r in results) if results and "pass^2" in results[0] else ""
        rows.append(
            f"| {name} | {s['min']:.2f} / {s['mean']:.2f} / {s['max']:.2f} | {p2 if p2 == '' else f'{p2:.2f}'} |"
        )

    row("untrained", [record["untrained"]])
    if record["seeds"]:
        row("warm start (SFT on oracle conversations)", [r["warm_start"] for r in record["seeds"]])
        row("after RL", [r["after_rl"] for r in record["seeds"]])
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(parser, "tau2_mock", seeds="0,1,2")  # --seeds "": the untrained baseline alone
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="groups per RL step")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warm-steps", type=int, default=12)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--simulator", choices=["scripted", "smollm2"], default="scripted")
    args = parser.parse_args()
    out = out_folder(args)
    if not MODEL.is_dir():
        get("smollm2-135m-instruct", MODEL)
    warm = out / "warm.jsonl"
    settings = vars(args) | {"out": str(out)}  # the report is JSON
    record = {"settings": settings, "demonstrations": demonstrations(warm), "seeds": []}
    one_thread = {"OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    with simulator(args.simulator, out) as url:
        upstreams = local_upstream_file(out / "upstreams.yaml", args.simulator, SERVED, url, MODEL / "tokenizer.json")
        # The learner computes while the engines mostly wait on each other: it gets both cores
        # (its warm start of 1,500-token rows took a minute a step on one).
        learner_threads = {"learner": {"OMP_NUM_THREADS": str(os.cpu_count())}}
        with rig(out, env={"TANDEM_UPSTREAMS": str(upstreams)} | one_thread, env_for=learner_threads) as r:
            judge_url = r.stack.judge_url
            record["untrained"] = evaluate(MODEL, judge_url, args, out / "eval-untrained.json", one_thread)
            write_report("tau2_mock", record, args)
            for seed in args.seeds:
                job_id = r.client.submit(job(seed, args, warm))["id"]
                status = follow(r.client, job_id)
                run = {
                    "seed": seed,
                    "job": job_id,
                    "status": status["status"],
                    "error": status.get("error"),
                    "history": rl_steps(r.client.history(job_id)),
                }
                if status["status"] != "SUCCEEDED":  # kept and reported, never averaged in
                    record.setdefault("failed", []).append(run)
                    continue
                job_dir = r.runs / job_id
                run["warm_start"] = evaluate(
                    job_dir / "policy-warm-start", judge_url, args, out / f"eval-{seed}-warm.json", one_thread
                )
                run["after_rl"] = evaluate(
                    job_dir / "policy", judge_url, args, out / f"eval-{seed}-rl.json", one_thread
                )
                record["seeds"].append(run)
                record["seconds"] = time.monotonic() - started
                write_report("tau2_mock", record, args)
    print(table(record))
    write_report("tau2_mock", record, args, plot)


if __name__ == "__main__":
    main()
