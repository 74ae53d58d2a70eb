"""`tandem eval`: a policy on a τ²-bench split, pass^1 ... pass^k per domain.

The policy runs on this process's own engine (any HF folder: `tandem model get`, or a job's
checkpoint through `tandem export`); the user simulator is whatever model the judge proxy
serves under `--user-model`. Every task of the split is played `trials` times through the
same episode loop, tools, worlds and verdict that training uses (`rollout.tasks.tau2`).

pass^k is τ-bench's: for a task that succeeded c times in n trials, the chance that k
trials drawn from them all succeed, C(c, k) / C(n, k), averaged over tasks; pass^1 is the
mean success. Its 95% interval is a percentile bootstrap over tasks (tasks are the unit
the benchmark samples), so a split of three tasks gets an honestly wide one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from services.config import (
    ModelSpec,
    RewardSpec,
    RLJob,
    RolloutSpec,
    Tau2Spec,
    ToolCatalog,
    TrainSpec,
)
from services.held_out import pass_hat_k

if TYPE_CHECKING:
    from rollout.engine import Engine
    from services.judge_client import JudgeClient

BOOTSTRAP_RESAMPLES = 2000
VERDICT = (
    "the benchmark's evaluation `all` (database, actions, communication; the default, as its leaderboard "
    "reports); natural-language assertions are not graded"
)
"""What the results say a success is."""


def interval(successes: list[int], trials: int, k: int, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of pass^k, resampling tasks."""
    rng = random.Random(seed)
    stats = sorted(pass_hat_k(rng.choices(successes, k=len(successes)), trials, k) for _ in range(BOOTSTRAP_RESAMPLES))
    return stats[int(0.025 * len(stats))], stats[int(0.975 * len(stats)) - 1]


def summary(successes: list[int], trials: int) -> dict:
    """pass^k with its interval for every k up to `trials`."""
    return {
        f"pass^{k}": {"value": pass_hat_k(successes, trials, k), "ci95": interval(successes, trials, k)}
        for k in range(1, trials + 1)
    }


def job_spec(model: str, domain: str, split: str, args: argparse.Namespace) -> RLJob:
    """The settings of one domain's evaluation, as the job spec a rollout server reads."""
    task = {"domain": domain, "split": split} | ({"num_examples": args.num_tasks} if args.num_tasks else {})
    return RLJob(
        model=ModelSpec(path=model, max_model_len=args.max_model_len),
        task=Tau2Spec.model_validate(task),
        rollout=RolloutSpec(
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            max_total_tokens=args.max_model_len,
            max_turns=args.max_turns,
        ),
        reward=RewardSpec(user_model=args.user_model),
        train=TrainSpec(seed=args.seed),
    )


async def evaluate_domain(engine: Engine, client: JudgeClient, spec: RLJob, trials: int, concurrency: int) -> dict:
    """Every task of the spec's split, `trials` times: per-task verdicts and how each ended."""
    from transformers import AutoTokenizer

    from rollout.assembly import open_tools, task_user
    from rollout.episode import EpisodeRunner
    from rollout.tasks.tau2 import Tau2Task
    from services.tokenization import ChatTokenizer

    task = spec.task
    if not isinstance(task, Tau2Spec):
        raise ValueError(f"task {task.name!r} is not a τ²-bench domain: tandem eval --domains plays those")
    task_set = Tau2Task(task)
    tools = await open_tools(task_set, spec, "eval", ToolCatalog(), allow_inline_mcp=False)
    if tools is None:
        raise ValueError(f"task {task.name!r} brings no tools: tandem eval --tau2 plays τ²-bench domains")
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(spec.model.path)).with_tools(tools.schemas(), tools.spec.parser)
    runner = EpisodeRunner(engine, chat, task_user(task_set, client, spec, "eval"), spec.rollout, tools, task_set.world)
    slots, done = asyncio.Semaphore(concurrency), Counter[str]()
    total = len(task_set) * trials

    async def one(example: int, trial: int) -> dict:
        async with slots:
            started = time.monotonic()
            episode = await runner.run(example, task_set.context(example), f"eval/{task.domain}/{example}/{trial}")
            verdict = await task_set.verdict(example, episode) if episode.well_formed() else None
        done["episodes"] += 1
        progress(done["episodes"], total, task.domain)
        return {
            "task": task_set.tasks[example].id,
            "trial": trial,
            "reward": verdict.reward if verdict else 0.0,
            "end": episode.end,
            "malformed": episode.malformed_reason(),
            "turns": episode.num_turns,
            "tool_calls": episode.tool_use.total,
            "tool_failures": dict(episode.tool_use.failures()),
            "policy_tokens": episode.policy_tokens,
            "seconds": round(time.monotonic() - started, 2),
            "messages": episode.messages[1:],
        }  # the conversation, less the system prompt every task shares

    rows = await asyncio.gather(*(one(e, t) for e in range(len(task_set)) for t in range(trials)))
    by_task: dict[str, list[dict]] = {}
    for row in rows:
        by_task.setdefault(row["task"], []).append(row)
    successes = [sum(r["reward"] >= 1.0 for r in task_rows) for task_rows in by_task.values()]
    return {
        "domain": task.domain,
        "split": task.split,
        "tasks": len(by_task),
        "trials": trials,
        **summary(successes, trials),
        "ends": dict(Counter(r["end"] for r in rows)),
        "tool_calls_per_episode": sum(r["tool_calls"] for r in rows) / len(rows),
        "episodes": rows,
    }


def progress(done: int, total: int, domain: str) -> None:
    """A bar that redraws on a terminal; a line per tenth of the work when output is a file."""
    if sys.stderr.isatty():
        bar = "#" * (30 * done // total)
        print(f"\r{domain}: [{bar:<30}] {done}/{total} episodes", end="" if done < total else "\n", file=sys.stderr)
    elif done == total or done % max(1, total // 10) == 0:
        print(f"{domain}: {done}/{total} episodes", file=sys.stderr)


def table(results: list[dict]) -> str:
    trials = max(r["trials"] for r in results)
    head = ["domain", "split", "tasks", "trials"] + [f"pass^{k} (95% CI)" for k in range(1, trials + 1)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["domain"], r["split"], str(r["tasks"]), str(r["trials"])]
        for k in range(1, trials + 1):
            p = r.get(f"pass^{k}")
            cells.append(f"{p['value']:.3f} ({p['ci95'][0]:.2f}-{p['ci95'][1]:.2f})" if p else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> list[dict]:
    from rollout.engine import Engine
    from services.judge_client import JudgeClient

    specs = [job_spec(args.model, domain, args.split, args) for domain in args.domains.split(",")]
    engine = await asyncio.to_thread(Engine.start, specs[0].model, args.kv_cache_gib, args.seed)
    client = JudgeClient(args.judge_url, args.judge_token)
    try:
        return [await evaluate_domain(engine, client, spec, args.trials, args.concurrency) for spec in specs]
    finally:
        await client.aclose()
        engine.shutdown()


def main(args: argparse.Namespace) -> None:
    results = asyncio.run(run(args))
    record = {
        "model": args.model,
        "user_model": args.user_model,
        "verdict": VERDICT,
        "settings": {k: v for k, v in vars(args).items() if k not in ("run", "judge_token")},
        "results": results,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(table(results))
