"""One task -> one `TrajectoryGroup`: `group_size` samples, their rewards and advantages.

Episode mode: each sample is a whole conversation from the task's context, scored by R*
and trained on all its assistant turns. Multiturn mode: each is one response m_j, scored
by MR over sampled futures and trained alone. The job's reward mode picks the pair of
steps (play a sample, score it) once, when its `GroupRollout` is built. A generate job's
task is one ranked conversation instead (`RankedRollout`). The server
publishes the group and acknowledges the task; the only Redis here is the task's journal
of policy turns, when the server passes one (`rollout.journal`).

Each sample counts what its LLM calls cost (`services.judge_client.Spend`: judge and
simulator tokens the provider charged, calls answered from the proxy's memory) and, in
multiturn mode, how many futures it took; the learner turns these into judge tokens per
trained token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import replace

from prometheus_client import Counter, Histogram, Summary

from rollout.concurrent import gather_all
from rollout.episode import MALFORMED_REASONS, Episode, EpisodeRunner
from rollout.group_view import group_view
from rollout.interactions.llm_user import LLMUser
from rollout.journal import Journal
from rollout.rewards import multiturn
from rollout.rewards.advantage import group_advantages
from rollout.rewards.conversation import episode_reward
from rollout.rewards.multiturn import GroupFutures
from rollout.tasks.base import Judge, TaskSet
from rollout.tools.box import usage_metrics
from services import protocol
from services.config import RewardSpec
from services.judge_client import SPEND, Spend
from services.stats import mean_by_key

TOKENS = Counter("tandem_rollout_generated_tokens_total", "Tokens the policy generated", ["job"])
EPISODE = Histogram(
    "tandem_rollout_episode_seconds",
    "One sample: its conversation (or response) and its reward",
    ["job"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
REWARD = Histogram(
    "tandem_rollout_reward", "Sample rewards", ["job"], buckets=(-1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 1.5, 2)
)
# A histogram with a negative bucket exports no _sum (the client leaves it out, since such a
# sum need not grow monotonically), so the mean reward comes from this summary's _sum/_count.
REWARD_TOTAL = Summary("tandem_rollout_sample_reward", "Sample rewards, for their mean", ["job"])
FUTURES = Histogram(
    "tandem_rollout_futures_per_turn",
    "Futures sampled to score one response (multiturn mode)",
    ["job"],
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
LLM_TOKENS = Counter(
    "tandem_rollout_llm_tokens_total",
    "Tokens the provider charged for this server's judge and user-simulator calls",
    ["job", "kind"],
)
REMEMBERED = Counter(
    "tandem_rollout_remembered_calls_total",
    "Judge and simulator calls the proxy answered from memory (cache or replay)",
    ["job"],
)


class GroupRollout:
    """Everything one job's tasks are played and scored with. `reward_slots` bounds the
    rewards being computed at once (judge calls, futures), across all of a server's tasks."""

    def __init__(
        self,
        runner: EpisodeRunner,
        task_set: TaskSet,
        spec: RewardSpec,
        judge: Judge,
        reward_slots: asyncio.Semaphore,
        server_id: str,
        job_id: str,
        seed: int = 0,
        openings: bool = False,
    ) -> None:
        self.runner, self.task_set, self.spec, self.judge = runner, task_set, spec, judge
        self.openings = openings
        """`task.opening: simulator`: the user simulator writes each task's first request."""
        self.seed = seed
        """The job's sampling seed, recorded with every reward an LLM took part in."""
        self.reward_slots = reward_slots
        self.server_id, self.job_id = server_id, job_id
        if spec.mode == "episode":
            self.play, self.score = self.play_conversation, self.score_conversation
        else:
            self.play, self.score = self.play_response, self.score_response

    async def group(self, task: protocol.Task, journal: Journal | None = None) -> protocol.TrajectoryGroup:
        """`group_size` samples for the task's context, with group-relative advantages."""
        group, _ = await self.group_and_view(task, journal)
        return group

    async def group_and_view(
        self, task: protocol.Task, journal: Journal | None = None
    ) -> tuple[protocol.TrajectoryGroup, protocol.GroupView | None]:
        """The task's group and its view for people (`rollout.group_view`)."""
        context = await self.context(task)
        futures = GroupFutures(self.spec, task.group_size, self.reward_slots)
        played = await gather_all(
            *(self.sample(task, index, context, journal, futures) for index in range(task.group_size))
        )
        samples = [sample for sample, _, _ in played]
        advantages = group_advantages([s.reward for s in samples], self.spec.scale_advantage_by_std)
        for sample, advantage in zip(samples, advantages):
            sample.advantage = advantage
        group = protocol.TrajectoryGroup(
            job_id=self.job_id, task_id=task.task_id, samples=samples, server_id=self.server_id, elapsed_s=0.0
        )
        view = group_view(group, task, context, [(e, scored) for _, e, scored in played], self.spec)
        return group, view

    async def sample(
        self, task: protocol.Task, index: int, context: list[dict], journal: Journal | None, futures: GroupFutures
    ) -> tuple[protocol.Sample, Episode, list[Episode]]:
        """One sample (its advantage still 0), its episode and the conversations its reward scored."""
        return await self.scored_sample(
            task,
            f"{self.job_id}:{task.task_id}:{index}",
            futures,
            index,
            self.play(task.example, context, f"task{task.task_id}/s{index}", journal),
        )

    async def scored_sample(
        self, task: protocol.Task, sample_id: str, futures: GroupFutures, index: int, play: Awaitable[Episode]
    ) -> tuple[protocol.Sample, Episode, list[Episode]]:
        """The sample `play` makes, scored as response `index` of its group, its episode and
        the conversations its reward scored. Runs as a task of its own (`gather_all`), so the
        `Spend` set here counts this sample's calls only. Scoring holds one of the server's
        reward slots at a time (`GroupFutures.slots`)."""
        started = time.perf_counter()
        spend = Spend()
        SPEND.set(spend)
        episode = await play
        reward, scored = await self.score(task.example, episode, futures, index)
        TOKENS.labels(self.job_id).inc(episode.policy_tokens)
        REWARD.labels(self.job_id).observe(reward)
        REWARD_TOTAL.labels(self.job_id).observe(reward)
        EPISODE.labels(self.job_id).observe(time.perf_counter() - started)
        metrics = sample_metrics(self.task_set, task.example, episode, scored)
        metrics |= spend_metrics(self.job_id, spend, episode, scored)
        if self.runner.tools is not None:
            self.runner.tools.observe_episode(episode.tool_use)
            metrics |= usage_metrics(episode.tool_use)
        return (
            protocol.Sample(
                sample_id=sample_id,
                tokens=episode.tokens,
                mask=episode.mask,
                logprobs=episode.logprobs,
                versions=episode.versions,
                reward=reward,
                advantage=0.0,
                num_turns=episode.num_turns,
                metrics=metrics,
                reward_source=(spend.source | {"seed": str(self.seed)}) if spend.source else {},
            ),
            episode,
            scored,
        )

    async def context(self, task: protocol.Task) -> list[dict]:
        """The task's context; with `openings`, its request replaced by one the user
        simulator writes (under the task's name, so a replayed task gets the same one) with
        the task's attachment, after the context's system prompt if it has one."""
        context = self.task_set.context(task.example)
        if not self.openings:
            return context
        user = self.runner.user
        if not isinstance(user, LLMUser):  # the spec's checks give simulator openings an LLM user
            raise TypeError(f"openings are written by the LLM user simulator, not by a {type(user).__name__}")
        written = await user.opening(task.example, f"task{task.task_id}/opening")
        attachment = self.task_set.attachment(task.example)
        request = f"{written}\n\n{attachment}" if attachment else written
        return [*context[:-1], {"role": "user", "content": request}]

    async def play_conversation(
        self, example: int, context: list[dict], trace: str, journal: Journal | None
    ) -> Episode:
        return await self.runner.run(example, context, trace, journal)

    async def score_conversation(
        self, example: int, episode: Episode, futures: GroupFutures, index: int
    ) -> tuple[float, list[Episode]]:
        """R* of the conversation, which is also the one conversation it is scored from."""
        async with futures.slots:
            return await episode_reward(self.task_set, example, episode, self.spec, self.judge), [episode]

    async def play_response(self, example: int, context: list[dict], trace: str, journal: Journal | None) -> Episode:
        episode = self.runner.start(context, trace, journal, example)
        await self.runner.policy_turn(episode)
        return episode

    async def score_response(
        self, example: int, episode: Episode, futures: GroupFutures, index: int
    ) -> tuple[float, list[Episode]]:
        """MR of the response, and the futures it was computed from."""
        return await multiturn.score_response(
            self.runner, episode, self.task_set, example, self.spec, self.judge, futures, index
        )


