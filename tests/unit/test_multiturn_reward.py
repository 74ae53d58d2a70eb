"""The multiturn-aware reward on hand-built conversations."""

from __future__ import annotations

import pytest

from rollout.episode import Episode
from rollout.rewards.advantage import group_advantages
from rollout.rewards.conversation import conversation_reward, conversation_rewards, episode_reward
from rollout.rewards.multiturn import GroupFutures, more_futures, score_response
from rollout.tasks import clarify
from rollout.tasks.base import Verdict
from rollout.tasks.clarify.task import ClarifyTask
from services.config import ClarifySpec, RewardSpec

TASK = ClarifyTask(ClarifySpec(num_examples=4), seed=0)
EXAMPLE = 0
TARGET = TASK.examples[EXAMPLE]


def conversation(*replies: str, policy_tokens: int, end: str = "user_ended") -> Episode:
    messages = [{"role": "user", "content": clarify.request(TARGET)}]
    for i, reply in enumerate(replies):
        if i:
            messages.append({"role": "user", "content": clarify.clarification(TARGET.target)})
        messages.append({"role": "assistant", "content": reply})
    return Episode(messages=messages, tokens=[], end=end, num_turns=len(replies), policy_tokens=policy_tokens)


class RecordingJudge:
    """A judge with fixed scores per conversation length, which records its calls."""

    def __init__(self, scores: dict[int, float]) -> None:
        self.scores = scores
        self.calls: list[int] = []

    async def score_all(
        self, rubric: str, conversations: list[list[dict]], reference: str | None, call_id: str = ""
    ) -> list[Verdict]:
        self.calls += [len(m) for m in conversations]
        return [Verdict(self.scores[len(m)]) for m in conversations]


async def multiturn_reward(futures: list[Episode], task, example: int, spec: RewardSpec, judge=None) -> float:
    """MR from given futures: the mean of their R*."""
    rewards = await conversation_rewards(task, example, futures, spec, judge)
    return sum(rewards) / len(rewards)


