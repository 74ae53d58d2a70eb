"""Evaluate a policy on whole conversations: task success, length, first-turn behaviour.

Used by benchmarks to compare trained policies on held-out examples with the same
episode code that training uses.
"""

from __future__ import annotations

import asyncio

from rollout.episode import EpisodeRunner
from rollout.tasks.base import TaskSet
from rollout.tools.box import usage_metrics
from services.stats import mean_by_key


async def evaluate(runner: EpisodeRunner, task: TaskSet, examples: list[int], concurrency: int = 32) -> dict:
    """Mean over `examples` of: success (R_ext of the whole conversation, 0 if malformed),
    policy tokens per conversation, the task's own metrics (e.g. `asked`) and, with tools,
    the episode's tool use (`rollout.tools.box.usage_metrics`)."""
    slots = asyncio.Semaphore(concurrency)

    async def one(example: int) -> dict[str, float]:
        async with slots:
            episode = await runner.run(example, task.context(example))
        ok = episode.well_formed()
        row = {
            "success": await task.score(example, episode.messages, episode) if ok else 0.0,
            "tokens": float(episode.policy_tokens),
            "turns": float(episode.num_turns),
            "well_formed": float(ok),
        }
        if runner.tools is not None:
            row |= usage_metrics(episode.tool_use)
        return row | (task.metrics(example, episode.messages) if ok else {})

    rows = await asyncio.gather(*(one(e) for e in examples))
    return mean_by_key(rows) | {"episodes": len(rows)}
