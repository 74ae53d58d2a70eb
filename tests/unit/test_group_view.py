"""R* taken apart, and a training group as the job page reads it (`rollout.group_view`):
hand numbers on hand-built conversations, then real groups from the runner with a scripted
policy (tests/unit/test_rollout_group.py's)."""

from __future__ import annotations

import pytest

from rollout.group_view import TEXT_CHARS, text
from rollout.rewards.conversation import conversation_rewards, total
from rollout.tasks import clarify
from rollout.tasks.base import Verdict
from services import protocol
from services.config import RewardSpec
from tests.unit.test_multiturn_reward import EXAMPLE, TARGET, TASK, conversation
from tests.unit.test_rollout_group import RIGHT, WRONG, group_rollout, task


class ReasoningJudge:
    """Scores a conversation by its length and says so."""

    async def score_all(self, rubric, conversations, reference, call_id=""):
        return [Verdict(len(c) / 10, f"{len(c)} messages <b>read</b>") for c in conversations]


async def test_the_parts_of_r_star_add_up_to_it_by_hand():
    asked_right = conversation(clarify.question(TARGET.category), RIGHT, policy_tokens=40)
    asked_wrong = conversation(clarify.question(TARGET.category), WRONG, policy_tokens=40)
    unfinished = conversation(clarify.question(TARGET.category), policy_tokens=3000, end="truncated")
    spec = RewardSpec(mode="multiturn", token_penalty=5e-4, judge_rubric="interactivity", judge_weight=0.5)

    rewards = await conversation_rewards(TASK, EXAMPLE, [asked_right, asked_wrong, unfinished], spec, ReasoningJudge())

    # 4 messages each (request, question, clarification, answer): the judge scores 0.4.
    right, wrong, cut = asked_right.parts, asked_wrong.parts, unfinished.parts
    assert (right.r_ext, right.token_penalty, right.r_llm) == (1.0, pytest.approx(0.02), 0.4)
    assert right.verdict == "4 messages <b>read</b>"
    assert rewards[0] == right.reward == pytest.approx(1.0 - 0.02 + 0.5 * 0.4)
    assert (wrong.r_ext, wrong.r_llm) == (0.0, 0.4)
    assert rewards[1] == wrong.reward == pytest.approx(-0.02 + 0.5 * 0.4)
    # Unfinished: nothing asked of the task or the judge, the penalty at its cap.
    assert (cut.r_ext, cut.r_llm, cut.token_penalty, cut.verdict) == (None, None, 1.0, "")
    assert rewards[2] == cut.reward == -1.0
    assert all(p.reward == total(p, spec) for p in (right, wrong, cut))


async def test_a_fork_does_not_carry_its_parents_parts():
    episode = conversation(RIGHT, policy_tokens=4)
    await conversation_rewards(TASK, EXAMPLE, [episode], RewardSpec(mode="episode"), None)
    assert episode.parts is not None
    assert episode.fork("f0").parts is None


async def test_a_multiturn_group_view_holds_each_responses_futures_with_parts_and_verdicts(tokenizer):
    spec = RewardSpec(mode="multiturn", window=2, num_futures=3, judge_rubric="interactivity", judge_weight=0.5)
    rollout, _ = group_rollout(tokenizer, [RIGHT, WRONG], spec, "job-view", judge=ReasoningJudge())

    group, view = await rollout.group_and_view(task("job-view", 2))

    view = protocol.decode(protocol.encode(view), protocol.GroupView)  # as the API reads it back
    assert (view.job_id, view.task_id, view.example, view.mode) == ("job-view", 7, EXAMPLE, "multiturn")
    assert view.versions == [3, 3] and view.dispatched_version == 0
    assert view.weights == {"extrinsic_weight": 1.0, "judge_weight": 0.5}
    assert view.context == [{"role": "user", "content": clarify.request(TARGET)}]
    for sample, response in zip(group.samples, view.responses):
        assert (response.reward, response.advantage) == (sample.reward, sample.advantage)
        assert response.messages == [{"role": "assistant", "content": clarify.question(TARGET.category)}]
        assert response.parts is None and response.malformed == ""
        assert len(response.futures) == 3
        # MR is the mean of the futures' R*, each of which is its parts' sum.
        assert response.reward == pytest.approx(sum(f.parts.reward for f in response.futures) / 3)
        for future in response.futures:
            # What followed the response: the user's clarification, then the policy's answer.
            assert [m["role"] for m in future.messages] == ["user", "assistant"]
            assert future.messages[1]["content"] in (RIGHT, WRONG)
            assert future.parts.r_ext == float(future.messages[1]["content"] == RIGHT)
            assert future.parts.verdict == "4 messages <b>read</b>"  # kept as text; the page shows it as text


async def test_an_episode_group_view_scores_each_conversation_itself(tokenizer):
    rollout, _ = group_rollout(tokenizer, [RIGHT, WRONG], RewardSpec(mode="episode"), "job-view-episode")

    group, view = await rollout.group_and_view(task("job-view-episode", 2))

    for sample, response in zip(group.samples, view.responses):
        assert response.futures == []
        assert response.parts.reward == sample.reward == response.parts.r_ext
        assert [m["role"] for m in response.messages] == ["assistant", "user", "assistant"]


async def test_a_malformed_response_is_named_and_has_neither_parts_nor_futures(tokenizer):
    spec = RewardSpec(mode="multiturn", token_penalty=5e-4)
    rollout, _ = group_rollout(tokenizer, [RIGHT], spec, "job-view-cut", finish_reason="length")

    _, view = await rollout.group_and_view(task("job-view-cut", 2))

    for response in view.responses:
        assert (response.malformed, response.parts, response.futures, response.reward) == ("truncated", None, [], -1.0)


def test_a_long_message_is_cut_and_says_how_much_was_cut():
    cut = text({"role": "assistant", "content": "x" * (TEXT_CHARS + 123), "tool_calls": [{"id": 1}]})
    assert cut == {"role": "assistant", "content": "x" * TEXT_CHARS + "\n[... 123 more characters]"}
    assert text({"role": "tool", "content": None}) == {"role": "tool", "content": ""}
