"""The multiturn-aware reward (CollabLLM): MR(m_j) = mean over the sampled futures of R*.

Each future forks the conversation right after the response m_j and lets the user
simulator and the current policy go on for at most `window` more assistant turns; R* then
scores the whole conversation (task metric, token penalty, judge). window = 0 scores the
conversation as it stands after m_j: a next-turn reward, for ablations. A response the
format filter rejects gets the minimum reward before any simulation or judge call; a
future that a later policy turn leaves malformed scores as an unfinished conversation
(`rollout.rewards.conversation`), not as the minimum.

How many futures (`GroupFutures`): `num_futures` (`futures: fixed`), or adaptively:
`min_futures` first, then more where futures disagree, never more than the group would
spend with `fixed`. Which disagreement decides is `adaptive_rule`:
- `others` (the default): a response's count is decided by the *other* responses' first
  futures only (`extra_from_others`). Its own futures never decide how many of them are
  averaged, so its MR is an unbiased estimate of its expected R* (docs/DESIGN.md proves it;
  `tests/unit/test_adaptive_futures.py` computes the expectation exactly).
- `own`: a response gets more futures while its own futures disagree (`more_futures`).
  Stopping on the values being averaged biases MR towards 0 and 1 (a true 0.2 is estimated
  at 0.136 in expectation with min 2, max 6): the order of responses survives, their values
  do not. Kept for the runs recorded with it.
Futures of one round are judged together (one call in group mode).
"""

from __future__ import annotations

import asyncio
import math
import statistics

from rollout.concurrent import gather_all
from rollout.episode import Episode, EpisodeRunner
from rollout.rewards.conversation import conversation_rewards, minimum_reward
from rollout.tasks.base import Judge, TaskSet
from services.config import RewardSpec


def more_futures(rewards: list[float], spec: RewardSpec) -> int:
    """`adaptive_rule: own`: how many futures to add for a response whose futures so far
    scored `rewards`: none at `max_futures`, nor once the standard error of their mean is at
    most `futures_se_threshold`; else as many again as there are (one more after a single
    future, whose error is unknown), up to `max_futures`."""
    n = len(rewards)
    if n >= spec.max_futures:
        return 0
    if n >= 2 and statistics.stdev(rewards) / math.sqrt(n) <= spec.futures_se_threshold:
        return 0
    return min(n, spec.max_futures - n)


def extra_from_others(first_rounds: list[list[float]], index: int, spec: RewardSpec) -> int:
    """`adaptive_rule: others`: the futures response `index` gets beyond its first
    `min_futures`, from the first-round R* of the group's other responses (`first_rounds`;
    an empty list for a response with no futures): none when the standard error of a
    first-round mean, their variances pooled, is at most `futures_se_threshold`; else up to
    `num_futures` in all. With no other response to learn from, `num_futures` in all."""
    extra = max(0, spec.num_futures - spec.min_futures)
    others = [rewards for i, rewards in enumerate(first_rounds) if i != index and len(rewards) >= 2]
    if not others:
        return extra
    pooled = math.sqrt(statistics.fmean(statistics.variance(rewards) for rewards in others))
    return 0 if pooled / math.sqrt(spec.min_futures) <= spec.futures_se_threshold else extra


class GroupFutures:
    """How many futures each response of one group gets, and the reward slots a round of
    futures holds. With `adaptive_rule: own`, the group's allowance of `group_size *
    (num_futures - min_futures)` extra futures is shared first come, first served; with
    `others`, every response reports its first round (or that it has none) and waits for
    the rest of its group before its count is decided. A round holds one of the server's
    `slots` (`max_concurrent_rewards`) while it runs, never while it waits for the group."""

    def __init__(self, spec: RewardSpec, group_size: int, slots: asyncio.Semaphore | None = None) -> None:
        self.spec = spec
        self.slots = slots or asyncio.Semaphore(group_size or 1)
        self.left = group_size * (spec.num_futures - spec.min_futures)
        self.first_rounds: list[list[float]] = [[] for _ in range(group_size)]
        self.unreported = set(range(group_size))
        self.all_reported = asyncio.Event()
        if not self.unreported:
            self.all_reported.set()

    def first_round(self) -> int:
        return self.spec.min_futures if self.spec.futures == "adaptive" else self.spec.num_futures

    async def more(self, index: int, rewards: list[float]) -> int:
        """Futures to add to response `index`, whose futures so far scored `rewards`."""
        if self.spec.futures == "fixed":
            return 0
        if self.spec.adaptive_rule == "own":
            return self.take(more_futures(rewards, self.spec))
        if index not in self.unreported:
            return 0
        self.report(index, rewards)
        await self.all_reported.wait()
        return extra_from_others(self.first_rounds, index, self.spec)

    def report(self, index: int, rewards: list[float]) -> None:
        """Response `index`'s first round (empty: it gets no futures)."""
        self.first_rounds[index] = list(rewards)
        self.unreported.discard(index)
        if not self.unreported:
            self.all_reported.set()

    def take(self, wanted: int) -> int:
        granted = max(0, min(wanted, self.left))
        self.left -= granted
        return granted


async def score_response(
    runner: EpisodeRunner,
    episode: Episode,
    task: TaskSet,
    example: int,
    spec: RewardSpec,
    judge: Judge | None = None,
    futures: GroupFutures | None = None,
    index: int = 0,
) -> tuple[float, list[Episode]]:
    """MR of the response that ends `episode`, response `index` of the group `futures`
    plans for, with the futures it was computed from."""
    futures = futures or GroupFutures(spec, 1)
    if not episode.well_formed() or spec.window == 0:
        futures.report(index, [])
        if not episode.well_formed():
            return minimum_reward(spec), []
        async with futures.slots:
            [reward] = await conversation_rewards(task, example, [episode], spec, judge, f"{episode.trace}/judge")
        return reward, [episode]
    sampled: list[Episode] = []
    rewards: list[float] = []
    wanted = futures.first_round()
    while wanted:
        async with futures.slots:
            forks = [episode.fork(f"f{len(sampled) + i}") for i in range(wanted)]
            forks = await gather_all(
                *(
                    runner.extend(f, example, spec.window, trained=False, temperature=spec.future_temperature)
                    for f in forks
                )
            )
            rewards += await conversation_rewards(
                task, example, forks, spec, judge, f"{episode.trace}/judge{len(sampled)}"
            )
        sampled += forks
        wanted = await futures.more(index, rewards)
    return sum(rewards) / len(rewards), sampled
