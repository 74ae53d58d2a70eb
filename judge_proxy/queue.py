"""Waiting for budget: a per-process queue, fair across jobs, weighted between priorities.

Order: the priority classes take turns by weight (with `judge_weight` 3 and both classes
waiting, admissions go judge, judge, judge, simulator, ...); inside a class, jobs take
turns; inside a job, first come first served. The head of the queue tries to reserve
first. A head refused by its job's share of the budget (`share.py`: the job has had its
part) does not hold up other jobs: the head of each other job tries next, in turn order,
until one is admitted or one is refused by the budget itself. A head refused by the budget
stays the head, so a large request is never starved by smaller ones behind it. When no
head fits, the queue sleeps until the budget or the share says it should, until this
process settles a call (which may refund tokens) or until the head leaves. A waiter past
its deadline leaves with `QueueTimeout` and a `Retry-After` estimate. Each replica has its
own queue; Redis keeps the replicas' admissions inside the shared budget and the shares.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from judge_proxy import metrics

PRIORITIES = ("judge", "simulator")
T = TypeVar("T")


class Tried(NamedTuple, Generic[T]):
    """What one reservation attempt came to."""

    grant: T | None
    wait_s: float
    """0 when granted; else seconds until it could succeed."""
    by_share: bool = False
    """Refused by the job's share (not by the budget): other jobs may go first."""


TryAdmit = Callable[[], Awaitable[Tried[T]]]


