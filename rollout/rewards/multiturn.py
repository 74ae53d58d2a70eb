"""The multiturn-aware reward (CollabLLM): MR(m_j) = mean over the sampled futures of R*.

Each future forks the conversation right after the response m_j and lets the user
simulator and the current policy go on for at most `window` more assistant turns; R* then
scores the whole conversation (task metric, token penalty, judge). window = 0 scores the
conversation as it stands after m_j: a next-turn reward, for ablations. A response the
format filter rejects gets the minimum reward before any simulation or judge call; a
future that a later policy turn leaves malformed scores as an unfinished conversation
(`rollout.rewards.conversation`), not as the minimum.

How many futures: `num_futures` (`futures: fixed`), or adaptively: `min_futures` first,
then, while their R* disagree (`more_futures`), as many again, drawn from the group's
`FuturesAllowance` so that a group never spends more futures than a fixed policy would.
Futures of one round are judged together (one call in group mode).
"""

from __future__ import annotations

import math
import statistics

from rollout.concurrent import gather_all
from rollout.episode import Episode, EpisodeRunner
from rollout.rewards.conversation import Judge, conversation_rewards, minimum_reward
from rollout.tasks.base import TaskSet
from services.config import RewardSpec


def more_futures(rewards: list[float], spec: RewardSpec) -> int:
    """How many futures to add for a response whose futures so far scored `rewards`: none
    at `max_futures`, nor once the standard error of their mean is at most
    `futures_se_threshold`; else as many again as there are (one more after a single
    future, whose error is unknown), up to `max_futures`."""
    n = len(rewards)
    if n >= spec.max_futures:
        return 0
    if n >= 2 and statistics.stdev(rewards) / math.sqrt(n) <= spec.futures_se_threshold:
        return 0
    return min(n, spec.max_futures - n)


class FuturesAllowance:
    """The futures one group may still sample beyond each response's first round of
    `min_futures`, so that the group spends at most `group_size * num_futures` in all (what
    the fixed policy spends); shared first come, first served."""

    def __init__(self, spec: RewardSpec, group_size: int) -> None:
        self.left = group_size * (spec.num_futures - spec.min_futures)

    def take(self, wanted: int) -> int:
        granted = max(0, min(wanted, self.left))
        self.left -= granted
        return granted


async def score_response(runner: EpisodeRunner, episode: Episode, task: TaskSet, example: int, spec: RewardSpec,
                         judge: Judge | None = None,
                         allowance: FuturesAllowance | None = None) -> tuple[float, list[Episode]]:
    """MR of the response that ends `episode`, with the futures it was computed from."""
    if not episode.well_formed():
        return minimum_reward(spec), []
    if spec.window == 0:
        rewards = await conversation_rewards(task, example, [episode], spec, judge, f"{episode.trace}/judge")
        return rewards[0], [episode]
    adaptive = spec.futures == "adaptive"
    allowance = allowance or FuturesAllowance(spec, 1)
    wanted = spec.min_futures if adaptive else spec.num_futures
    futures: list[Episode] = []
    rewards: list[float] = []
    while wanted:
        forks = [episode.fork(f"f{len(futures) + i}") for i in range(wanted)]
        forks = await gather_all(*(runner.extend(f, example, spec.window, trained=False) for f in forks))
        rewards += await conversation_rewards(task, example, forks, spec, judge,
                                              f"{episode.trace}/judge{len(futures)}")
        futures += forks
        wanted = allowance.take(more_futures(rewards, spec)) if adaptive else 0
    return sum(rewards) / len(rewards), futures
