"""What a tool is to an episode: a name, an OpenAI function schema the chat template shows
the model, and an async call from JSON arguments to the text the model reads back.

A tool raises `ToolError` for a failure the model should hear about in its own words (a
division by zero, no document found); anything else it raises is reported as an
`exception` by the tool box (`rollout.tools.box`), which also owns timeouts, concurrency
and per-episode limits, so a tool is only the function itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    """One call the policy asked for, as a parser read it from the reply."""

    name: str
    arguments: dict = field(default_factory=dict)


class ToolError(Exception):
    """A failure the tool explains: its message becomes the tool result the model reads."""


class Tool(Protocol):
    name: str

    def schema(self) -> dict:
        """The OpenAI function schema: {"type": "function", "function": {"name", "description",
        "parameters"}}; `parameters` is the JSON schema the arguments are checked against."""
        ...

    async def call(self, arguments: dict) -> str:
        """Run with arguments that passed the schema; the text the model reads back."""
        ...

    async def close(self) -> None:
        """Release what the tool holds (a subprocess, a connection); called once at the end."""
        ...


def function_schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    """An OpenAI function schema whose arguments are an object with exactly `properties`."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False},
    }}
