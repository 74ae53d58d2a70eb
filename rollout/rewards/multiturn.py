"""The multiturn-aware reward (CollabLLM): MR(m_j) = mean over S futures of R*.

Each future forks the conversation right after the response m_j and lets the user
simulator and the current policy go on for at most `window` more assistant turns; R* then
scores the whole conversation (task metric, token penalty, judge). window = 0 scores the
conversation as it stands after m_j: a next-turn reward, for ablations. A response the
format filter rejects gets the minimum reward before any simulation or judge call; a
future that a later policy turn leaves malformed scores as an unfinished conversation
(`rollout.rewards.conversation`), not as the minimum.
"""

from __future__ import annotations

from rollout.concurrent import gather_all
from rollout.episode import Episode, EpisodeRunner
from rollout.rewards.conversation import Judge, conversation_reward, minimum_reward
from rollout.tasks.base import TaskSet
from services.config import RewardSpec


async def sample_futures(runner: EpisodeRunner, episode: Episode, example: int, spec: RewardSpec) -> list[Episode]:
    """`num_futures` independent continuations of `episode` (none are trained)."""
    if spec.window == 0:
        return [episode]
    forks = [runner.extend(episode.fork(), example, spec.window, trained=False) for _ in range(spec.num_futures)]
    return await gather_all(*forks)


async def multiturn_reward(futures: list[Episode], task: TaskSet, example: int, spec: RewardSpec,
                           judge: Judge | None = None) -> float:
    """Mean R* over the sampled futures (concurrently: judge calls overlap)."""
    rewards = await gather_all(*(conversation_reward(task, example, f, spec, judge) for f in futures))
    return sum(rewards) / len(rewards)


async def score_response(runner: EpisodeRunner, episode: Episode, task: TaskSet, example: int,
                         spec: RewardSpec, judge: Judge | None = None) -> tuple[float, list[Episode]]:
    """MR of the response that ends `episode`, with the futures it was computed from."""
    if not episode.well_formed():
        return minimum_reward(spec), []
    futures = await sample_futures(runner, episode, example, spec)
    return await multiturn_reward(futures, task, example, spec, judge), futures
