"""Episodes that call tools, on the real vLLM engine: tool rounds, masks and the strict
tokenization check, an MCP server's tools, a tool that hangs, and the shared concurrency
limit under a burst of episodes.

A random tiny model never writes a tool call, so the module first teaches it four short
conversations by SFT (the learner's own trainer) until it replays them: one question per
behaviour, with the calculator twice, the MCP server's `add`, its `slow` tool for half a
second, and `slow` for an hour. The engine then plays them with real tools; what the tools
answer is whatever they answer (a timeout error, for the hanging one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from learner.trainer import Trainer
from rollout.episode import EpisodeRunner
from rollout.tasks.multiply import OneAnswerUser
from rollout.tools.box import ToolBox, tool_message
from services import protocol
from services.config import (
    CalculatorToolSpec,
    McpServerSpec,
    McpToolSpec,
    ModelSpec,
    RLJob,
    RolloutSpec,
    ToolCatalog,
    ToolsSpec,
)
from services.tokenization import ChatTokenizer

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

CATALOG = ToolCatalog(
    mcp_servers={"test": McpServerSpec(command=[sys.executable, str(Path(__file__).parent / "mcp_test_server.py")])}
)
"""The operator's catalogue: the job's tools name its test server."""
QUESTIONS = {"twice": "Compute 12 times 34.", "add": "Add 2 and 3.", "wait": "Wait a moment.", "hang": "Wait forever."}


def tools_spec(slow_timeout_s: float = 5.0, slow_concurrency: int = 2) -> ToolsSpec:
    return ToolsSpec(
        max_rounds_per_turn=2,
        tools=[
            CalculatorToolSpec(name="calculator", kind="calculator"),
            McpToolSpec(name="add", kind="mcp", server="test"),
            McpToolSpec(
                name="slow", kind="mcp", server="test", timeout_s=slow_timeout_s, max_concurrency=slow_concurrency
            ),
        ],
    )


def call(name: str, arguments: dict) -> dict:
    return {
        "role": "assistant",
        "content": f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>",
    }


def lessons() -> list[list[dict]]:
    """The conversations the policy is taught to replay (tool turns as the tools answer)."""

    def user(key: str) -> dict:
        return {"role": "user", "content": QUESTIONS[key]}

    def tool(name: str, content: str) -> dict:
        return {"role": "tool", "name": name, "content": content}

    return [
        [
            user("twice"),
            call("calculator", {"expression": "12 * 34"}),
            tool("calculator", "408"),
            call("calculator", {"expression": "408 + 1"}),
            tool("calculator", "409"),
            {"role": "assistant", "content": "The answer is 409."},
        ],
        [user("add"), call("add", {"a": 2, "b": 3}), tool("add", "5"), {"role": "assistant", "content": "It is 5."}],
        [
            user("wait"),
            call("slow", {"seconds": 0.5}),
            tool("slow", "slept 0.5s"),
            {"role": "assistant", "content": "Done."},
        ],
        [
            user("hang"),
            call("slow", {"seconds": 3600}),
            # What the box answers when the call is cut at the hang test's 0.5 s timeout:
            # taught word for word, the reply after it is replayed, not left to chance.
            tool("slow", "error: slow did not answer within 0.5 s"),
            {"role": "assistant", "content": "Gave up."},
        ],
    ]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def box():
    opened = await ToolBox.open(tools_spec(), catalog=CATALOG)
    yield opened
    await opened.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def taught(engine, tiny_model, tokenizer, process_group, box, tmp_path_factory):
    """The engine serving the tiny model after it learned `lessons` by heart."""
    spec = RLJob(model=ModelSpec(path=str(tiny_model), max_model_len=512))
    spec.warm_start.steps, spec.warm_start.lr = 200, 3e-3
    trainer = Trainer(spec, torch.device("cpu"))
    chat = ChatTokenizer(tokenizer).with_tools(box.schemas())
    samples = []
    for i, messages in enumerate(lessons()):
        tokens, mask = chat.encode_demonstration(messages)
        samples.append(
            protocol.Sample(
                sample_id=str(i),
                tokens=tokens,
                mask=mask,
                logprobs=[0.0] * len(tokens),
                versions=[-1] * len(tokens),
                reward=0.0,
                advantage=0.0,
                num_turns=0,
            )
        )
    for _ in range(spec.warm_start.steps):
        loss = trainer.sft_step(samples)["sft_loss"]
    assert loss < 0.05, f"the lessons were not learned (loss {loss:.3f})"
    folder = tmp_path_factory.mktemp("taught")
    trainer.export(str(folder))
    await engine.reload_from_disk(str(folder))
    yield engine
    await engine.reload_from_disk(str(tiny_model))  # as the other tests expect it


def runner_for(engine, tokenizer, box: ToolBox) -> EpisodeRunner:
    spec = RolloutSpec(temperature=0.01, max_new_tokens=96, max_turns=1, max_total_tokens=512)
    return EpisodeRunner(
        engine, ChatTokenizer(tokenizer, "strict").with_tools(box.schemas()), OneAnswerUser(), spec, box
    )


def question(key: str) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[key]}]


def mask_runs(episode) -> list[tuple[int, list[int]]]:
    """The episode's tokens as runs of equal mask: (mask, tokens)."""
    runs: list[tuple[int, list[int]]] = []
    for token, mask in zip(episode.tokens, episode.mask):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return runs


