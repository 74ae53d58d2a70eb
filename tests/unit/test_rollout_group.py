"""A task -> its TrajectoryGroup, without Redis: the real runner, rule-based user, rewards
and advantages, with a scripted policy in place of vLLM."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from prometheus_client import REGISTRY

from rollout.engine import Generation
from rollout.episode import MALFORMED_REASONS, EpisodeRunner
from rollout.group import GroupRollout, RankedRollout
from rollout.rewards.advantage import group_advantages
from rollout.tasks import clarify
from rollout.tasks.base import Verdict
from rollout.tasks.clarify.task import ClarifyTask
from services import protocol
from services.config import ClarifySpec, RewardSpec, RolloutSpec
from services.tokenization import ChatTokenizer

TASK = ClarifyTask(ClarifySpec(num_examples=4), seed=0)
EXAMPLE = 0
TARGET = TASK.examples[EXAMPLE]
RIGHT = clarify.answer(TARGET.category, TARGET.target)
WRONG = clarify.answer(TARGET.category, next(o for o in TARGET.options if o != TARGET.target))
VERSION = 3


class AskingPolicy:
    """Stands in for the engine: asks which option the user means, then, once told, gives
    the answers in `answers` in turn. Every generated token is tagged with `VERSION`."""

    def __init__(self, chat: ChatTokenizer, answers: list[str], finish_reason: str = "stop") -> None:
        self.chat = chat
        self.answers = itertools.cycle(answers)
        self.finish_reason = finish_reason
        self.calls = 0

    async def generate(self, prompt, max_tokens, temperature, stop_ids) -> Generation:
        self.calls += 1
        await asyncio.sleep(0)  # the group's other samples go on meanwhile, as under vLLM
        told = clarify.clarification(TARGET.target) in self.chat.tokenizer.decode(prompt)
        text = next(self.answers) if told else clarify.question(TARGET.category)
        end = [self.chat.eot_id] if self.finish_reason == "stop" else []
        tokens = self.chat.tokenizer.encode(text, add_special_tokens=False) + end
        return Generation(tokens, [-0.5] * len(tokens), [VERSION] * len(tokens), self.finish_reason)


def group_rollout(
    tokenizer,
    policy_answers: list[str],
    spec: RewardSpec,
    job_id: str,
    judge=None,
    reward_slots: int = 8,
    finish_reason: str = "stop",
) -> tuple[GroupRollout, AskingPolicy]:
    chat = ChatTokenizer(tokenizer)
    policy = AskingPolicy(chat, policy_answers, finish_reason)
    runner = EpisodeRunner(
        policy, chat, TASK.rule_user, RolloutSpec(max_new_tokens=32, max_turns=3, max_total_tokens=400)
    )
    rollout = GroupRollout(runner, TASK, spec, judge, asyncio.Semaphore(reward_slots), "server-a", job_id)
    return rollout, policy


def task(job_id: str, group_size: int) -> protocol.Task:
    return protocol.Task(job_id=job_id, task_id=7, example=EXAMPLE, group_size=group_size, dispatched_version=0)


async def test_episode_mode_scores_whole_conversations_and_advantages_are_the_groups(tokenizer):
    rollout, policy = group_rollout(tokenizer, [RIGHT, WRONG], RewardSpec(mode="episode"), "job-episode")

    group = await rollout.group(task("job-episode", 4))

    assert (group.job_id, group.task_id, group.server_id) == ("job-episode", 7, "server-a")
    assert [s.sample_id for s in group.samples] == [f"job-episode:7:{i}" for i in range(4)]
    rewards = [s.reward for s in group.samples]
    assert sorted(rewards) == [0.0, 0.0, 1.0, 1.0]  # R_ext: two right answers, two wrong
    assert [s.advantage for s in group.samples] == group_advantages(rewards)
    assert [s.advantage for s in group.samples] == pytest.approx([2 * r - 1 for r in rewards], abs=1e-5)
    assert policy.calls == 8  # a question and an answer per sample, nothing more
    for sample in group.samples:
        # Both assistant turns are trained, under the version that generated them.
        assert sample.num_turns == 2
        assert sum(sample.mask) == sample.metrics["tokens"] > 0
        assert {v for v, m in zip(sample.versions, sample.mask) if m} == {VERSION}
        assert sample.metrics["success"] == sample.reward and sample.metrics["asked"] == 1.0
        assert "futures_malformed" not in sample.metrics
    assert REGISTRY.get_sample_value("tandem_rollout_sample_reward_count", {"job": "job-episode"}) == 4
    assert REGISTRY.get_sample_value("tandem_rollout_generated_tokens_total", {"job": "job-episode"}) == sum(
        s.metrics["tokens"] for s in group.samples
    )


async def test_multiturn_mode_trains_the_response_alone_and_scores_it_over_its_futures(tokenizer):
    spec = RewardSpec(mode="multiturn", window=2, num_futures=3)
    rollout, policy = group_rollout(tokenizer, [RIGHT, WRONG], spec, "job-multiturn")

    group = await rollout.group(task("job-multiturn", 4))

    assert [s.sample_id for s in group.samples] == [f"job-multiturn:7:{i}" for i in range(4)]
    assert policy.calls == 4 + 4 * 3  # each sample's question, then one answer per future
    # MR = mean R_ext over a sample's 3 futures; the 12 futures answer right and wrong in turn.
    assert sum(s.reward for s in group.samples) == pytest.approx(6 / 3)
    assert [s.advantage for s in group.samples] == group_advantages([s.reward for s in group.samples])
    question_tokens = len(tokenizer.encode(clarify.question(TARGET.category), add_special_tokens=False)) + 1
    for sample in group.samples:
        assert sample.num_turns == 1
        assert sum(sample.mask) == sample.metrics["tokens"] == question_tokens
        assert sample.metrics["futures_malformed"] == 0.0
        assert sample.metrics["success"] == pytest.approx(sample.reward)  # averaged over the futures


@pytest.mark.parametrize("mode", ["episode", "multiturn"])
async def test_a_truncated_response_gets_the_floor_and_its_malformed_reason_in_the_metrics(tokenizer, mode):
    spec = RewardSpec(mode=mode, token_penalty=5e-4)
    rollout, policy = group_rollout(tokenizer, [RIGHT], spec, f"job-truncated-{mode}", finish_reason="length")

    group = await rollout.group(task(f"job-truncated-{mode}", 3))

    assert policy.calls == 3  # no user turn, no future after a truncated turn
    assert [s.reward for s in group.samples] == [-1.0, -1.0, -1.0]
    assert [s.advantage for s in group.samples] == [0.0, 0.0, 0.0]
    expected = {f"malformed_{r}": float(r == "truncated") for r in MALFORMED_REASONS}
    for sample in group.samples:
        assert {k: v for k, v in sample.metrics.items() if k.startswith("malformed_")} == expected
        assert sample.metrics["well_formed"] == 0.0
        assert "success" not in sample.metrics and "futures_malformed" not in sample.metrics


async def test_reward_slots_bound_the_rewards_computed_at_once(tokenizer):
    active, peak, references = 0, 0, []

    class Judge:
        async def score_all(
            self, rubric: str, conversations: list[list[dict]], reference: str | None, call_id: str = ""
        ) -> list[Verdict]:
            nonlocal active, peak
            active += 1
            peak = max(peak, active)
            references.append(reference)
            await asyncio.sleep(0.01)
            active -= 1
            return [Verdict(0.5)] * len(conversations)

    spec = RewardSpec(mode="episode", judge_rubric="interactivity", judge_weight=1.0, judge_reference=True)
    rollout, _ = group_rollout(tokenizer, [RIGHT], spec, "job-slots", judge=Judge(), reward_slots=2)

    group = await rollout.group(task("job-slots", 6))

    assert peak == 2
    assert references == [RIGHT] * 6  # the task's reference answer, as judge_reference asks
    assert [s.reward for s in group.samples] == [1.5] * 6  # R_ext + judge_weight * R_llm


class RankedPolicy:
    """For a generate job: before the clarification it replies WRONG, the question, WRONG...
    in turn; once told, RIGHT for the question's future, then RIGHT, WRONG, RIGHT for the
    second turn's candidates (the turn-0 futures all run before turn 1 starts)."""

    def __init__(self, chat: ChatTokenizer) -> None:
        self.chat = chat
        self.untold = itertools.cycle([WRONG, clarify.question(TARGET.category)])
        self.told = iter([RIGHT, RIGHT, WRONG, RIGHT])

    async def generate(self, prompt, max_tokens, temperature, stop_ids) -> Generation:
        await asyncio.sleep(0)
        told = clarify.clarification(TARGET.target) in self.chat.tokenizer.decode(prompt)
        tokens = self.chat.tokenizer.encode(next(self.told if told else self.untold), add_special_tokens=False)
        tokens += [self.chat.eot_id]
        return Generation(tokens, [-0.5] * len(tokens), [0] * len(tokens), "stop")


