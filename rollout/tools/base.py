"""What a tool is to an episode: a name, an OpenAI function schema the chat template shows
the model, and an async call from JSON arguments to the text the model reads back.

A tool that acts on state of its own episode (a τ² domain's database, `rollout.tasks.tau2`)
says so with `acts_on_world = True`: its call also gets the episode's `World`, which the
tool box finds on the episode's `ToolUsage` and which forks with the episode.

A tool raises `ToolError` for a failure the model should hear about in its own words (a
division by zero, no document found); anything else it raises is reported as an
`exception` by the tool box (`rollout.tools.box`), which also owns timeouts, concurrency
and per-episode limits, so a tool is only the function itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13; only annotations use it


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


class WorldTool(Protocol):
    """A tool whose calls act on the episode's `World` (`acts_on_world` is True)."""

    name: str
    acts_on_world: bool

    def schema(self) -> dict: ...

    async def call(self, arguments: dict, world: World) -> str: ...

    async def close(self) -> None: ...


def acts_on_world(tool: Tool | WorldTool) -> TypeIs[WorldTool]:
    """Whether `tool`'s calls get the episode's world (it says so with `acts_on_world = True`)."""
    return bool(getattr(tool, "acts_on_world", False))


class World(Protocol):
    """State that belongs to one episode and that its tools change: each episode starts
    from its own, and a forked episode (a sampled future) goes on with a copy."""

    def fork(self) -> World: ...


def function_schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    """An OpenAI function schema whose arguments are an object with exactly `properties`."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }
