"""gather_all: one failure cancels the siblings and comes out unchanged."""

from __future__ import annotations

import asyncio

import pytest

from rollout.concurrent import gather_all


async def test_a_failure_cancels_the_siblings_and_propagates_as_itself():
    finished, cancelled = [], []

    async def slow(name: str) -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise
        finished.append(name)
        return name

    async def failing() -> str:
        await asyncio.sleep(0.01)
        raise LookupError("the judge is gone")

    with pytest.raises(LookupError, match="the judge is gone"):
        await gather_all(slow("a"), failing(), slow("b"))

    assert sorted(cancelled) == ["a", "b"] and finished == []


async def test_results_keep_their_order():
    async def after(seconds: float, value: int) -> int:
        await asyncio.sleep(seconds)
        return value

    assert await gather_all(after(0.02, 1), after(0.0, 2), after(0.01, 3)) == [1, 2, 3]
