"""Evaluate a policy on whole conversations: task success, length, first-turn behaviour.

One held-out example is played as one whole conversation from the task's own opening, with
the same episode code that training uses, and scored without training on it: success is
R_ext of the conversation (0 when the format filter rejects it), with the policy's tokens,
its turns, the task's own metrics, the tools' use and, when the job's reward has a judge
rubric, the judge's score with it (`judge`: CollabLLM's interactivity under its preset).

Rollout servers run it for a job's `eval` rounds (`HeldOutPlayer`); benchmarks and
`tandem eval` run it on exported policies (`evaluate`).
"""

from __future__ import annotations

import asyncio
import time

from rollout.episode import Episode, EpisodeRunner
from rollout.rewards.conversation import judged
from rollout.tasks.base import Judge, TaskSet
from rollout.tools.box import usage_metrics
from services import protocol
from services.judge_client import SPEND, Spend
from services.stats import mean_by_key


async def play_held_out(
    runner: EpisodeRunner,
    task: TaskSet,
    example: int,
    trace: str = "",
    judge: Judge | None = None,
    rubric: str | None = None,
) -> tuple[dict[str, float], Episode]:
    """One conversation of `example` and its scores (the module's docstring lists them),
    with what its judge and simulator calls cost. Runs in a task of its own (a `SPEND`)."""
    spend = Spend(role="eval")
    SPEND.set(spend)
    episode = await runner.run(example, task.context(example), trace)
    ok = episode.well_formed()
    row = {
        "success": await task.score(example, episode.messages, episode) if ok else 0.0,
        "tokens": float(episode.policy_tokens),
        "turns": float(episode.num_turns),
        "well_formed": float(ok),
    }
    if runner.tools is not None:
        row |= usage_metrics(episode.tool_use)
    if ok:
        row |= task.metrics(example, episode.messages)
    if ok and judge is not None and rubric:
        (verdict,) = await judge.score_all(rubric, [judged(episode.messages)], None, f"{trace}/judge")
        row["judge"] = verdict.score
    return row | {
        "judge_tokens": float(spend.judge_tokens),
        "simulator_tokens": float(spend.simulator_tokens),
        "remembered_calls": float(spend.remembered_calls),
    }, episode


async def evaluate(runner: EpisodeRunner, task: TaskSet, examples: list[int], concurrency: int = 32) -> dict:
    """Means over `examples` of what `play_held_out` scores, and their number."""
    slots = asyncio.Semaphore(concurrency)

    async def one(example: int) -> dict[str, float]:
        async with slots:
            row, _ = await asyncio.create_task(play_held_out(runner, task, example, f"eval/e{example}"))
        return row

    rows = await asyncio.gather(*(one(e) for e in examples))
    return mean_by_key(rows) | {"episodes": len(rows)}


class HeldOutPlayer:
    """A rollout server's player of one job's held-out conversations: its held-out task set,
    a runner whose user and tools are that set's, and the job's judge and rubric."""

    def __init__(
        self, runner: EpisodeRunner, task: TaskSet, judge: Judge, rubric: str | None, server_id: str, job_id: str
    ) -> None:
        self.runner, self.task, self.judge, self.rubric = runner, task, judge, rubric
        self.server_id, self.job_id = server_id, job_id

    async def play(self, task: protocol.EvalTask) -> protocol.EvalResult:
        """The task's conversation, scored."""
        started = time.perf_counter()
        trace = f"eval{task.round}/e{task.example}/t{task.trial}"
        row, episode = await play_held_out(self.runner, self.task, task.example, trace, self.judge, self.rubric)
        versions = [v for v, m in zip(episode.versions, episode.mask) if m and v >= 0]
        return protocol.EvalResult(
            job_id=self.job_id,
            round=task.round,
            example=task.example,
            trial=task.trial,
            server_id=self.server_id,
            metrics=row,
            versions=[min(versions), max(versions)] if versions else [],
            elapsed_s=time.perf_counter() - started,
            conversation=[{"role": m["role"], "content": str(m.get("content") or "")} for m in episode.messages],
        )
