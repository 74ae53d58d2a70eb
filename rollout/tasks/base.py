"""What a task gives the rollout server: contexts, a user, and an extrinsic score (`TaskSet`),
and what it may ask of the judge (`Judge`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rollout.interactions.base import UserSimulator
from rollout.tasks.extraction import Completer

if TYPE_CHECKING:
    from rollout.episode import Episode
    from rollout.tools.base import Tool, World, WorldTool
    from services.judge_client import JudgeClient


@dataclass(frozen=True)
class Verdict:
    """What the judge said of one conversation: its score in [0, 1] and its one-sentence
    reason (what a person reads beside the score on the job page)."""

    score: float
    reason: str = ""


class Judge(Completer, Protocol):
    """R_llm: the judge's verdicts on conversations (`rollout.judging.ProxyJudge`).
    `call_id` names the request in its task (the proxy's idempotency key). Here because a
    task's metric may ask it (MATH-Chat with metric=judge, and, as a `Completer`, a task
    whose document an LLM reads out); the rewards ask it for R_llm."""

    async def __call__(self, rubric: str, messages: list[dict], reference: str | None) -> float:
        """One conversation's score under `rubric`."""
        ...

    async def score_all(
        self, rubric: str, conversations: list[list[dict]], reference: str | None, call_id: str = ""
    ) -> list[Verdict]: ...


class TaskSet:
    """A task's examples as the rollout server plays them: the contexts the policy answers,
    the goal a user plays, the reference and the extrinsic score. A task subclasses it and
    writes the methods that raise below; the ones with defaults are capabilities a task
    brings only where it has them (its own user, tools, a world per episode), which the
    rollout server calls on every task (`rollout.assembly`)."""

    name: str
    rule_user: UserSimulator | None = None
    """An exact, rule-based user (synthetic tasks). None: another user plays `goal`
    (`own_user`)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def context(self, example: int) -> list[dict]:
        """The messages the assistant answers first (usually the user's opening request)."""
        raise NotImplementedError

    def goal(self, example: int) -> str:
        """The user's hidden, complete intent, which a user simulator role-plays."""
        raise NotImplementedError

    def reference(self, example: int) -> str:
        """The reference answer or document the task metric compares against."""
        raise NotImplementedError

    def attachment(self, example: int) -> str:
        """What a user brings with the request whoever words it (a document to edit); ''
        for none. A simulator-written opening (`task.opening: simulator`) gets it appended."""
        return ""

    async def score(self, example: int, messages: list[dict], episode: Episode | None = None) -> float:
        """R_ext in [0, 1]: the task metric of a finished conversation against the reference.
        `episode` is the conversation's episode, for a task whose verdict reads how it ended
        and what its tools did (τ²-bench); the others read `messages` alone."""
        raise NotImplementedError

    def metrics(self, example: int, messages: list[dict]) -> dict[str, float]:
        """Task-specific scalars for dashboards (success, asked, ...)."""
        raise NotImplementedError

    def own_user(self, client: JudgeClient, user_model: str, job: str, seed: int) -> UserSimulator | None:
        """The user this task brings: its rule-based user, or (a task that briefs one) an LLM
        role-playing its brief through `client` as `user_model`. None: the LLM user
        simulator plays `goal` (`rollout.assembly.task_user`)."""
        return self.rule_user

    def tools(self) -> Sequence[Tool | WorldTool] | None:
        """The tools this task brings (τ²-bench's domain tools), which replace the job's;
        None: the job's own `tools`, if any. Called in a thread: it may read files."""
        return None

    def world(self, example: int) -> World | None:
        """A fresh world for an episode of `example`, which the task's world tools act on;
        None for a task without one."""
        return None


class FixtureTask(TaskSet):
    """What the tasks read from a JSONL fixture share: each example has an `opening` (the
    user's first message), a `goal` and a `reference`; no rule-based user, so an LLM user
    simulator plays the goal. Subclasses set `examples` and add `score` and `metrics`."""

    examples: list

    def __len__(self) -> int:
        return len(self.examples)

    def context(self, example: int) -> list[dict]:
        return [{"role": "user", "content": self.examples[example].opening}]

    def goal(self, example: int) -> str:
        return self.examples[example].goal

    def reference(self, example: int) -> str:
        return self.examples[example].reference
