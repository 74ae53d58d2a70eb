"""The user side of a conversation: given the conversation so far, the next user message."""

from __future__ import annotations

from typing import Protocol


class UserSimulator(Protocol):
    async def respond(self, example: int, messages: list[dict]) -> str | None:
        """The next user message for `messages` (ending with an assistant turn), or None
        when the user ends the conversation."""
        ...
