"""The user side of a conversation: given the conversation so far, the next user message."""

from __future__ import annotations

from typing import Protocol


class UserSimulator(Protocol):
    async def respond(self, example: int, messages: list[dict], call_id: str = "") -> str | None:
        """The next user message for `messages` (ending with an assistant turn), or None
        when the user ends the conversation. `call_id` names the turn in its task: an LLM
        user sends it as the idempotency key of its call."""
        ...
