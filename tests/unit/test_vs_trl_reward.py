"""bench/vs_trl.py compares Tandem with TRL on the same reward. TRL's side computes it with
bench/trl_side/reward.py, written for a trainer without Tandem's episode loop; these tests
hold it to Tandem's own R* (rollout/rewards/conversation.py) on the same conversations,
with the same judge: the next-turn reward, MR over futures the user ends or the policy
leaves cut short, and the floor for a malformed response."""

import asyncio

import pytest

from bench.trl_side.reward import ClarifyReward
from rollout.episode import Episode
from rollout.rewards.conversation import conversation_rewards, minimum_reward
from rollout.tasks import clarify
from rollout.tasks.base import Verdict
from services.config import JobSpec, parse_job_spec

EOS = 2


class Judge:
    """Scores a conversation by its length, so every conversation scores differently."""

    def __init__(self) -> None:
        self.seen: list[list[dict]] = []

    async def score_all(self, rubric, conversations, reference, call_id=""):
        self.seen += conversations
        return [Verdict((sum(len(m["content"]) for m in c) % 7) / 6) for c in conversations]


class User:
    """Answers the assistant's first question, then ends the conversation."""

    async def respond(self, example, messages, call_id=""):
        return None if sum(m["role"] == "user" for m in messages) > 1 else "It is for my sister."


class Policy:
    """Answers the target in futures of even examples; cuts its turn short in odd ones."""

    eos = {EOS}

    def __init__(self, reward: ClarifyReward) -> None:
        self.task = reward.task

    def sample(self, conversations):
        turns = []
        for messages in conversations:
            example = next(i for i in range(len(self.task)) if self.task.context(i)[0] == messages[0])
            ex = self.task.examples[example]
            turns.append((5, clarify.answer(ex.category, ex.target), example % 2 == 0))
        return turns


def job(window: int) -> JobSpec:
    return parse_job_spec(
        {
            "name": "vs-trl",
            "model": {"path": "unused"},
            "task": {"name": "clarify", "user": "llm", "num_examples": 8},
            "reward": {
                "mode": "multiturn",
                "window": window,
                "num_futures": 3,
                "token_penalty": 0.01,
                "extrinsic_weight": 1.0,
                "judge_rubric": "interactivity",
                "judge_weight": 0.5,
            },
        }
    )


def trl_reward(window: int) -> tuple[ClarifyReward, Judge]:
    reward = ClarifyReward(job(window), "http://unused", "vs-trl")
    judge = Judge()
    reward.client, reward.judge, reward.user, reward.policy = object(), judge, User(), Policy(reward)
    return reward, judge


def step(reward: ClarifyReward, responses: dict[int, tuple[str, list[int]]]) -> list[float]:
    """TRL's call: one completion per (example -> (text, token ids))."""
    examples = list(responses)
    prompts = [reward.task.context(i) for i in examples]
    completions = [[{"role": "assistant", "content": text}] for text, _ in responses.values()]
    ids = [tokens for _, tokens in responses.values()]
    return asyncio.run(reward(prompts=prompts, completions=completions, completion_ids=ids, example=examples))


def tandem(reward: ClarifyReward, example: int, conversations: list[tuple[list[dict], int, str]]) -> list[float]:
    """Tandem's R* of each (messages, policy tokens, how it ended)."""
    episodes = [
        Episode(messages=m, tokens=[], num_turns=sum(x["role"] == "assistant" for x in m), policy_tokens=n, end=end)
        for m, n, end in conversations
    ]
    return asyncio.run(conversation_rewards(reward.task, example, episodes, reward.reward, Judge()))


def test_the_next_turn_reward_is_tandems_r_star_of_the_conversation_after_the_response():
    reward, _ = trl_reward(window=0)
    ex = reward.task.examples[0]
    responses = {
        0: (clarify.answer(ex.category, ex.target), [7, 8, 9, EOS]),
        1: (clarify.question(reward.task.examples[1].category), [7, 8, EOS]),
    }
    got = step(reward, responses)
    for (example, (text, ids)), value in zip(responses.items(), got):
        messages = reward.task.context(example) + [{"role": "assistant", "content": text}]
        assert value == pytest.approx(tandem(reward, example, [(messages, len(ids), "max_turns")])[0])


def test_mr_is_the_mean_of_tandems_r_star_over_futures_finished_or_cut_short():
    reward, judge = trl_reward(window=2)
    question = lambda i: clarify.question(reward.task.examples[i].category)  # noqa: E731
    responses = {2: (question(2), [7, 8, EOS]), 3: (question(3), [7, 8, 9, EOS])}
    got = step(reward, responses)
    for (example, (text, ids)), value in zip(responses.items(), got):
        ex = reward.task.examples[example]
        future = reward.task.context(example) + [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "It is for my sister."},
            {"role": "assistant", "content": clarify.answer(ex.category, ex.target)},
        ]
        # Even examples: the user ends after the answer. Odd: the policy's answer was cut short.
        end = "user_ended" if example % 2 == 0 else "truncated"
        expected = tandem(reward, example, [(future, len(ids) + 5, end)] * 3)
        assert value == pytest.approx(sum(expected) / 3)
    assert len(judge.seen) == 3, "only the finished futures are judged"


def test_a_response_cut_at_the_length_limit_or_empty_gets_the_floor_and_no_judge_call():
    reward, judge = trl_reward(window=2)
    got = step(reward, {4: ("Which colour", [7, 8, 9]), 5: ("  ", [EOS])})
    assert got == [minimum_reward(reward.reward)] * 2 == [-1.0, -1.0]
    assert judge.seen == []
