"""The judge proxy's waiting queue: turn order, wake-ups, deadlines."""

from __future__ import annotations

import asyncio
import time

import pytest

from judge_proxy.queue import Admitter, FairQueue, QueueTimeout, Tried, Waiter, retry_after_s


async def never() -> Tried:
    return Tried(None, 60.0)


async def forget(grant) -> None:
    pass


class Released(list):
    """A `release` callback that keeps the grants given back."""

    async def __call__(self, grant) -> None:
        self.append(grant)


async def test_priorities_take_turns_by_weight_and_jobs_take_turns_inside_a_priority():
    queue = FairQueue(judge_weight=3)
    for name in ["A1", "A2", "A3", "B1", "B2"]:
        queue.push(Waiter(job=name[0], priority="judge", cost_tokens=1, deadline=0.0, try_admit=never))
    for name in ["C1", "C2", "C3"]:
        queue.push(Waiter(job=name[0], priority="simulator", cost_tokens=1, deadline=0.0, try_admit=never))
    names = {
        id(w): f"{w.job}{i + 1}" for job in ("A", "B", "C") for i, w in enumerate(w for w in queue if w.job == job)
    }

    order = []
    while heads := queue.heads():
        turn, head = heads[0]
        order.append(names[id(head)])
        queue.served(head, turn)

    assert order == ["A1", "B1", "A2", "C1", "B2", "A3", "C2", "C3"]
    assert len(queue) == 0


async def test_waiters_are_admitted_in_turn_as_budget_comes_back():
    admitter = Admitter(judge_weight=2, tokens_per_s=100.0, release=forget)
    free = 0

    async def one_slot() -> Tried:
        nonlocal free
        if free:
            free -= 1
            return Tried("lease", 0.0)
        return Tried(None, 60.0)  # the budget says: a minute; only a wake-up brings it sooner

    admitted, waits = [], []

    async def request(name: str, job: str, priority: str) -> None:
        grant, waited_s = await admitter.admit(job, priority, 10, 5.0, one_slot)
        admitted.append(name)
        waits.append(waited_s)

    tasks = [
        asyncio.create_task(request(n, j, p))
        for n, j, p in [("s1", "x", "simulator"), ("j1", "x", "judge"), ("j2", "y", "judge"), ("j3", "x", "judge")]
    ]
    await asyncio.sleep(0.01)
    for _ in tasks:
        free += 1
        admitter.wake()
        await asyncio.sleep(0.01)

    assert admitted == ["j1", "j2", "s1", "j3"]
    assert all(0.01 <= w < 0.2 for w in waits)
    await asyncio.gather(*tasks)


async def test_a_request_admitted_at_once_reports_no_queue_wait():
    admitter = Admitter(judge_weight=3, tokens_per_s=100.0, release=forget)

    async def free() -> Tried:
        await asyncio.sleep(0.02)  # the reservation's own round trip is not waiting
        return Tried("lease", 0.0)

    assert await admitter.admit("a", "judge", 10, 1.0, free) == ("lease", 0.0)


async def test_a_waiter_past_its_deadline_gets_queue_timeout_with_retry_after():
    admitter = Admitter(judge_weight=3, tokens_per_s=100.0, release=forget)
    waiting = asyncio.create_task(admitter.admit("b", "judge", 250, 5.0, never))
    await asyncio.sleep(0.01)
    started = time.monotonic()

    with pytest.raises(QueueTimeout) as timeout:
        await admitter.admit("a", "simulator", 120, 0.05, never)

    assert 0.04 <= time.monotonic() - started < 0.5
    assert timeout.value.retry_after_s == 3  # 250 tokens still queued at 100 tokens/s
    waiting.cancel()


async def test_a_failing_budget_fails_its_waiter_instead_of_the_queue():
    admitter = Admitter(judge_weight=3, tokens_per_s=100.0, release=forget)
    calls = 0

    async def broken() -> Tried:
        nonlocal calls
        calls += 1
        if calls == 1:
            return Tried(None, 0.01)
        raise ConnectionError("redis is gone")

    with pytest.raises(ConnectionError):
        await admitter.admit("a", "judge", 1, 1.0, broken)
    assert len(admitter.queue) == 0