async def test_a_ranked_conversation_carries_each_turns_best_response_on(tokenizer):
    from learner.runs.generate import group_rows

    chat = ChatTokenizer(tokenizer)
    runner = EpisodeRunner(
        RankedPolicy(chat), chat, TASK.rule_user, RolloutSpec(max_new_tokens=32, max_turns=3, max_total_tokens=400)
    )
    spec = RewardSpec(mode="multiturn", window=1, num_futures=1, token_penalty=0.0)
    rollout = RankedRollout(runner, TASK, spec, None, asyncio.Semaphore(8), "server-a", "job-gen")
    question = clarify.question(TARGET.category)

    group = await rollout.group(task("job-gen", 3))

    # Turn 0: WRONG, the question, WRONG; the question wins (its future answers right).
    # Turn 1, after the clarification: RIGHT, WRONG, RIGHT; the user then ends it.
    assert [int(s.metrics["turn"]) for s in group.samples] == [0, 0, 0, 1, 1, 1]
    assert [s.reward for s in group.samples] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert group.responses == [WRONG, question, WRONG, RIGHT, WRONG, RIGHT]
    assert [m["content"] for m in group.conversation] == [
        clarify.request(TARGET),
        question,
        clarify.clarification(TARGET.target),
        RIGHT,
    ]
    assert group.conversation_metrics["success"] == 1.0 and group.conversation_metrics["well_formed"] == 1.0
    assert len({s.sample_id for s in group.samples}) == 6
    for sample in group.samples:  # each trains its own response only, after the conversation so far
        context = group.conversation[: int(sample.metrics["context_messages"])]
        start = sample.mask.index(1)
        assert sample.tokens[:start] == chat.prompt(context)
        assert all(sample.mask[start:])
        # Its token count (the penalty's, with lambda > 0) is its own reply's, not the
        # earlier turns' as well.
        assert sample.metrics["tokens"] == sum(sample.mask)

    sft, pairs, without = group_rows(group, example=EXAMPLE, margin=0.5)

    assert sft["messages"] == group.conversation and sft["success"] == 1.0 and without == 0
    assert [(p["turn"], p["chosen_text"], p["rejected_text"]) for p in pairs] == [
        (0, question, WRONG),
        (1, RIGHT, WRONG),
    ]
    assert pairs[1]["context"] == group.conversation[:3]
    assert pairs[1]["context_ids"] == chat.prompt(group.conversation[:3])
    assert tokenizer.decode(pairs[0]["chosen_ids"], skip_special_tokens=True) == question
    assert group_rows(group, example=EXAMPLE, margin=1.5)[1:] == ([], 2)  # no gap that wide
