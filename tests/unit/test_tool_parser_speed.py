"""Reading tool calls takes time linear in the reply, whatever the policy wrote, never
raises on deep nesting, and a long reply is read off the event loop."""

from __future__ import annotations

import threading
import time

import pytest

from rollout.tools.parsers import OFF_LOOP_CHARS, Malformed, Parsed, parse_hermes, parse_llama3, parse_reply


def unclosed_openers(num_bytes: int) -> str:
    """Closed calls that are not JSON, then openers never closed: a regex search from each
    opener to the end of the reply made this quadratic (1.0 s for 44 KB, 3.7 s for 88 KB)."""
    closed = "<tool_call>x</tool_call>" * (num_bytes // 2 // 24)
    return closed + "<tool_call>" * (num_bytes // 2 // 11)


def best_time_s(parse, text: str, repeats: int = 5) -> float:
    """The fastest of a few runs: the others measure the machine's other load."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        parse(text)
        times.append(time.perf_counter() - started)
    return min(times)


@pytest.mark.parametrize(
    "parse, make",
    [
        (parse_hermes, unclosed_openers),
        (parse_hermes, lambda n: "<tool_call>" + "[" * (n - 23) + "</tool_call>"),
        (parse_llama3, lambda n: '{"name": "f", "parameters": {}};' * (n // 33) + "{"),
    ],
)
def test_parsing_time_grows_linearly_with_an_adversarial_reply(parse, make):
    small, large = best_time_s(parse, make(44_000)), best_time_s(parse, make(88_000))

    assert small < 0.2
    assert large < 4 * small


def test_unclosed_openers_after_closed_calls_are_one_malformed_call_from_the_first_of_them():
    parsed = parse_hermes(unclosed_openers(2 * 24 * 3))

    assert parsed.calls == []
    assert [m.reason for m in parsed.malformed] == ["invalid JSON (Expecting value)"] * 3 + ["unclosed <tool_call>"]
    assert parsed.malformed[-1].text == "<tool_call>" * 6


@pytest.mark.parametrize(
    "parse, text, malformed",
    [
        (parse_hermes, "<tool_call>" + "[" * 100_000 + "</tool_call>", "[" * 100_000),
        (parse_llama3, "[" * 100_000, "[" * 100_000),
        (parse_llama3, '{"name": "f", "parameters": {}}; ' + "[" * 100_000, "[" * 100_000),
    ],
)
def test_json_nested_deeper_than_the_decoder_goes_is_a_malformed_call_not_an_error(parse, text, malformed):
    parsed = parse(text)

    assert parsed.malformed == [Malformed(malformed, "invalid JSON (nested too deep)")]


async def test_a_long_reply_is_parsed_in_a_worker_thread_and_a_short_one_in_the_loop():
    threads = []

    def parse(text: str) -> Parsed:
        threads.append(threading.get_ident())
        return parse_hermes(text)

    await parse_reply(parse, "x" * (OFF_LOOP_CHARS - 1))
    long = await parse_reply(parse, "x" * OFF_LOOP_CHARS + '<tool_call>{"name": "f", "arguments": {}}</tool_call>')

    assert threads[0] == threading.get_ident()
    assert threads[1] != threading.get_ident()
    assert [c.name for c in long.calls] == ["f"]
