"""`asyncio.gather` that takes its siblings down with it.

When one awaitable of a plain `gather` fails, the others keep running, unsupervised: a
group's other samples would go on generating and calling the judge while the task is
already being retried. `gather_all` cancels them (and waits for them to end) before the
first error propagates, unchanged, so `except SomeError` still works (a TaskGroup would
wrap it in an ExceptionGroup).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def gather_all(*awaitables: Awaitable[T]) -> list[T]:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
