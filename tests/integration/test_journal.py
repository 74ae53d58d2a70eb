"""The task journal a rollout server that takes a task over replays from, on real Redis: a
recorded policy reply is used only after the very tokens it followed, a reply's tool
results are taken from it instead of calling the tool again, and it lives as long as the
judge proxy's replay memory.

Each test plays the task twice: once as the server that dies (its journal is all that is
left of it), then as the one that takes the task over, opening the same journal."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from judge_proxy.proxy import Proxy
from rollout.engine import Generation
from rollout.episode import EpisodeRunner
from rollout.journal import Journal
from rollout.tools.box import ToolBox
from services.config import (
    JudgeProxySettings,
    McpServerSpec,
    McpToolSpec,
    RolloutSettings,
    RolloutSpec,
    ToolCatalog,
    ToolsSpec,
)
from services.tokenization import ChatTokenizer

pytestmark = pytest.mark.asyncio(loop_scope="session")

JOB, TASK, TTL_S = "journal-test", 12, 3600.0
CONTEXT = [{"role": "user", "content": "I want a fruit."}]
RECORDED_VERSION = 10**6
"""The policy version the dead server's replies carry: one the engine under test never has."""


@pytest_asyncio.fixture(loop_scope="session")  # on the session's loop, as the engine is
async def redis_client(redis_url):
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


class Script:
    """The dead server's policy: these replies in turn, each at logprob -0.5 per token."""

    def __init__(self, chat: ChatTokenizer, replies: list[str]) -> None:
        self.chat, self.replies = chat, list(replies)
        self.calls = 0

    async def generate(self, prompt, max_tokens, temperature, stop_ids) -> Generation:
        text = self.replies[self.calls]
        self.calls += 1
        tokens = self.chat.tokenizer.encode(text, add_special_tokens=False) + [self.chat.eot_id]
        return Generation(tokens, [-0.5] * len(tokens), [RECORDED_VERSION] * len(tokens), "stop")


class Says:
    """A user simulator that answers every turn with `reply` (an LLM user that answered
    differently after the takeover)."""

    def __init__(self, reply: str) -> None:
        self.reply = reply

    async def respond(self, example: int, messages: list[dict], call_id: str = "") -> str | None:
        return self.reply


def turn_runs(episode) -> list[tuple[list[int], list[float], list[int]]]:
    """The trained runs of the episode: (tokens, logprobs, versions) per policy reply."""
    runs, current = [], None
    for token, mask, logprob, version in zip(episode.tokens, episode.mask, episode.logprobs, episode.versions):
        if mask and current is None:
            current = ([], [], [])
            runs.append(current)
        if not mask:
            current = None
            continue
        current[0].append(token)
        current[1].append(logprob)
        current[2].append(version)
    return runs


async def test_a_recalled_reply_after_other_tokens_is_generated_again_with_the_engines_logprobs(
    redis_client, engine, tokenizer
):
    chat = ChatTokenizer(tokenizer, "off")
    spec = RolloutSpec(max_new_tokens=16, max_turns=2, max_total_tokens=200)
    dead = await Journal.open(redis_client, JOB, TASK, TTL_S)
    script = Script(chat, ["Which fruit?", "An apple, then."])
    before = await EpisodeRunner(script, chat, Says("Apples."), spec).run(0, CONTEXT, "task12/s0", dead)
    assert [m["content"] for m in before.messages[1:]] == ["Which fruit?", "Apples.", "An apple, then."]

    journal = await Journal.open(redis_client, JOB, TASK, TTL_S)
    after = await EpisodeRunner(engine, chat, Says("Pears."), spec).run(0, CONTEXT, "task12/s0", journal)

    first, second = turn_runs(after)
    assert first == turn_runs(before)[0]  # the same tokens led to it: the recorded reply
    assert after.messages[1:3] == [
        {"role": "assistant", "content": "Which fruit?"},
        {"role": "user", "content": "Pears."},
    ]
    assert second[2] == [engine.version] * len(second[0]) != [RECORDED_VERSION] * len(second[0])
    assert (journal.replayed, journal.diverged) == (1, 1)
    # What the engine generated is what was trained and what the journal now holds.
    reread = await Journal.open(redis_client, JOB, TASK, TTL_S)
    recorded = reread.recall("task12/s0/t3", after.tokens[: len(after.tokens) - len(second[0])], Generation)
    assert (recorded.tokens, recorded.logprobs, recorded.versions) == second


CATALOG = ToolCatalog(
    mcp_servers={"test": McpServerSpec(command=[sys.executable, str(Path(__file__).parent / "mcp_test_server.py")])}
)


async def test_a_tool_result_recorded_before_a_takeover_is_reused_and_the_tool_not_called_again(
    redis_client, tokenizer
):
    box = await ToolBox.open(ToolsSpec(tools=[McpToolSpec(name="tick", kind="mcp", server="test")]), catalog=CATALOG)
    try:
        chat = ChatTokenizer(tokenizer, "off").with_tools(box.schemas())
        call = f"<tool_call>{json.dumps({'name': 'tick', 'arguments': {}})}</tool_call>"
        spec = RolloutSpec(max_new_tokens=64, max_turns=1, max_total_tokens=400)

        async def play(journal: Journal):
            script = Script(chat, [call, "Ticked."])
            episode = await EpisodeRunner(script, chat, Says(""), spec, box).run(0, CONTEXT, "task12/s0", journal)
            return episode, script

        before, _ = await play(await Journal.open(redis_client, JOB, TASK, TTL_S))
        after, script = await play(await Journal.open(redis_client, JOB, TASK, TTL_S))

        assert before.messages[2] == after.messages[2] == {"role": "tool", "name": "tick", "content": "tick 1"}
        assert after.tokens == before.tokens and after.tool_use.total == 1
        assert script.calls == 0  # both replies came from the journal too
        assert await box.tools["tick"].call({}) == "tick 2"  # the takeover made no call of its own
    finally:
        await box.close()


async def test_the_journal_lives_exactly_as_long_as_the_judge_proxys_replay_memory(redis_client, monkeypatch):
    monkeypatch.setenv("TANDEM_IDEMPOTENCY_TTL_S", "120")
    memory = Proxy(JudgeProxySettings(), [], redis_client).memory
    started = time.monotonic()
    slot = memory.replay(JOB, "task12/s0/t2", {"messages": []})
    await memory.store({slot: b"a reply"})
    journal = await Journal.open(redis_client, JOB, TASK, RolloutSettings().idempotency_ttl_s)
    await journal.record("task12/s0/t1", [1, 2, 3], Generation([4], [-0.5], [0], "stop"))
    elapsed_ms = (time.monotonic() - started) * 1000

    for key in (slot.key, journal.key):
        assert 120_000 - elapsed_ms - 1 <= await redis_client.pttl(key) <= 120_000