async def test_mr_is_the_mean_of_r_star_over_the_futures():
    right = clarify.answer(TARGET.category, TARGET.target)
    wrong = clarify.answer(TARGET.category, next(o for o in TARGET.options if o != TARGET.target))
    futures = [
        conversation(clarify.question(TARGET.category), right, policy_tokens=40),  # asked, then right
        conversation(clarify.question(TARGET.category), wrong, policy_tokens=40),  # asked, then wrong
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
    assert await episode_reward(TASK, EXAMPLE, truncated, spec, judge) == 0.0
    assert await episode_reward(TASK, EXAMPLE, truncated, penalised, judge) == -1.0
    assert judge.calls == []


async def test_a_future_cut_short_scores_as_unfinished_not_at_the_floor():
    """The scored response did not write its futures' malformed turns: such a future earns
    no task reward and pays its tokens' penalty, but is not floored at -1."""
    right = clarify.answer(TARGET.category, TARGET.target)
    asked = clarify.question(TARGET.category)
    judge = RecordingJudge({4: 0.5})
    spec = RewardSpec(mode="multiturn", token_penalty=5e-4, judge_rubric="interactivity")
    futures = [
        conversation(asked, right, policy_tokens=20),  # 1 - 0.01 + 0.5
        conversation(asked, right, policy_tokens=20),  # 1 - 0.01 + 0.5
        conversation(asked, "Your fruit is", policy_tokens=40, end="truncated"),  # 0 - 0.02, no judge
    ]

    assert await conversation_reward(TASK, EXAMPLE, futures[2], spec, judge) == pytest.approx(-0.02)
    assert await multiturn_reward(futures, TASK, EXAMPLE, spec, judge) == pytest.approx((1.49 + 1.49 - 0.02) / 3)
    assert judge.calls == [4, 4]  # the two finished futures; never the one cut short


async def test_a_group_whose_futures_all_go_malformed_keeps_the_spread_that_rejects_a_malformed_response():
    """The collapse of the clarify MR run: the policy's later turns went malformed, so every
    future of every well-formed question was cut short. With those futures at R*'s floor
    the three questions scored -1 like the malformed response: zero spread, zero
    advantage, no gradient. Scored as unfinished conversations they keep the spread."""
    asked = clarify.question(TARGET.category)
    spec = RewardSpec(mode="multiturn", token_penalty=5e-4)
    cut_short = [
        conversation(asked, "Your fruit is your fruit is", policy_tokens=40, end=end)
        for end in ("truncated", "wrong_stop", "truncated")
    ]
    questions = [await multiturn_reward(cut_short, TASK, EXAMPLE, spec) for _ in range(3)]
    malformed, _ = await score_response(
        None, conversation("Which fruit do", policy_tokens=32, end="truncated"), TASK, EXAMPLE, spec
    )

    rewards = questions + [malformed]
    assert rewards == pytest.approx([-0.02, -0.02, -0.02, -1.0])
    # mean -0.265: each question +0.245, the malformed response -0.735 (no std scaling).
    assert group_advantages(rewards, scale_by_std=False) == pytest.approx([0.245, 0.245, 0.245, -0.735])


async def test_window_zero_is_a_next_turn_reward():
    question = conversation(clarify.question(TARGET.category), policy_tokens=20)
    guess = conversation(clarify.answer(TARGET.category, TARGET.target), policy_tokens=6)
    spec = RewardSpec(mode="multiturn", window=0)

    assert (await score_response(None, question, TASK, EXAMPLE, spec))[0] == 0.0  # a question earns nothing now
    assert (await score_response(None, guess, TASK, EXAMPLE, spec))[0] == 1.0


def test_a_group_without_spread_has_advantages_of_exactly_zero():
    # 0.1 * 3 / 3 = 0.10000000000000002: centring alone would leave -2e-17 on every sample.
    assert sum([0.1] * 3) / 3 != 0.1
    for scale in (True, False):
        assert group_advantages([0.1, 0.1, 0.1], scale_by_std=scale) == [0.0, 0.0, 0.0]
        assert group_advantages([0.1, 0.1, 0.1 + 1e-7], scale_by_std=scale) == [0.0, 0.0, 0.0]
    assert group_advantages([0.0, 1.0], scale_by_std=True) == pytest.approx([-1.0, 1.0], abs=1e-5)


# ---- adaptive futures ------------------------------------------------------------------

ADAPTIVE = RewardSpec(
    mode="multiturn",
    futures="adaptive",
    adaptive_rule="own",
    num_futures=3,
    min_futures=2,
    max_futures=8,
    futures_se_threshold=0.1,
)


@pytest.mark.parametrize(
    "rewards, more",
    [
        ([1.0, 1.0], 0),  # agree: standard error 0
        ([1.0, 0.9], 0),  # stdev 0.0707 / sqrt 2 = 0.05 <= 0.1
        ([1.0, 0.0], 2),  # stdev 0.707 / sqrt 2 = 0.5: as many again
        ([1.0, 0.0, 1.0, 0.0], 4),  # stdev 0.577 / 2 = 0.289
        ([1.0, 0.0, 1.0, 0.0, 1.0, 0.0], 2),  # capped at max_futures 8
        ([1.0, 0.0] * 4, 0),  # at max_futures
        ([0.5], 1),  # one future: its error is unknown
    ],
)
def test_futures_are_added_while_their_rewards_disagree_up_to_the_maximum(rewards, more):
    assert more_futures(rewards, ADAPTIVE) == more


def test_a_group_never_spends_more_extra_futures_than_the_fixed_policy_would():
    allowance = GroupFutures(ADAPTIVE, group_size=4)  # 4 * (3 - 2) = 4 beyond the first rounds
    assert [allowance.take(2), allowance.take(4), allowance.take(2)] == [2, 2, 0]


class ScriptedFutures:
    """An EpisodeRunner stand-in whose futures end with the next of the given replies."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)

    async def extend(
        self, episode: Episode, example: int, max_turns: int, trained: bool, temperature: float | None = None
    ) -> Episode:
        episode.messages += [
            {"role": "user", "content": clarify.clarification(TARGET.target)},
            {"role": "assistant", "content": self.replies.pop(0)},
        ]
        episode.policy_tokens += 10
        return episode


async def test_an_adaptive_response_whose_futures_disagree_gets_more_and_its_mr_is_their_mean():
    right = clarify.answer(TARGET.category, TARGET.target)
    wrong = clarify.answer(TARGET.category, next(o for o in TARGET.options if o != TARGET.target))
    asked = conversation(clarify.question(TARGET.category), policy_tokens=10)
    runner = ScriptedFutures([right, wrong, right, right])  # 1, 0: disagree, 2 more: 1, 1

    reward, futures = await score_response(
        runner, asked, TASK, EXAMPLE, ADAPTIVE, futures=GroupFutures(ADAPTIVE, group_size=2)
    )

    assert len(futures) == 4 and reward == pytest.approx(0.75)
    assert [f.trace for f in futures] == ["/f0", "/f1", "/f2", "/f3"]


async def test_an_adaptive_response_whose_futures_agree_stops_at_the_minimum():
    right = clarify.answer(TARGET.category, TARGET.target)
    runner = ScriptedFutures([right, right, right])
    reward, futures = await score_response(
        runner, conversation(clarify.question(TARGET.category), policy_tokens=10), TASK, EXAMPLE, ADAPTIVE
    )
    assert len(futures) == 2 and reward == 1.0 and runner.replies == [right]