class QueueTimeout(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"no budget before the deadline; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


def retry_after_s(queued_tokens: int, tokens_per_s: float) -> int:
    """Whole seconds until the tokens queued here could drain at the group's refill rate."""
    return max(1, math.ceil(queued_tokens / tokens_per_s))


@dataclass(eq=False)
class Waiter(Generic[T]):
    job: str
    priority: str
    cost_tokens: int
    deadline: float
    """Event-loop time after which the waiter gets `QueueTimeout`."""
    try_admit: TryAdmit[T]
    future: asyncio.Future[T] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def won(future: asyncio.Future) -> bool:
    """Whether the worker set a grant on the future (it may have, even if the waiter left)."""
    return future.done() and not future.cancelled() and future.exception() is None


class FairQueue:
    def __init__(self, judge_weight: int) -> None:
        self.turns = ["judge"] * judge_weight + ["simulator"]
        self.cursor = 0
        self.classes: dict[str, OrderedDict[str, deque[Waiter]]] = {p: OrderedDict() for p in PRIORITIES}

    def __len__(self) -> int:
        return sum(len(q) for jobs in self.classes.values() for q in jobs.values())

    def __iter__(self):
        return (w for jobs in self.classes.values() for q in jobs.values() for w in q)

    def push(self, waiter: Waiter) -> bool:
        """Queue `waiter` behind its job's; True when it is its job's first (a new head)."""
        waiting = self.classes[waiter.priority].setdefault(waiter.job, deque())
        waiting.append(waiter)
        return len(waiting) == 1

    def heads(self) -> list[tuple[int, Waiter]]:
        """Each job's first waiter with the turn it goes on, in the order they get their
        turn: the queue's head, the other jobs of its class, then the classes that follow."""
        found, classes = [], set()
        for step in range(len(self.turns)):
            turn = (self.cursor + step) % len(self.turns)
            if self.turns[turn] not in classes:
                classes.add(self.turns[turn])
                found += [(turn, waiting[0]) for waiting in self.classes[self.turns[turn]].values()]
        return found

    def head(self) -> Waiter | None:
        heads = self.heads()
        return heads[0][1] if heads else None

    def served(self, waiter: Waiter, turn: int) -> None:
        """Remove a head just admitted on `turn`: its job goes to the back, the next turn comes up."""
        self.discard(waiter)
        jobs = self.classes[waiter.priority]
        if waiter.job in jobs:
            jobs.move_to_end(waiter.job)
        self.cursor = (turn + 1) % len(self.turns)

    def discard(self, waiter: Waiter) -> None:
        jobs = self.classes[waiter.priority]
        waiting = jobs.get(waiter.job)
        if waiting is not None and waiter in waiting:
            waiting.remove(waiter)
            if not waiting:
                del jobs[waiter.job]


class Admitter(Generic[T]):
    """The queue of one model group in one replica, and the task that works it."""

    def __init__(self, judge_weight: int, tokens_per_s: float, release: Callable[[T], Awaitable[None]]) -> None:
        self.queue = FairQueue(judge_weight)
        self.tokens_per_s = tokens_per_s
        self.release = release
        """Gives back a grant whose waiter left (deadline, cancellation) while it was won."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def admit(
        self, job: str, priority: str, cost_tokens: int, timeout_s: float, try_admit: TryAdmit[T]
    ) -> tuple[T, float]:
        """A grant and the seconds spent queued for it (0 when the budget was free at once)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if not len(self.queue):
            tried = await try_admit()
            if tried.grant is not None:
                metrics.QUEUE_WAIT.labels(priority).observe(0.0)
                return tried.grant, 0.0
        waiter = Waiter(job, priority, cost_tokens, started + timeout_s, try_admit)
        if self.queue.push(waiter):
            self.wake()  # the worker may be sleeping on heads held back by their shares
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._work())
        try:
            async with asyncio.timeout_at(waiter.deadline):
                grant = await waiter.future
        except TimeoutError:
            self.leave(waiter)  # before counting what is still queued
            if not won(waiter.future):
                raise QueueTimeout(retry_after_s(self.queued_tokens(), self.tokens_per_s)) from None
            grant = waiter.future.result()  # won in the same loop pass as the deadline: keep it
        except asyncio.CancelledError:  # the client went away
            self.leave(waiter)
            if won(waiter.future):
                await self.release(waiter.future.result())
            raise
        waited_s = loop.time() - started
        metrics.QUEUE_WAIT.labels(priority).observe(waited_s)
        return grant, waited_s

    def leave(self, waiter: Waiter) -> None:
        """A waiter gives up; if it was its job's head, the worker must stop sleeping on its cost."""
        was_head = any(waiter is head for _, head in self.queue.heads())
        self.queue.discard(waiter)
        if was_head:
            self.wake()

    def queued_tokens(self) -> int:
        return sum(w.cost_tokens for w in self.queue)

    def wake(self) -> None:
        """Budget may have come back (a call settled here): let the heads try again now."""
        self._wake.set()

    async def _work(self) -> None:
        while self.queue.head() is not None:
            self._wake.clear()
            wait_s = await self._admit_one()
            if wait_s is not None:
                await self._sleep(wait_s)

    async def _admit_one(self) -> float | None:
        """Let the heads try in turn order until one is admitted or fails (None: look again
        at once) or one is refused by the budget; else how long to sleep. A head refused by
        its job's share lets the next job's head try."""
        wait_s = None
        for turn, waiter in self.queue.heads():
            if waiter.future.done():  # it is leaving (it left while an earlier head was trying)
                self.queue.discard(waiter)
                continue
            try:
                tried = await waiter.try_admit()
            except Exception as err:  # e.g. Redis unreachable: this waiter fails, the rest go on
                self.queue.discard(waiter)
                if not waiter.future.done():
                    waiter.future.set_exception(err)
                return None
            if tried.grant is not None:
                await self._hand_over(waiter, turn, tried.grant)
                return None
            wait_s = tried.wait_s if wait_s is None else min(wait_s, tried.wait_s)
            if not tried.by_share:
                break
        return wait_s

    async def _hand_over(self, waiter: Waiter, turn: int, grant: T) -> None:
        if waiter.future.done():  # it left while its grant was being won
            self.queue.discard(waiter)
            await self.release(grant)
        else:
            self.queue.served(waiter, turn)
            waiter.future.set_result(grant)

    async def _sleep(self, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        except TimeoutError:
            pass
