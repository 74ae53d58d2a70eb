"""The multiturn-aware reward on hand-built conversations."""

from __future__ import annotations

import pytest

from rollout.episode import Episode
from rollout.rewards.conversation import conversation_reward
from rollout.rewards.multiturn import multiturn_reward, score_response
from rollout.tasks import clarify
from rollout.tasks.clarify_task import ClarifyTask
from services.config import RewardSpec, TaskSpec

TASK = ClarifyTask(TaskSpec(num_examples=4), seed=0)
EXAMPLE = 0
TARGET = TASK.examples[EXAMPLE]


def conversation(*replies: str, policy_tokens: int, end: str = "user_ended") -> Episode:
    messages = [{"role": "user", "content": clarify.request(TARGET)}]
    for i, reply in enumerate(replies):
        if i:
            messages.append({"role": "user", "content": clarify.clarification(TARGET.target)})
        messages.append({"role": "assistant", "content": reply})
    return Episode(messages=messages, tokens=[], end=end, policy_tokens=policy_tokens)


class RecordingJudge:
    """A judge with fixed scores per conversation length, which records its calls."""

    def __init__(self, scores: dict[int, float]) -> None:
        self.scores = scores
        self.calls: list[int] = []

    async def __call__(self, rubric: str, messages: list[dict], reference: str | None) -> float:
        self.calls.append(len(messages))
        return self.scores[len(messages)]


async def test_mr_is_the_mean_of_r_star_over_the_futures():
    right = clarify.answer(TARGET.category, TARGET.target)
    wrong = clarify.answer(TARGET.category, next(o for o in TARGET.options if o != TARGET.target))
    futures = [
        conversation(clarify.question(TARGET.category), right, policy_tokens=40),   # asked, then right
        conversation(clarify.question(TARGET.category), wrong, policy_tokens=40),   # asked, then wrong
        conversation(clarify.question(TARGET.category), policy_tokens=2000, end="max_turns"),  # kept asking
    ]
    judge = RecordingJudge({4: 0.5, 2: 0.25})
    spec = RewardSpec(mode="multiturn", token_penalty=5e-4, judge_rubric="interactivity", judge_weight=1.0)

    mr = await multiturn_reward(futures, TASK, EXAMPLE, spec, judge)

    # R* = R_ext - min(lambda * tokens, 1) + R_llm per future:
    # (1 - 0.02 + 0.5) + (0 - 0.02 + 0.5) + (0 - min(1.0, 1) + 0.25), averaged over 3.
    assert mr == pytest.approx((1.48 + 0.48 - 0.75) / 3)
    assert sorted(judge.calls) == [2, 4, 4]


async def test_a_malformed_response_gets_the_minimum_without_simulation_or_judge():
    judge = RecordingJudge({})
    truncated = conversation("Which fruit do you", policy_tokens=48, end="truncated")
    empty = conversation("   ", policy_tokens=1)
    spec = RewardSpec(mode="multiturn", judge_rubric="interactivity")
    penalised = RewardSpec(mode="multiturn", judge_rubric="interactivity", token_penalty=5e-4)

    for episode in (truncated, empty):
        reward, futures = await score_response(None, episode, TASK, EXAMPLE, spec, judge)  # runner unused
        assert (reward, futures) == (0.0, [])
        # With a token penalty R* can reach -1 (a long failed conversation); so does a cut-off reply.
        assert (await score_response(None, episode, TASK, EXAMPLE, penalised, judge))[0] == -1.0
    assert await conversation_reward(TASK, EXAMPLE, truncated, spec, judge) == 0.0
    assert await conversation_reward(TASK, EXAMPLE, truncated, penalised, judge) == -1.0
    assert judge.calls == []


async def test_window_zero_is_a_next_turn_reward():
    question = conversation(clarify.question(TARGET.category), policy_tokens=20)
    guess = conversation(clarify.answer(TARGET.category, TARGET.target), policy_tokens=6)
    spec = RewardSpec(mode="multiturn", window=0)

    assert (await score_response(None, question, TASK, EXAMPLE, spec))[0] == 0.0   # a question earns nothing now
    assert (await score_response(None, guess, TASK, EXAMPLE, spec))[0] == 1.0
