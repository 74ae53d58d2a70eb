"""What the policy is trained to answer, beyond a task's openings: a system prompt, and the
later turns of MR-ranked conversations.

CollabLLM trains every assistant turn j of the conversations its data generation ranks (at
each turn the best of several responses by MR carries on), under a system prompt that asks
the assistant to collaborate. `ContextView` gives any task set both, without the task
knowing: `task.contexts` names a file of such conversations (a generate job's `sft.jsonl`:
`{"messages", "example"}` rows), and each of its prefixes that ends with a user turn
becomes a context of its own, scored and simulated as its row's example;
`task.system_prompt` is put before every context that has none. Everything else (goal,
reference, score, metrics, the rule-based user) is the base task's, read with the row's
example.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rollout.interactions.base import UserSimulator
from rollout.tasks.base import TaskSet
from rollout.tasks.common import checked_file
from rollout.tools.base import Tool, World, WorldTool

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class TurnContext:
    example: int
    """The base task's example the conversation plays."""
    messages: list[dict]
    """The conversation up to and including the user turn the policy answers."""
    turn: int
    """How many assistant turns come before it (0: the opening)."""


def turn_contexts(path: str | Path, limit: int) -> list[TurnContext]:
    """Every prefix ending with a user turn of every conversation in the JSONL `path`, in
    file order, the first `limit` of them. A row that is not `{"messages": [{role, content},
    ...], "example": <index>}`, or has a role other than system, user and assistant, raises
    ValueError naming its line."""
    contexts: list[TurnContext] = []
    with checked_file(path, "task.contexts").open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            example, messages = _row(line, number)
            turn = 0
            for end, message in enumerate(messages, 1):
                if message["role"] == "user":
                    contexts.append(TurnContext(example, messages[:end], turn))
                turn += message["role"] == "assistant"
            if len(contexts) >= limit:
                return contexts[:limit]
    if not contexts:
        raise ValueError(f"task.contexts {str(path)!r}: no conversation with a user turn")
    return contexts


def _row(line: str, number: int) -> tuple[int, list[dict]]:
    where = f"task.contexts line {number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from exc
    example, messages = (row.get("example"), row.get("messages")) if isinstance(row, dict) else (None, None)
    if not isinstance(example, int) or isinstance(example, bool) or not 0 <= example < 10_000_000:
        raise ValueError(f"{where}: `example` must be the index of one of the task's examples")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError(f"{where}: `messages` must be a list of {{role: system|user|assistant, content: str}}")
    return example, [{"role": m["role"], "content": m["content"]} for m in messages]


class ExampleUser:
    """A rule-based user of the base task, spoken to with a context's index."""

    def __init__(self, user: UserSimulator, example_of) -> None:
        self.user, self.example_of = user, example_of

    async def respond(self, example: int, messages: list[dict], call_id: str = "") -> str | None:
        return await self.user.respond(self.example_of(example), messages, call_id)


class ContextView(TaskSet):
    """A task set whose contexts carry a system prompt and, with `turns`, are those
    conversation prefixes (each index one prefix); the rest is the base task's."""

    def __init__(self, base: TaskSet, system_prompt: str | None = None, turns: list[TurnContext] | None = None) -> None:
        self.base, self.system_prompt, self.turns = base, system_prompt, turns
        self.name = base.name
        self.rule_user = (
            base.rule_user if base.rule_user is None or turns is None else ExampleUser(base.rule_user, self.example_of)
        )

    def example_of(self, index: int) -> int:
        return index if self.turns is None else self.turns[index].example

    def turn(self, index: int) -> int:
        """Assistant turns before this context (0 without `turns`)."""
        return 0 if self.turns is None else self.turns[index].turn

    def __len__(self) -> int:
        return len(self.base) if self.turns is None else len(self.turns)

    def context(self, index: int) -> list[dict]:
        messages = self.base.context(index) if self.turns is None else list(self.turns[index].messages)
        if self.system_prompt and not (messages and messages[0]["role"] == "system"):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def goal(self, index: int) -> str:
        return self.base.goal(self.example_of(index))

    def reference(self, index: int) -> str:
        return self.base.reference(self.example_of(index))

    def attachment(self, index: int) -> str:
        return self.base.attachment(self.example_of(index))

    async def score(self, index: int, messages: list[dict], episode=None) -> float:
        return await self.base.score(self.example_of(index), messages, episode)

    def tools(self) -> Sequence[Tool | WorldTool] | None:
        return self.base.tools()

    def world(self, index: int) -> World | None:
        return self.base.world(self.example_of(index))

    def metrics(self, index: int, messages: list[dict]) -> dict[str, float]:
        """The base task's metrics and the turn trained. `asked` (whether the first reply
        of the conversation asks) is left out after the opening: there it describes the
        context's reply, not the one trained."""
        metrics = self.base.metrics(self.example_of(index), messages) | {"turn": float(self.turn(index))}
        if self.turn(index) > 0:
            metrics.pop("asked", None)
        return metrics