async def test_a_grant_won_for_a_waiter_that_timed_out_is_released():
    released = Released()
    admitter = Admitter(judge_weight=3, tokens_per_s=100.0, release=released)
    calls = 0

    async def slow_grant() -> Tried:
        nonlocal calls
        calls += 1
        if calls == 1:
            return Tried(None, 0.0)  # the arrival's own try: no budget yet
        await asyncio.sleep(0.1)
        return Tried("lease", 0.0)

    with pytest.raises(QueueTimeout):
        await admitter.admit("a", "judge", 1, 0.05, slow_grant)
    await asyncio.sleep(0.1)

    assert released == ["lease"]


async def test_a_grant_set_as_its_client_goes_away_is_released():
    released = Released()
    admitter = Admitter(judge_weight=3, tokens_per_s=100.0, release=released)
    calls = 0

    async def grant_on_second_try() -> Tried:
        nonlocal calls
        calls += 1
        if calls == 1:
            return Tried(None, 0.0)  # the arrival's own try
        # Runs after the worker sets the grant and before the client resumes: the client is
        # cancelled although its future holds a grant.
        asyncio.get_running_loop().call_soon(client.cancel)
        return Tried("lease", 0.0)

    client = asyncio.create_task(admitter.admit("a", "judge", 1, 5.0, grant_on_second_try))
    with pytest.raises(asyncio.CancelledError):
        await client

    assert released == ["lease"]


async def test_when_the_head_leaves_the_next_waiter_tries_at_once():
    admitter = Admitter(judge_weight=3, tokens_per_s=100.0, release=forget)

    async def free() -> Tried:
        return Tried("lease", 0.0)

    head = asyncio.create_task(admitter.admit("a", "judge", 5000, 0.05, never))  # fits in a minute
    await asyncio.sleep(0.01)
    started = time.monotonic()

    grant, _ = await admitter.admit("b", "judge", 1, 3.0, free)

    assert grant == "lease" and time.monotonic() - started < 0.5
    with pytest.raises(QueueTimeout):
        await head


async def test_a_head_held_back_by_its_share_lets_the_other_jobs_heads_go_first():
    admitter = Admitter(judge_weight=3, tokens_per_s=100.0, release=forget)
    tries = []

    def attempt(name: str, tried: Tried):
        async def try_admit() -> Tried:
            tries.append(name)
            return tried

        return try_admit

    share_says_a_minute = Tried(None, 60.0, by_share=True)
    first = asyncio.create_task(admitter.admit("a", "judge", 10, 0.5, attempt("a1", share_says_a_minute)))
    await asyncio.sleep(0.01)  # a1 tried on arrival and once more as the head; the worker sleeps
    second = asyncio.create_task(admitter.admit("a", "judge", 10, 0.5, attempt("a2", share_says_a_minute)))
    other_job = asyncio.create_task(admitter.admit("b", "judge", 10, 3.0, attempt("b1", Tried("b1", 0.0))))
    simulator = asyncio.create_task(admitter.admit("c", "simulator", 10, 3.0, attempt("c1", Tried("c1", 0.0))))

    assert (await other_job)[0] == "b1" and (await simulator)[0] == "c1"
    # Each pass starts at the head; a2 waits behind a1 (inside a job, first come first served).
    assert tries == ["a1", "a1", "a1", "b1", "a1", "c1", "a1"]
    for waiting in (first, second):
        with pytest.raises(QueueTimeout):
            await waiting


async def test_a_head_refused_by_the_budget_holds_the_other_jobs_back():
    admitter = Admitter(judge_weight=3, tokens_per_s=100.0, release=forget)
    tries = []

    async def small() -> Tried:
        tries.append("b1")
        return Tried("b1", 0.0)

    large = asyncio.create_task(admitter.admit("a", "judge", 5000, 0.3, never))  # the budget says: a minute
    await asyncio.sleep(0.01)

    with pytest.raises(QueueTimeout):
        await admitter.admit("b", "judge", 10, 0.2, small)
    assert tries == []
    with pytest.raises(QueueTimeout):
        await large


def test_retry_after_is_the_time_to_drain_the_queued_tokens_at_least_one_second():
    assert [retry_after_s(t, 100.0) for t in (0, 50, 100, 101, 1000)] == [1, 1, 1, 2, 10]