async def test_two_tool_rounds_mask_the_results_and_spell_a_fresh_rendering(taught, tokenizer, box):
    runner = runner_for(taught, tokenizer, box)

    episode = await runner.run(0, question("twice"))

    assert [r.call.arguments["expression"] for r in episode.tool_use.results] == ["12 * 34", "408 + 1"]
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["408", "409"]
    assert episode.num_turns == 1 and episode.end == "max_turns" and episode.well_formed()
    replies = [m["content"] for m in episode.messages if m["role"] == "assistant"]
    trained = [tokens for mask, tokens in mask_runs(episode) if mask == 1]
    assert [tokenizer.decode(t, skip_special_tokens=True) for t in trained] == replies  # only the policy's text
    assert replies[-1] == "The answer is 409."
    untrained = [tokens for mask, tokens in mask_runs(episode) if mask == 0]
    tool_turns = [[m] for m in episode.messages if m["role"] == "tool"]
    assert untrained == [runner.chat.prompt(question("twice")), *map(runner.chat.delta, tool_turns)]
    runner.chat.check(episode.tokens, episode.messages)  # strict: the text equals a fresh rendering
    assert runner.chat.tokenizer.decode(episode.tokens).startswith("<|im_start|>system\nTools:\n- calculator(")


async def test_an_mcp_servers_tool_is_listed_called_and_answers_in_the_episode(taught, tokenizer, box):
    listed = {s["function"]["name"]: s["function"] for s in box.schemas()}
    assert {"calculator", "add", "slow"} == listed.keys()
    assert set(listed["add"]["parameters"]["properties"]) == {"a", "b"}

    episode = await runner_for(taught, tokenizer, box).run(1, question("add"))

    assert [(r.call.name, r.call.arguments, r.content, r.ok) for r in episode.tool_use.results] == [
        ("add", {"a": 2, "b": 3}, "5", True)
    ]
    assert tool_message(episode.tool_use.results[0]) in episode.messages
    assert episode.messages[-1] == {"role": "assistant", "content": "It is 5."}


async def test_a_tool_that_hangs_is_cut_at_its_timeout_and_the_episode_goes_on(taught, tokenizer):
    hasty = await ToolBox.open(tools_spec(slow_timeout_s=0.5), catalog=CATALOG)
    try:
        episode = await runner_for(taught, tokenizer, hasty).run(3, question("hang"))
    finally:
        await hasty.close()

    [result] = episode.tool_use.results
    assert result.failure == "timeout" and 0.5 <= result.seconds < 3
    assert result.content == "error: slow did not answer within 0.5 s"
    assert episode.messages[-2] == {"role": "tool", "name": "slow", "content": result.content}
    assert episode.messages[-1]["role"] == "assistant" and episode.end == "max_turns"


async def test_a_burst_of_episodes_never_runs_more_calls_of_a_tool_at_once_than_its_limit(taught, tokenizer, box):
    import asyncio

    runner = runner_for(taught, tokenizer, box)

    episodes = await asyncio.gather(*(runner.run(2, question("wait")) for _ in range(8)))

    assert all([r.failure for r in e.tool_use.results] == [""] for e in episodes)  # all 8 ran, one each
    assert box.most_in_flight["slow"] == 2  # the limit was reached and never passed
    assert box.in_flight["slow"] == 0
