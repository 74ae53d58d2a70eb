"""Episodes and forward sampling with the real vLLM engine and the rule-based user."""

from __future__ import annotations

import pytest
import pytest_asyncio

from rollout.episode import EpisodeRunner
from rollout.rewards.multiturn import score_response
from rollout.tasks import clarify
from rollout.tasks.clarify.task import ClarifyTask
from services.config import ClarifySpec, RewardSpec, RolloutSpec
from services.tokenization import ChatTokenizer

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")  # the engine lives on the session's loop
async def runner(engine, tiny_model, tokenizer):
    await engine.reload_from_disk(str(tiny_model))  # other tests change the engine's weights
    task = ClarifyTask(ClarifySpec(num_examples=8), seed=0)
    spec = RolloutSpec(max_new_tokens=16, max_turns=3, max_total_tokens=200)
    return EpisodeRunner(engine, ChatTokenizer(tokenizer), task.rule_user, spec), task


async def test_an_episode_trains_only_policy_tokens_and_tags_them_with_a_version(runner):
    runner, task = runner
    episode = await runner.run(0, task.context(0))

    prompt_length = len(runner.chat.prompt(task.context(0)))
    assert episode.num_turns >= 1
    assert sum(episode.mask) == episode.policy_tokens > 0
    assert all(v == runner.engine.version for v, m in zip(episode.versions, episode.mask) if m)
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(episode.versions, episode.logprobs, episode.mask) if not m)
    assert episode.mask[:prompt_length] == [0] * prompt_length


async def test_futures_fork_after_the_response_and_are_not_trained(runner):
    runner, task = runner
    episode = runner.start(task.context(1))
    question = clarify.question(task.examples[1].category)  # a well-formed m_j (untrained weights rarely stop)
    reply = runner.chat.tokenizer.encode(question, add_special_tokens=False) + [runner.chat.eot_id]
    episode.append(reply, 1, [-1.0] * len(reply), [0] * len(reply))
    episode.messages.append({"role": "assistant", "content": question})
    episode.num_turns, episode.policy_tokens = 1, len(reply)
    response_tokens = list(episode.tokens)

    _, futures = await score_response(runner, episode, task, 1, RewardSpec(mode="multiturn", window=2, num_futures=3))

    assert len(futures) == 3
    assert episode.tokens == response_tokens  # the trained sample is untouched
    for future in futures:
        assert future.tokens[: len(response_tokens)] == response_tokens
        assert 1 <= future.num_turns - episode.num_turns <= 2  # the user answered the question
        assert future.messages[2] == {"role": "user", "content": clarify.clarification(task.examples[1].target)}
        assert sum(future.mask) == sum(episode.mask)  # nothing after m_j is trained
