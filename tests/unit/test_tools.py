"""Tool calling: reading calls out of a reply (hermes, llama3), the calculator's arithmetic
and refusals, the tool box around every call (argument checks, limits, timeouts, the shared
concurrency slots, failures as counted reasons), the real python tool, and the tools
section of the job spec."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pydantic import ValidationError

from rollout.tools.base import ToolCall, ToolError, function_schema
from rollout.tools.box import FAILURES, ToolBox, ToolResult, ToolUsage, tool_message, usage_metrics
from rollout.tools.calculator import MAX_EXPRESSION_CHARS, evaluate, format_number
from rollout.tools.parsers import Malformed, Parsed, parse_hermes, parse_llama3
from services.config import CalculatorToolSpec, PythonToolSpec, RLJob, SearchToolSpec, ToolsSpec, written_location
from services.tool_catalog import with_file_tools


def hermes_call(name: str, arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# Parsers: hermes.


def test_hermes_reads_one_call_with_text_around_it():
    parsed = parse_hermes("Let me compute. " + hermes_call("calculator", {"expression": "2 + 2"}) + " Done.")

    assert parsed.calls == [ToolCall("calculator", {"expression": "2 + 2"})]
    assert parsed.malformed == []


def test_hermes_reads_two_calls_in_the_replys_order():
    reply = (
        "First "
        + hermes_call("search", {"query": "ferry"})
        + "\nthen\n"
        + hermes_call("calculator", {"expression": "40 / 12"})
        + "\nthat is all"
    )

    assert parse_hermes(reply).calls == [
        ToolCall("search", {"query": "ferry"}),
        ToolCall("calculator", {"expression": "40 / 12"}),
    ]


def test_hermes_invalid_json_inside_a_block_is_malformed_with_the_json_error():
    parsed = parse_hermes('<tool_call>{"name": "calculator", arguments: {}}</tool_call>')

    assert parsed.calls == []
    assert parsed.malformed == [
        Malformed(
            '{"name": "calculator", arguments: {}}', "invalid JSON (Expecting property name enclosed in double quotes)"
        )
    ]
    assert parsed  # the turn goes on: the model hears why


def test_hermes_an_unclosed_block_is_malformed_and_closed_blocks_before_it_still_count():
    parsed = parse_hermes(hermes_call("calculator", {"expression": "1"}) + ' and <tool_call>{"name": "calc')

    assert parsed.calls == [ToolCall("calculator", {"expression": "1"})]
    assert parsed.malformed == [Malformed('<tool_call>{"name": "calc', "unclosed <tool_call>")]


def test_hermes_accepts_arguments_sent_as_a_json_string_holding_an_object():
    parsed = parse_hermes(hermes_call("calculator", json.dumps({"expression": "3 * 3"})))

    assert parsed.calls == [ToolCall("calculator", {"expression": "3 * 3"})]


@pytest.mark.parametrize(
    "body", ['{"arguments": {}}', '{"name": 7, "arguments": {}}', '{"name": "", "arguments": {}}', '["calculator"]']
)
def test_hermes_a_call_without_a_string_name_is_malformed(body):
    parsed = parse_hermes(f"<tool_call>{body}</tool_call>")

    assert parsed.calls == []
    assert parsed.malformed == [Malformed(body, "a call is an object with a string name")]


def test_hermes_arguments_that_are_not_an_object_are_malformed():
    parsed = parse_hermes(hermes_call("calculator", "2 + 2"))  # a string that is not JSON

    assert parsed.malformed[0].reason == "arguments must be an object"


def test_plain_text_has_no_calls():
    parsed = parse_hermes("The answer is 1913937.")

    assert parsed == Parsed()
    assert not parsed


# Parsers: llama3.


def test_llama3_reads_one_object_with_parameters():
    parsed = parse_llama3('{"name": "calculator", "parameters": {"expression": "4821 * 397"}}')

    assert parsed.calls == [ToolCall("calculator", {"expression": "4821 * 397"})]


def test_llama3_reads_a_call_after_the_python_tag():
    parsed = parse_llama3('<|python_tag|>{"name": "search", "parameters": {"query": "mayor"}}')

    assert parsed.calls == [ToolCall("search", {"query": "mayor"})]


def test_llama3_reads_a_json_list_of_calls():
    parsed = parse_llama3('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]')

    assert parsed.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})]


def test_llama3_reads_calls_separated_by_semicolons():
    parsed = parse_llama3('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "z"}}')

    assert parsed.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": "z"})]
    assert parsed.malformed == []


def test_llama3_a_plain_answer_has_no_calls():
    assert parse_llama3("The answer is 42.") == Parsed()


def test_llama3_broken_json_that_starts_like_a_call_is_malformed():
    parsed = parse_llama3('{"name": "calculator", "parameters": {"expression": ')

    assert parsed.calls == []
    assert [m.reason for m in parsed.malformed] == ["invalid JSON (Expecting value)"]


# Calculator.


@pytest.mark.parametrize(
    ("expression", "shown"),
    [
        ("4821 * 397", "1913937"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("2 ** 10", "1024"),
        ("2 ^ 10", "1024"),  # the caret people write for powers
        ("7 / 2", "3.5"),
        ("10 / 5", "2"),  # a whole float without ".0"
        ("0.1 + 0.2", "0.3"),  # 12 significant digits, not 0.30000000000000004
        ("1 / 3", "0.333333333333"),
        ("-7 // 2", "-4"),
        ("17 % 5", "2"),
        ("-(3 - 5) * 2", "4"),
    ],
)
def test_the_calculator_computes_and_formats(expression, shown):
    assert format_number(evaluate(expression)) == shown


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("__import__('os')", "unsupported in an arithmetic expression"),
        ("abs(-3)", "unsupported in an arithmetic expression: 'abs(-3)'"),
        ("(1).real", "unsupported in an arithmetic expression"),
        ("x + 1", "unsupported in an arithmetic expression: 'x'"),
        ("'a' * 3", "unsupported in an arithmetic expression"),
        ("9 ** 9999", "exponent above 1000"),
        ("(2 ** 1000) ** 1000", "result longer than 4000 digits"),
        ("10.0 ** 400", "result too large"),
        ("1 +", "not an arithmetic expression"),
        ("1" * (MAX_EXPRESSION_CHARS + 1), "expression longer than 500 characters"),
    ],
)
def test_the_calculator_refuses_with_a_tool_error(expression, message):
    with pytest.raises(ToolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        evaluate(expression)


# The tool box, with fake tools.


class Sleeper:
    """Sleeps, then echoes `text`; counts its own calls in flight."""

    def __init__(self, name: str = "sleep", seconds: float = 0.0) -> None:
        self.name = name
        self.seconds = seconds
        self.in_flight = 0
        self.most_in_flight = 0
        self.closed = False

    def schema(self) -> dict:
        return function_schema(
            self.name, "Sleep, then echo.", {"text": {"type": "string"}, "times": {"type": "integer"}}, ["text"]
        )

    async def call(self, arguments: dict) -> str:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self.in_flight -= 1
        return arguments["text"]

    async def close(self) -> None:
        self.closed = True


class Explains(Sleeper):
    async def call(self, arguments: dict) -> str:
        raise ToolError("no page matches 'ferry'")


class Breaks(Sleeper):
    async def call(self, arguments: dict) -> str:
        raise RuntimeError("disk on fire")


def tool_box(*tools, max_calls_per_episode: int = 8, **limits) -> ToolBox:
    """A box over `tools`, each with the same tool limits (the kind is only a label)."""
    specs = {t.name: CalculatorToolSpec(name=t.name, kind="calculator", **limits) for t in tools}
    return ToolBox(
        ToolsSpec(tools=list(specs.values()), max_calls_per_episode=max_calls_per_episode), list(tools), specs
    )


def calls(*calls: ToolCall) -> Parsed:
    return Parsed(calls=list(calls))


def echo(text: str = "hi", name: str = "sleep") -> ToolCall:
    return ToolCall(name, {"text": text})


async def test_a_call_that_succeeds_is_recorded_in_the_episodes_usage():
    box, usage = tool_box(Sleeper()), ToolUsage()

    results = await box.run(calls(echo("hello")), usage)

    assert [(r.content, r.failure, r.ok) for r in results] == [("hello", "", True)]
    assert usage.calls == {"sleep": 1}
    assert usage.results == results


async def test_an_unknown_tool_is_refused_with_the_list_of_tools():
    box, usage = tool_box(Sleeper(), Explains("lookup")), ToolUsage()

    [result] = await box.run(calls(ToolCall("browser", {})), usage)

    assert result.failure == "unknown_tool"
    assert result.content == "error: there is no tool named 'browser' (tools: lookup, sleep)"
    assert usage.calls == {}  # not run, so no limit is spent


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "error: bad arguments for sleep: arguments: 'text' is a required property"),
        ({"text": 5}, "error: bad arguments for sleep: text: 5 is not of type 'string'"),
        ({"text": "a", "times": "2"}, "error: bad arguments for sleep: times: '2' is not of type 'integer'"),
        (
            {"text": "a", "loud": True},
            "error: bad arguments for sleep: arguments: Additional properties are not allowed ('loud' was unexpected)",
        ),
    ],
)
async def test_arguments_the_schema_rejects_are_refused_naming_the_field(arguments, message):
    tool = Sleeper()
    [result] = await tool_box(tool).run(calls(ToolCall("sleep", arguments)), ToolUsage())

    assert (result.failure, result.content) == ("bad_arguments", message)
    assert tool.most_in_flight == 0  # never called


async def test_a_tool_called_more_than_max_calls_in_one_episode_is_refused():
    box, usage = tool_box(Sleeper(), max_calls=2), ToolUsage()

    first = await box.run(calls(echo("1")), usage)
    second = await box.run(calls(echo("2"), echo("3")), usage)

    assert [r.failure for r in first] == [""]
    assert sorted(r.failure for r in second) == ["", "call_limit"]
    refused = next(r for r in second if r.failure)
    assert refused.content == "error: sleep may be called at most 2 times per conversation"
    assert usage.calls == {"sleep": 2}
    # Another episode has its own count.
    assert [r.failure for r in await box.run(calls(echo("4")), ToolUsage())] == [""]


async def test_calls_over_max_calls_per_episode_are_refused_whatever_the_tool():
    box, usage = tool_box(Sleeper("a"), Sleeper("b"), max_calls_per_episode=3), ToolUsage()

    results = await box.run(calls(echo(name="a"), echo(name="a"), echo(name="b"), echo(name="b")), usage)

    refused = [r for r in results if r.failure]
    assert [(r.call.name, r.failure, r.content) for r in refused] == [
        ("b", "call_limit", "error: at most 3 tool calls per conversation")
    ]
    assert usage.calls == {"a": 2, "b": 1}
    assert usage.total == 4


async def test_a_tool_running_past_its_timeout_is_cut_at_the_timeout():
    box = tool_box(Sleeper(seconds=30), timeout_s=0.2)

    started = time.monotonic()
    [result] = await box.run(calls(echo()), ToolUsage())
    elapsed_s = time.monotonic() - started

    assert (result.failure, result.content) == ("timeout", "error: sleep did not answer within 0.2 s")
    assert 0.2 <= result.seconds <= elapsed_s < 1.0
    assert box.in_flight["sleep"] == 0


async def test_a_tool_error_is_reported_in_the_tools_own_words():
    [result] = await tool_box(Explains()).run(calls(echo()), ToolUsage())

    assert (result.failure, result.content) == ("tool_error", "error: no page matches 'ferry'")


async def test_an_exception_from_a_tool_is_reported_not_raised():
    [result] = await tool_box(Breaks()).run(calls(echo()), ToolUsage())

    assert (result.failure, result.content) == ("exception", "error: sleep failed (RuntimeError: disk on fire)")


async def test_unreadable_calls_are_reported_as_malformed_and_counted():
    usage = ToolUsage()
    parsed = Parsed(calls=[echo()], malformed=[Malformed("{bad", "invalid JSON (Expecting value)")])

    results = await tool_box(Sleeper()).run(parsed, usage)

    malformed = [r for r in results if r.failure == "malformed"]
    assert [(r.call, r.content) for r in malformed] == [
        (None, "error: could not read the tool call (invalid JSON (Expecting value))")
    ]
    assert usage.failures() == {"malformed": 1}
    assert (usage.total, usage.succeeded) == (2, 1)


async def test_a_burst_from_many_episodes_never_runs_more_than_max_concurrency_calls_of_a_tool():
    tool = Sleeper(seconds=0.02)
    box = tool_box(tool, max_concurrency=3)
    usages = [ToolUsage() for _ in range(10)]

    replies = await asyncio.gather(
        *(box.run(calls(echo(f"{i}a"), echo(f"{i}b")), usage) for i, usage in enumerate(usages))
    )

    assert [[r.content for r in results] for results in replies] == [[f"{i}a", f"{i}b"] for i in range(10)]
    assert all(r.ok for results in replies for r in results)
    assert box.most_in_flight["sleep"] == 3  # the burst fills every slot and no more
    assert tool.most_in_flight == 3
    assert box.in_flight["sleep"] == 0


def test_usage_metrics_count_calls_success_and_failures_by_reason():
    call = echo()
    usage = ToolUsage(
        results=[
            ToolResult(call, "hi"),
            ToolResult(call, "hi"),
            ToolResult(None, "error", "malformed"),
            ToolResult(call, "error", "timeout"),
        ]
    )

    assert usage_metrics(usage) == {
        "tool_calls": 4.0,
        "tool_used": 1.0,
        "tool_success_ratio": 0.5,
        **{f"tool_failed_{reason}": 0.0 for reason in FAILURES},
        "tool_failed_malformed": 1.0,
        "tool_failed_timeout": 1.0,
    }


def test_usage_metrics_without_a_successful_call():
    failed = ToolUsage(results=[ToolResult(echo(), "error", "unknown_tool")])

    assert usage_metrics(ToolUsage())["tool_success_ratio"] == 0.0
    assert usage_metrics(ToolUsage())["tool_calls"] == 0.0
    assert (usage_metrics(failed)["tool_used"], usage_metrics(failed)["tool_failed_unknown_tool"]) == (0.0, 1.0)


def test_a_result_goes_back_as_a_tool_message_named_after_its_tool():
    assert tool_message(ToolResult(echo(), "hi")) == {"role": "tool", "content": "hi", "name": "sleep"}
    assert tool_message(ToolResult(None, "error: x", "malformed")) == {"role": "tool", "content": "error: x"}


async def test_close_closes_every_tool_even_after_one_fails():
    class FailsToClose(Sleeper):
        async def close(self) -> None:
            raise RuntimeError("already gone")

    last = Sleeper("last")
    await tool_box(FailsToClose("first"), last).close()

    assert last.closed


# The tool box with the real built-in tools.


async def test_open_builds_the_calculator_and_the_python_tool_and_runs_them():
    spec = ToolsSpec(
        tools=[
            CalculatorToolSpec(name="calculator", kind="calculator"),
            PythonToolSpec(name="python", kind="python", timeout_s=20),
        ]
    )
    box = await ToolBox.open(spec)
    try:
        assert [s["function"]["name"] for s in box.schemas()] == ["calculator", "python"]
        reply = (
            hermes_call("calculator", {"expression": "4821 * 397"})
            + hermes_call("python", {"code": "for i in range(3):\n    print(i * i)"})
            + hermes_call("python", {"code": "print('before')\nraise ValueError('no such row')"})
        )

        results = await box.run(box.parse(reply), ToolUsage())

        assert [(r.failure, r.content) for r in results] == [
            ("", "1913937"),
            ("", "0\n1\n4"),
            ("tool_error", "error: before\nValueError: no such row"),
        ]
    finally:
        await box.close()


async def test_open_builds_the_search_tool_over_its_fixture():
    box = await ToolBox.open(ToolsSpec(tools=[SearchToolSpec(name="lookup", kind="search", top_k=1)]))
    try:
        [result] = await box.run(box.parse(hermes_call("lookup", {"query": "speed of light"})), ToolUsage())
        assert result.ok and result.content.startswith("[d") and "light" in result.content.lower()
    finally:
        await box.close()


async def test_open_adds_the_tools_of_the_spec_file(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - name: calc\n    kind: calculator\n    max_calls: 2\n")
    box = await ToolBox.open(ToolsSpec(file=str(path)))

    assert list(box.tools) == ["calc"]
    assert box.limits["calc"].max_calls == 2
    [result] = await box.run(box.parse(hermes_call("calc", {"expression": "6 * 7"})), ToolUsage())
    assert result.content == "42"
    await box.close()


# The tools section of the job spec.


def job(tools: dict) -> RLJob:
    """An RL job with `tools` (validated as its kind, so an error's location starts at the field)."""
    return RLJob.model_validate({"model": {"path": "models/tiny"}, "tools": tools})


@pytest.mark.parametrize(
    ("tools", "loc"),
    [
        ({"tools": [{"name": "abacus", "kind": "abacus"}]}, ("tools", "tools", 0, "kind")),
        ({"parser": "xml", "tools": [{"name": "calc", "kind": "calculator"}]}, ("tools", "parser")),
        ({"tools": [{"name": "calc", "kind": "calculator", "max_calls": 0}]}, ("tools", "tools", 0, "max_calls")),
        ({"tools": [{"name": "two words", "kind": "calculator"}]}, ("tools", "tools", 0, "name")),
        ({"tools": [{"name": "calc"}]}, ("tools", "tools", 0, "kind")),
        ({"tools": [{"name": "calc", "kind": "mcp"}]}, ("tools", "tools", 0, "server")),
        ({"tools": [{"name": "calc", "kind": "search", "top_k": 0}]}, ("tools", "tools", 0, "top_k")),
        ({"tools": [{"name": "calc", "kind": "calculator", "top_k": 2}]}, ("tools", "tools", 0, "top_k")),
    ],
)
def test_a_bad_tools_section_is_rejected_naming_the_field_as_written(tools, loc):
    with pytest.raises(ValidationError) as caught:
        job(tools)

    assert [written_location(error["loc"], error["type"]) for error in caught.value.errors()] == [loc]


def test_tool_names_must_not_repeat():
    with pytest.raises(ValidationError, match=r"tool names repeat: \['calc'\]"):
        job({"tools": [{"name": "calc", "kind": "calculator"}, {"name": "calc", "kind": "python"}]})


def test_a_tool_of_kind_mcp_needs_a_server_and_only_it_has_one():
    with pytest.raises(ValidationError, match=r"tools.0.mcp.server\n  Field required"):
        job({"tools": [{"name": "add", "kind": "mcp"}]})
    with pytest.raises(ValidationError, match=r"tools.0.calculator.server\n  Extra inputs are not permitted"):
        job({"tools": [{"name": "calc", "kind": "calculator", "server": {"url": "http://127.0.0.1:9/mcp"}}]})
    spec = job({"tools": [{"name": "add", "kind": "mcp", "server": {"command": ["mcp-server"]}}]})
    assert spec.tools.tools[0].server.command == ["mcp-server"]


def test_resolved_adds_the_files_tools_to_the_inline_ones(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - name: python\n    kind: python\n    timeout_s: 5\n")
    spec = ToolsSpec(parser="llama3", tools=[CalculatorToolSpec(name="calc", kind="calculator")], file=str(path))

    resolved = with_file_tools(spec)

    assert [(t.name, t.kind) for t in resolved.tools] == [("calc", "calculator"), ("python", "python")]
    assert resolved.tools[1].timeout_s == 5.0
    assert (resolved.parser, resolved.file) == ("llama3", None)
    assert with_file_tools(ToolsSpec(tools=spec.tools)) == ToolsSpec(tools=spec.tools)


@pytest.mark.parametrize(
    "text",
    [
        "tools:\n  - name: calc\n    kind: abacus\n",  # a bad tool
        "tools:\n  - name: calculator\n    kind: calculator\n",  # repeats an inline name
        "tools: calc\n",  # not a list
    ],
)
def test_resolved_rejects_a_bad_file_naming_tools_file(tmp_path, text):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    spec = ToolsSpec(tools=[CalculatorToolSpec(name="calculator", kind="calculator")], file=str(path))

    with pytest.raises(ValueError, match="tools.file"):
        with_file_tools(spec)


def test_resolved_rejects_a_missing_file_naming_tools_file(tmp_path):
    with pytest.raises(ValueError, match="tools.file .*missing.yaml"):
        with_file_tools(ToolsSpec(file=str(tmp_path / "missing.yaml")))


async def test_results_come_in_the_replys_order_refused_calls_in_their_place():
    box, usage = tool_box(Sleeper()), ToolUsage()

    results = await box.run(calls(echo("first"), ToolCall("nope", {}), echo("third")), usage)

    assert [r.failure for r in results] == ["", "unknown_tool", ""]
    assert [r.content for r in (results[0], results[2])] == ["first", "third"]


def test_llama3_a_semicolon_inside_a_string_argument_does_not_split_the_call():
    parsed = parse_llama3(
        '{"name": "python", "parameters": {"code": "a = 1; print(a)"}}; '
        '{"name": "calculator", "parameters": {"expression": "2*3"}}'
    )

    assert parsed.calls == [
        ToolCall("python", {"code": "a = 1; print(a)"}),
        ToolCall("calculator", {"expression": "2*3"}),
    ]
    assert not parsed.malformed


def test_a_power_too_large_is_refused_before_it_is_computed():
    started = time.monotonic()
    with pytest.raises(ToolError, match="digits"):
        evaluate("(9**999*9**999*9**999*9**999)**999")
    assert time.monotonic() - started < 0.5  # computing it first took seconds