class RankedRollout(GroupRollout):
    """A generate job's tasks: each one is a ranked conversation (`ranked_conversation`),
    whose record is the conversation itself (no view for the job page)."""

    async def group_and_view(
        self, task: protocol.Task, journal: Journal | None = None
    ) -> tuple[protocol.TrajectoryGroup, protocol.GroupView | None]:
        return await self.ranked_conversation(task, journal), None

    async def ranked_conversation(self, task: protocol.Task, journal: Journal | None) -> protocol.TrajectoryGroup:
        """CollabLLM's data generation: at each assistant turn, `group_size` responses to
        the conversation so far, each scored by MR; the best carries the conversation on
        (the user simulator answers it), until the user ends it, `max_turns`, or a turn
        whose best response is malformed. The group holds every response, trained on its
        own tokens only and marked with its `turn`; the conversation is the SFT row."""
        base = self.runner.start(await self.context(task), f"task{task.task_id}/g", journal, task.example)
        samples: list[protocol.Sample] = []
        responses: list[str] = []
        for turn in range(self.runner.spec.max_turns):
            futures = GroupFutures(self.spec, task.group_size, self.reward_slots)
            candidates = await gather_all(
                *(
                    self.scored_sample(
                        task,
                        f"{self.job_id}:{task.task_id}:{turn}:{index}",
                        futures,
                        index,
                        self.candidate(base, f"j{turn}c{index}"),
                    )
                    for index in range(task.group_size)
                )
            )
            for sample, episode, _ in candidates:
                sample.metrics |= {"turn": float(turn), "context_messages": float(len(base.messages))}
                samples.append(sample)
                responses.append(episode.messages[-1]["content"])
            # Ties go to a well-formed response: a reply whose futures all pay the capped
            # penalty scores -1 like a malformed one, and only the former can carry on.
            _, best, _ = max(candidates, key=lambda c: (c[0].reward, c[1].well_formed()))
            # A copy (the best sample keeps its own tokens), all context from here on: the
            # next turn's rewards count only what follows it.
            base = replace(
                best.fork("next"),
                trace=base.trace,
                mask=[0] * len(best.tokens),
                context_len=len(best.tokens),
                policy_tokens=0,
            )
            if not best.well_formed() or turn == self.runner.spec.max_turns - 1:
                break
            if not await self.runner.user_turn(base, task.example):
                break
        metrics = self.task_set.metrics(task.example, base.messages) | {"well_formed": float(base.well_formed())}
        return protocol.TrajectoryGroup(
            job_id=self.job_id,
            task_id=task.task_id,
            samples=samples,
            server_id=self.server_id,
            elapsed_s=0.0,
            conversation=base.messages,
            conversation_metrics=metrics,
            responses=responses,
        )

    async def candidate(self, base: Episode, name: str) -> Episode:
        """One response to the conversation in `base`, on a fork of it."""
        episode = base.fork(name)
        await self.runner.policy_turn(episode)
        return episode


