"""How a policy turn ends, with a scripted engine in place of vLLM."""

from __future__ import annotations

import pytest

from rollout.engine import Generation
from rollout.episode import EpisodeRunner
from services.config import RolloutSpec
from services.tokenization import ChatTokenizer


class ScriptedEngine:
    version = 0

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def generate(self, prompt, max_tokens, temperature, stop_ids) -> Generation:
        return self.generation


def reply(chat: ChatTokenizer, text: str, last: list[int], finish_reason: str) -> Generation:
    tokens = chat.tokenizer.encode(text, add_special_tokens=False) + last
    return Generation(tokens, [-0.5] * len(tokens), [0] * len(tokens), finish_reason)


@pytest.mark.parametrize(
    "last, finish_reason, reason",
    [
        ("eot", "stop", ""),  # a complete turn
        ("", "length", "truncated"),  # cut at max_new_tokens
        ("other", "stop", "wrong_stop"),  # stopped on another EOS id: cannot be continued
        ("inside", "stop", "special_token"),  # a turn marker inside the reply, then end-of-turn
    ],
)
async def test_only_a_turn_ending_in_the_end_of_turn_token_goes_on(tokenizer, last, finish_reason, reason):
    chat = ChatTokenizer(tokenizer)
    other = chat.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert other != chat.eot_id
    tail = {"eot": [chat.eot_id], "": [], "other": [other], "inside": [other, chat.eot_id]}[last]
    runner = EpisodeRunner(
        ScriptedEngine(reply(chat, "Which fruit?", tail, finish_reason)),
        chat,
        None,
        RolloutSpec(max_new_tokens=16, max_turns=3, max_total_tokens=200),
    )
    episode = runner.start([{"role": "user", "content": "I want a fruit."}])

    goes_on = await runner.policy_turn(episode)

    assert goes_on is (reason == "")
    assert episode.malformed_reason() == reason and episode.well_formed() is (reason == "")


async def test_a_blank_reply_is_malformed_as_empty_and_the_conversation_goes_on(tokenizer):
    chat = ChatTokenizer(tokenizer)
    runner = EpisodeRunner(
        ScriptedEngine(reply(chat, "  ", [chat.eot_id], "stop")),
        chat,
        None,
        RolloutSpec(max_new_tokens=16, max_turns=3, max_total_tokens=200),
    )
    episode = runner.start([{"role": "user", "content": "I want a fruit."}])

    assert await runner.policy_turn(episode)
    assert episode.malformed_reason() == "empty"
