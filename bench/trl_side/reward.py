"""The job's reward over TRL's completions, for bench/trl_side/train.py: Tandem's R*
(rollout/rewards/conversation.py) and, with `reward.window > 0`, its multiturn-aware reward
(rollout/rewards/multiturn.py), written for a trainer that hands over a step's responses at
once and has no episode loop. Imports neither TRL nor torch, so Tandem's tests can hold it
to Tandem's own reward (tests/unit/test_vs_trl_reward.py).

R* = extrinsic_weight * success - min(token_penalty * policy tokens, 1) + judge_weight *
the judge's score. A response cut at the length limit, or empty, gets the lowest R* (-1
with a token penalty) and no judge call; a future whose later policy turn is cut scores
only its token penalty. MR is the mean R* of `num_futures` futures, each at most `window`
more user and policy turns.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from rollout.interactions.llm_user import LLMUser
from rollout.judging import ProxyJudge
from rollout.tasks import load_task
from services.config import JobSpec
from services.judge_client import JudgeClient


class Sampler(Protocol):
    eos: set[int]

    def sample(self, conversations: list[list[dict]]) -> list[tuple[int, str, bool]]:
        """The policy's next turn in each conversation: (tokens, text, ended on end-of-turn)."""


class Future:
    """One forward-sampled continuation of a response (with window 0, the conversation as
    it stands after the response)."""

    def __init__(self, response: int, messages: list[dict], policy_tokens: int) -> None:
        self.response = response
        self.messages = list(messages)
        self.policy_tokens = policy_tokens
        self.live = True
        self.finished = True
        """False once a policy turn is cut at the length limit: nothing achieved, tokens paid."""


class ClarifyReward:
    """The job's reward over TRL's completions (see the module docstring)."""

    __name__ = "tandem_reward"

    def __init__(self, spec: JobSpec, judge_url: str, job_id: str) -> None:
        self.spec = spec
        self.reward = spec.reward
        self.task = load_task(spec.task, spec.train.seed)
        self.judge_url = judge_url
        self.job_id = job_id
        self.policy: Sampler | None = None
        self.client: JudgeClient | None = None
        self.calls = {"judge": 0, "simulator": 0}
        self.step = 0

    def minimum(self) -> float:
        return -1.0 if self.reward.token_penalty > 0 else 0.0

    async def __call__(self, prompts, completions, completion_ids, example, **_) -> list[float]:
        """R* (window 0) or MR of every response of the step. Futures advance in lock-step
        rounds over the whole step: every live future's simulator call at once, then one
        batched generate of the policy's next turn for all of them."""
        if self.client is None:  # made on the loop TRL awaits this on
            self.client = JudgeClient(self.judge_url, max_connections=256)
            self.judge = ProxyJudge(self.client, self.job_id, self.reward)
            self.user = LLMUser(
                self.client,
                self.task.goal,
                self.reward.user_model,
                job=self.job_id,
                seed=self.spec.train.seed,
                style=self.spec.task.simulator,
            )
        self.step += 1
        rewards = [self.minimum()] * len(prompts)
        futures: dict[int, list[Future]] = {}
        for i, (prompt, completion, ids) in enumerate(zip(prompts, completions, completion_ids)):
            if ids and ids[-1] in self.policy.eos and completion[0]["content"].strip():
                samples = self.reward.num_futures if self.reward.window else 1
                futures[i] = [Future(i, prompt + completion, len(ids)) for _ in range(samples)]
        every = [f for group in futures.values() for f in group]
        for turn in range(self.reward.window):
            await self.user_turns(turn, every, example)
            self.policy_turns([f for f in every if f.live])
        scored = await asyncio.gather(
            *(self.conversation_rewards(i, example[i], group) for i, group in futures.items())
        )
        for i, values in zip(futures, scored):
            rewards[i] = sum(values) / len(values)
        return rewards

    def policy_turns(self, live: list[Future]) -> None:
        """The policy's next turn in every live future, in one batch."""
        turns = self.policy.sample([f.messages for f in live]) if live else []
        for future, (count, text, ended) in zip(live, turns):
            future.messages.append({"role": "assistant", "content": text})
            future.policy_tokens += count
            if not ended or not text.strip():
                future.live = future.finished = False

    async def user_turns(self, turn: int, futures: list[Future], example: list[int]) -> None:
        live = [(k, f) for k, f in enumerate(futures) if f.live]
        replies = await asyncio.gather(
            *(
                self.user.respond(
                    example[f.response], f.messages, call_id=f"{self.job_id}/s{self.step}/r{f.response}/f{k}/t{turn}"
                )
                for k, f in live
            )
        )
        self.calls["simulator"] += len(live)
        for (_, future), reply in zip(live, replies):
            if reply is None:
                future.live = False  # the user ended the conversation
            else:
                future.messages.append({"role": "user", "content": reply})

    async def conversation_rewards(self, response: int, example: int, futures: list[Future]) -> list[float]:
        """R* of each future of one response (Tandem's conversation_rewards)."""
        spec = self.reward
        rewards = [-min(spec.token_penalty * f.policy_tokens, 1.0) for f in futures]
        finished = [i for i, f in enumerate(futures) if f.finished]
        for i in finished:
            rewards[i] += spec.extrinsic_weight * await self.task.score(example, futures[i].messages)
        if finished and spec.judge_rubric and spec.judge_weight:
            judged = [[m for m in futures[i].messages if m["role"] != "system"] for i in finished]
            call_id = f"{self.job_id}/s{self.step}/r{response}/judge"
            reference = self.task.reference(example) if spec.judge_reference else None
            verdicts = await self.judge.score_all(spec.judge_rubric, judged, reference, call_id)
            self.calls["judge"] += len(judged)
            for i, verdict in zip(finished, verdicts):
                rewards[i] += spec.judge_weight * verdict.score
        return rewards
