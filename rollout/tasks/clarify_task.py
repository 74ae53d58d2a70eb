"""The clarify task as a `TaskSet`: success when the final answer names the hidden target."""

from __future__ import annotations

from rollout.interactions.rule_based import ClarifyUser
from rollout.tasks import clarify
from services.config import TaskSpec


class ClarifyTask:
    name = "clarify"

    def __init__(self, spec: TaskSpec, seed: int) -> None:
        self.examples = clarify.make_examples(spec.num_examples, seed)
        self.rule_user = ClarifyUser(self.examples)

    def __len__(self) -> int:
        return len(self.examples)

    def context(self, example: int) -> list[dict]:
        return [{"role": "user", "content": clarify.request(self.examples[example])}]

    def goal(self, example: int) -> str:
        ex = self.examples[example]
        return f"You want a {ex.category}, specifically {ex.target}."

    def reference(self, example: int) -> str:
        ex = self.examples[example]
        return clarify.answer(ex.category, ex.target)

    async def score(self, example: int, messages: list[dict]) -> float:
        return float(clarify.is_correct_answer(self.examples[example], messages[-1]["content"]))

    def metrics(self, example: int, messages: list[dict]) -> dict[str, float]:
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        return {
            "success": float(clarify.is_correct_answer(self.examples[example], replies[-1])),
            "asked": float(clarify.is_question(replies[0])),
        }
