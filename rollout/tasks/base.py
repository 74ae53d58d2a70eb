"""What a task gives the rollout server: contexts, a user, and an extrinsic score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rollout.interactions.base import UserSimulator

if TYPE_CHECKING:
    from rollout.episode import Episode


@dataclass(frozen=True)
class Verdict:
    """What the judge said of one conversation: its score in [0, 1] and its one-sentence
    reason (what a person reads beside the score on the job page)."""

    score: float
    reason: str = ""


class Judge(Protocol):
    """R_llm: the judge's verdicts on conversations (`rollout.judging.ProxyJudge`).
    `call_id` names the request in its task (the proxy's idempotency key). Here because a
    task's metric may ask it (MATH-Chat with metric=judge); the rewards ask it for R_llm."""

    async def score_all(
        self, rubric: str, conversations: list[list[dict]], reference: str | None, call_id: str = ""
    ) -> list[Verdict]: ...


class TaskSet(Protocol):
    name: str
    rule_user: UserSimulator | None
    """An exact, rule-based user (synthetic tasks). None: an LLM user simulator (through the
    judge proxy) role-plays `goal`."""

    def __len__(self) -> int: ...

    def context(self, example: int) -> list[dict]:
        """The messages the assistant answers first (usually the user's opening request)."""
        ...

    def goal(self, example: int) -> str:
        """The user's hidden, complete intent, which a user simulator role-plays."""
        ...

    def reference(self, example: int) -> str:
        """The reference answer or document the task metric compares against."""
        ...

    def attachment(self, example: int) -> str:
        """What a user brings with the request whoever words it (a document to edit); ''
        for none. A simulator-written opening (`task.opening: simulator`) gets it appended."""
        ...

    async def score(self, example: int, messages: list[dict], episode: Episode | None = None) -> float:
        """R_ext in [0, 1]: the task metric of a finished conversation against the reference.
        `episode` is the conversation's episode, for a task whose verdict reads how it ended
        and what its tools did (τ²-bench); the others read `messages` alone."""
        ...

    def metrics(self, example: int, messages: list[dict]) -> dict[str, float]:
        """Task-specific scalars for dashboards (success, asked, ...)."""
        ...


class FixtureTask:
    """What the tasks read from a JSONL fixture share: each example has an `opening` (the
    user's first message), a `goal` and a `reference`; no rule-based user, so an LLM user
    simulator plays the goal. Subclasses set `examples` and add `score` and `metrics`."""

    rule_user: UserSimulator | None = None
    examples: list

    def __len__(self) -> int:
        return len(self.examples)

    def context(self, example: int) -> list[dict]:
        return [{"role": "user", "content": self.examples[example].opening}]

    def goal(self, example: int) -> str:
        return self.examples[example].goal

    def reference(self, example: int) -> str:
        return self.examples[example].reference

    def attachment(self, example: int) -> str:
        return ""