def spend_metrics(job_id: str, spend: Spend, episode: Episode, scored: list[Episode]) -> dict[str, float]:
    """A sample's LLM-call costs, as Prometheus counters and as sample metrics."""
    LLM_TOKENS.labels(job_id, "judge").inc(spend.judge_tokens)
    LLM_TOKENS.labels(job_id, "simulator").inc(spend.simulator_tokens)
    REMEMBERED.labels(job_id).inc(spend.remembered_calls)
    counts = {
        "judge_tokens": float(spend.judge_tokens),
        "simulator_tokens": float(spend.simulator_tokens),
        "llm_calls": float(spend.calls),
        "remembered_calls": float(spend.remembered_calls),
    }
    if spend.budget_left is not None:
        counts["judge_budget_left"] = spend.budget_left
    if scored and scored[0] is not episode:
        FUTURES.labels(job_id).observe(len(scored))
        counts["futures"] = float(len(scored))
    return counts


def sample_metrics(task_set: TaskSet, example: int, episode: Episode, scored: list[Episode]) -> dict[str, float]:
    """Task metrics averaged over the scored conversations (the episode itself, or the
    futures behind MR), the response's own length and format (`malformed_<reason>`: 1.0 for
    the reason the format filter rejected it), and, when futures were sampled, the share
    of them a later policy turn left malformed."""
    rows = [
        task_set.metrics(example, c.messages) | {"conversation_tokens": float(c.policy_tokens)}
        for c in scored
        if c.well_formed()
    ]
    reason = episode.malformed_reason()
    own = {"tokens": float(episode.policy_tokens), "well_formed": float(not reason)}
    own |= {f"malformed_{r}": float(reason == r) for r in MALFORMED_REASONS}
    if scored and scored[0] is not episode:
        own["futures_malformed"] = sum(not c.well_formed() for c in scored) / len(scored)
    return mean_by_key(rows) | own
