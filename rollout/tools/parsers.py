"""Reading tool calls out of a policy reply, in the forms chat models are trained to write.

- `hermes` (Hermes, Qwen 2.5/3): each call is a `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` block; text around the blocks is allowed.
- `llama3` (Llama 3.1-3.3 JSON tool calling): the whole reply, optionally after
  `<|python_tag|>`, is a call object `{"name": ..., "parameters": {...}}`, several
  separated by `;`, or a JSON list of them; a reply that does not start like JSON is an
  answer, not a call.

A parser never raises: what looks like a call but cannot be read becomes a `Malformed`
entry with the reason, which the tool box reports to the model and counts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.tools.base import ToolCall

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


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


def parse_hermes(text: str) -> Parsed:
    parsed = Parsed()
    for body in _HERMES.findall(text):
        _add(parsed, body.strip(), "arguments")
    end = text.rfind("</tool_call>")
    unclosed = text if end < 0 else text[end + len("</tool_call>"):]
    if "<tool_call>" in unclosed:
        parsed.malformed.append(Malformed(unclosed[unclosed.index("<tool_call>"):], "unclosed <tool_call>"))
    return parsed


def parse_llama3(text: str) -> Parsed:
    parsed = Parsed()
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith(("{", "[")):
        return parsed
    try:
        whole = json.loads(body)
    except json.JSONDecodeError:
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
        except json.JSONDecodeError as exc:
            parsed.malformed.append(Malformed(body[at:], f"invalid JSON ({exc.msg})"))
            return
        _add_object(parsed, body[at:end], value, "parameters")
        at = end
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1


def _add(parsed: Parsed, text: str, arguments_key: str) -> None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        parsed.malformed.append(Malformed(text, f"invalid JSON ({exc.msg})"))
        return
    _add_object(parsed, text, value, arguments_key)


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
