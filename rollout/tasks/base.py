"""What a task gives the rollout server: contexts, a user, and an extrinsic score."""

from __future__ import annotations

from typing import Protocol

from rollout.interactions.base import UserSimulator


class TaskSet(Protocol):
    user: UserSimulator

    def __len__(self) -> int: ...

    def context(self, example: int) -> list[dict]:
        """The messages the assistant answers first."""
        ...

    async def score(self, example: int, messages: list[dict]) -> float:
        """R_ext in [0, 1]: the task metric of a finished conversation against its reference."""
        ...

    def metrics(self, example: int, messages: list[dict]) -> dict[str, float]:
        """Task-specific scalars for dashboards (success, asked, ...)."""
        ...
