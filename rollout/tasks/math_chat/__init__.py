"""MATH-Chat: a math problem asked with a detail missing; the user simulator knows the full
problem. Scored by exact match of the conversation's final answer (`conversation_answer`),
or by the judge's binary `accuracy` rubric, which reads the whole conversation.

Fixture rows: {"opening": the underspecified request, "goal": the full problem as the
user's intent, "answer": the reference final answer}.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.tasks.base import FixtureTask
from rollout.tasks.common import is_question, last_found, read_examples
from services.config import MathChatSpec

if TYPE_CHECKING:
    from rollout.tasks.base import Judge, TaskSet

_NUMBER = re.compile(r"\\[dt]?frac\{[^{}]*\}\{[^{}]*\}|-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_LATEX_FRACTION = re.compile(r"(-?)\\frac\{(-?[\d.]+)\}\{([\d.]+)\}")
_NOISE = re.compile(r"\$|\\!|\\,|\\left|\\right|\s")
_VARIABLE = re.compile(r"^[a-zA-Z]=")

FIXTURE = Path(__file__).parent / "examples.jsonl"
"""The built-in examples, used when the spec names no `task.data` file."""


@dataclass(frozen=True)
class MathExample:
    opening: str
    goal: str
    answer: str


def boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` in `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for end in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth < 0:
            return text[begin:end]
    return None


def final_answer(text: str) -> str:
    """The answer a reply commits to: its last `\\boxed{}` if any, else its last number
    (integer, decimal, a/b or \\frac{a}{b}, \\dfrac and \\tfrac too); '' when it has
    neither."""
    contents = boxed(text)
    if contents is not None:
        return contents
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else ""


def normalise_answer(answer: str) -> str:
    """A canonical form for comparison: `$`, spacing macros and whitespace removed, a
    leading `x=` dropped, \\dfrac/\\tfrac read as \\frac, a trailing period dropped; a
    number (thousands commas allowed) or fraction becomes its reduced `Fraction` string,
    so 20.50, 41/2 and \\frac{41}{2} all read `41/2`."""
    text = _NOISE.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _VARIABLE.sub("", text).rstrip(".")
    value = _as_fraction(text)
    return str(value) if value is not None else text


def _as_fraction(text: str) -> Fraction | None:
    latex = _LATEX_FRACTION.fullmatch(text)
    try:
        if latex:
            sign, numerator, denominator = latex.groups()
            return (-1 if sign else 1) * Fraction(numerator) / Fraction(denominator)
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def conversation_answer(messages: list[dict]) -> str:
    """The answer the assistant last committed to in the conversation: the last `\\boxed{}`
    of any of its replies; without one, the last number of its latest reply that has one;
    '' when none has either."""
    found = last_found(messages, boxed)
    if found is None:
        found = last_found(messages, lambda text: final_answer(text) or None)
    return found or ""


def is_correct(messages: list[dict], answer: str) -> bool:
    """Exact match of the conversation's final answer with the reference, after
    normalisation."""
    return normalise_answer(conversation_answer(messages)) == normalise_answer(answer)


class MathChatTask(FixtureTask):
    name = "math_chat"

    def __init__(self, spec: MathChatSpec, judge: Judge | None = None) -> None:
        if spec.metric == "judge" and judge is None:
            raise ValueError("math_chat with metric='judge' needs a judge client")
        self.examples = [MathExample(**row) for row in read_examples(spec, FIXTURE)]
        self.judge = judge if spec.metric == "judge" else None

    def reference(self, example: int) -> str:
        return self.examples[example].answer

    async def score(self, example: int, messages: list[dict], episode=None) -> float:
        if self.judge is not None:  # metric=judge
            return await self.judge("accuracy", messages, self.reference(example))
        return float(is_correct(messages, self.examples[example].answer))

    def metrics(self, example: int, messages: list[dict]) -> dict[str, float]:
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        return {
            "exact_match": float(is_correct(messages, self.examples[example].answer)),
            "asked": float(is_question(replies[0])),
        }


def load(spec: MathChatSpec, seed: int, judge: Judge | None = None) -> TaskSet:
    """The task set of a job's `task` section (`rollout.tasks.TASKS`)."""
    return MathChatTask(spec, judge)
