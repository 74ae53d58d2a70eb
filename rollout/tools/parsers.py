"""Reading tool calls out of a policy reply, in the forms chat models are trained to write.

- `hermes` (Hermes, Qwen 2.5/3): each call is a `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` block; text around the blocks is allowed.
- `llama3` (Llama 3.1-3.3 JSON tool calling): the whole reply, optionally after
  `<|python_tag|>`, is a call object `{"name": ..., "parameters": {...}}`, several
  separated by `;`, or a JSON list of them; a reply that does not start like JSON is an
  answer, not a call.

A parser never raises: what looks like a call but cannot be read becomes a `Malformed`
entry with the reason, which the tool box reports to the model and counts. Parsing is
linear in the reply, whatever it holds (a regex search for each unclosed `<tool_call>` made
a reply of 4,000 openers take seconds), and a long reply is parsed off the event loop
(`parse_reply`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.tools.base import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
OFF_LOOP_CHARS = 8192
"""A reply at least this long is parsed in a worker thread (`parse_reply`)."""


@dataclass(frozen=True)
class Malformed:
    text: str
    reason: str


@dataclass
class Parsed:
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)

    def __bool__(self) -> bool:
        """True when the reply asked for anything: the turn goes on with tool results."""
        return bool(self.calls or self.malformed)


async def parse_reply(parse: Callable[[str], Parsed], text: str) -> Parsed:
    """`parse(text)`, in a worker thread when the reply is long, so that one episode's reply
    does not hold the event loop every other episode and heartbeat of the server runs on."""
    if len(text) < OFF_LOOP_CHARS:
        return parse(text)
    return await asyncio.to_thread(parse, text)


def parse_hermes(text: str) -> Parsed:
    """Each `<tool_call>` up to the first `</tool_call>` after it is a call; an opener with no
    closer after it makes the rest of the reply one malformed call."""
    parsed, at = Parsed(), 0
    while (start := text.find(OPEN, at)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            parsed.malformed.append(Malformed(text[start:], "unclosed <tool_call>"))
            break
        _add(parsed, text[start + len(OPEN) : end].strip(), "arguments")
        at = end + len(CLOSE)
    return parsed


def parse_llama3(text: str) -> Parsed:
    parsed = Parsed()
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith(("{", "[")):
        return parsed
    try:
        whole = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        whole = None
    if isinstance(whole, list):
        for item in whole:
            _add_object(parsed, json.dumps(item), item, "parameters")
    elif whole is not None:
        _add_object(parsed, body, whole, "parameters")
    else:
        _add_sequence(parsed, body)
    return parsed


def _add_sequence(parsed: Parsed, body: str) -> None:
    """Call objects one after another, separated by `;` (a `;` inside a string is text)."""
    decoder, at = json.JSONDecoder(), 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except (json.JSONDecodeError, RecursionError) as exc:
            parsed.malformed.append(Malformed(body[at:], _invalid(exc)))
            return
        _add_object(parsed, body[at:end], value, "parameters")
        at = end
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1


def _add(parsed: Parsed, text: str, arguments_key: str) -> None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        parsed.malformed.append(Malformed(text, _invalid(exc)))
        return
    _add_object(parsed, text, value, arguments_key)


def _invalid(exc: json.JSONDecodeError | RecursionError) -> str:
    """The reason for JSON that cannot be read (nested deeper than the decoder goes: a
    RecursionError)."""
    return f"invalid JSON ({exc.msg if isinstance(exc, json.JSONDecodeError) else 'nested too deep'})"


def _add_object(parsed: Parsed, text: str, value, arguments_key: str) -> None:
    """A call from a decoded object: a string `name` and an object of arguments under
    `arguments_key` (or the other usual key; a JSON string holding an object is accepted,
    as OpenAI's API sends arguments)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        parsed.malformed.append(Malformed(text, "a call is an object with a string name"))
        return
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        parsed.malformed.append(Malformed(text, f"{arguments_key} must be an object"))
        return
    parsed.calls.append(ToolCall(value["name"], arguments))


PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes, "llama3": parse_llama3}
