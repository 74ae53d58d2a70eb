"""The clarify task's rule-based user: exact, free and instant."""

from __future__ import annotations

from rollout.tasks import clarify


class ClarifyUser:
    """Answers a clarifying question truthfully; ends the conversation on any answer."""

    def __init__(self, examples: list[clarify.ClarifyExample]) -> None:
        self.examples = examples

    async def respond(self, example: int, messages: list[dict], call_id: str = "") -> str | None:
        if clarify.is_question(messages[-1]["content"]):
            return clarify.clarification(self.examples[example].target)
        return None
