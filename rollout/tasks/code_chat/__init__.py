"""BigCodeBench-Chat: the user asks for a Python function, leaving out parts of its spec;
the user simulator knows the full spec. Scored by the pass rate of the example's unit tests
run in the sandbox against the conversation's final code: the last Python block of any
assistant reply.

Fixture rows: {"opening": the user's first request, "goal": the full spec, "reference": a
solution that passes every test, "tests": Python snippets, each one test (usually one
`assert`), run by the sandbox's evaluator against the solution's top-level functions, which
take and return plain data (None, bool, int, float, str, bytes, list, tuple, set, dict)}.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from rollout.tasks import extraction
from rollout.tasks.base import FixtureTask, Judge, TaskSet
from rollout.tasks.common import fenced_blocks, is_question, last_found, read_examples
from rollout.tools.sandbox import run_tests
from services.config import CodeChatSpec

_PYTHON_FENCES = ("python", "py", "python3", "")

FIXTURE = Path(__file__).parent / "examples.jsonl"
"""The built-in examples, used when the spec names no `task.data` file."""


@dataclass(frozen=True)
class CodeExample:
    opening: str
    goal: str
    reference: str
    tests: list[str]


def python_code(reply: str) -> str | None:
    """The body of the reply's last fenced block tagged python (or py, python3) or bare;
    None when it has none, which scores 0 without running anything."""
    bodies = [body for info, body in fenced_blocks(reply) if info in _PYTHON_FENCES]
    return bodies[-1] if bodies else None


class CodeChatTask(FixtureTask):
    name = "code_chat"

    def __init__(self, spec: CodeChatSpec, judge: extraction.Completer | None = None) -> None:
        if spec.extraction == "llm" and judge is None:
            raise ValueError("code_chat with extraction='llm' needs a judge client")
        self.examples = [CodeExample(**row) for row in read_examples(spec, FIXTURE)]
        self.judge = judge if spec.extraction == "llm" else None

    async def score(self, example: int, messages: list[dict], episode=None) -> float:
        """The pass rate of the example's tests; the sandbox blocks, so it runs in a thread."""
        code = (
            last_found(messages, python_code)
            if self.judge is None
            else (await extraction.extract(self.judge, "code", messages) or None)
        )
        if code is None:
            return 0.0
        result = await asyncio.to_thread(run_tests, code, self.examples[example].tests)
        return result.pass_rate

    def metrics(self, example: int, messages: list[dict]) -> dict[str, float]:
        """Cheap scalars only: the pass rate is the score, and rerunning the tests here
        would block the event loop."""
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        return {
            "has_code": float(last_found(messages, python_code) is not None),
            "asked": float(is_question(replies[0])),
        }


def load(spec: CodeChatSpec, seed: int, judge: Judge | None = None) -> TaskSet:
    """The task set of a job's `task` section (`rollout.tasks.TASKS`)."""
    return CodeChatTask(spec, judge)
