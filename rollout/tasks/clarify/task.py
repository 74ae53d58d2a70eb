"""The clarify task as a `TaskSet`: success when the final answer names the hidden target."""

from __future__ import annotations

import random

from rollout.tasks import clarify
from rollout.tasks.base import Judge, TaskSet
from rollout.tasks.clarify.user import ClarifyUser
from services.config import ClarifySpec


class ClarifyTask(TaskSet):
    name = "clarify"

    def __init__(self, spec: ClarifySpec, seed: int) -> None:
        self.examples = clarify.make_examples(spec.num_examples, seed)
        self.rule_user = ClarifyUser(self.examples) if spec.user == "auto" else None
        """None: the LLM user simulator plays `goal` (the same answers, at an LLM's cost)."""
        rng = random.Random(seed + 1)
        self.followups = {i for i in range(len(self.examples)) if rng.random() < spec.followup_share}
        """Examples whose context already holds the question and the clarification."""

    def __len__(self) -> int:
        return len(self.examples)

    def context(self, example: int) -> list[dict]:
        ex = self.examples[example]
        messages = [{"role": "user", "content": clarify.request(ex)}]
        if example in self.followups:
            messages += [
                {"role": "assistant", "content": clarify.question(ex.category)},
                {"role": "user", "content": clarify.clarification(ex.target)},
            ]
        return messages

    def goal(self, example: int) -> str:
        return clarify.goal(self.examples[example])

    def reference(self, example: int) -> str:
        ex = self.examples[example]
        return clarify.answer(ex.category, ex.target)

    async def score(self, example: int, messages: list[dict], episode=None) -> float:
        return float(clarify.is_correct_answer(self.examples[example], messages[-1]["content"]))

    def metrics(self, example: int, messages: list[dict]) -> dict[str, float]:
        """success; and `asked` (the policy's first reply is a question) for contexts that
        start with the request alone."""
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        metrics = {"success": float(clarify.is_correct_answer(self.examples[example], replies[-1]))}
        if example not in self.followups:
            metrics["asked"] = float(clarify.is_question(replies[0]))
        return metrics


def load(spec: ClarifySpec, seed: int, judge: Judge | None = None) -> TaskSet:
    """The task set of a job's `task` section (`rollout.tasks.TASKS`)."""
    return ClarifyTask(spec, seed)


def demonstrations(num: int, share: float, seed: int) -> list[dict]:
    """Warm-start rows, `share` of the vague requests asked about first (`rollout.tasks.demonstrations`)."""
    return [{"messages": dialogue} for dialogue in clarify.demonstrations(num, seed=seed, ask_share=share)]
