"""The shared TPM/RPM budget on a real Redis: levels, waits, reconciliation, clamping,
pauses, leases, and replicas racing from separate processes."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import pytest
import redis.asyncio as aioredis

from judge_proxy.budget import CONCURRENCY_POLL_S, Budget, Limits
from services.queues import Keys


def limits(tpm: int = 600, rpm: int = 6000, max_concurrency: int = 100, lease_ttl_s: float = 30.0, **window) -> Limits:
    return Limits(tpm, rpm, max_concurrency, lease_ttl_s, **window)


def window(
    tpm: int = 600, rpm: int = 6000, window_s: float = 60.0, margin_s: float = 0.0, pace_s: float = 0.0
) -> Limits:
    return Limits(tpm, rpm, 100, 30.0, "window", window_s, margin_s, pace_s=pace_s, prompt_margin=0.0)


async def test_reservations_stop_at_the_level_and_say_how_long_the_refill_takes(redis_client):
    budget = Budget(redis_client, "a", limits(tpm=600))  # 10 tokens a second

    first = await budget.reserve(400)
    too_big = await budget.reserve(300)
    rest = await budget.reserve(200)
    one_more = await budget.reserve(1)

    assert first.lease is not None and rest.lease is not None
    assert too_big.lease is None and too_big.wait_s == pytest.approx((300 - 200) / 10, abs=0.1)
    assert one_more.lease is None and one_more.wait_s == pytest.approx(0.1, abs=0.05)


async def test_requests_per_minute_bound_admissions_too(redis_client):
    budget = Budget(redis_client, "a", limits(tpm=60_000, rpm=2))

    admissions = [await budget.reserve(1) for _ in range(3)]

    assert [a.lease is not None for a in admissions] == [True, True, False]
    assert admissions[2].wait_s == pytest.approx(30.0, abs=0.1)


async def test_reconciliation_refunds_an_overestimate_and_charges_an_underestimate(redis_client):
    budget = Budget(redis_client, "a", limits(tpm=60))  # 1 token a second: refill stays under 0.1 here

    lease = (await budget.reserve(50)).lease
    level_after_refund = await budget.settle(lease, used_tokens=20)
    lease = (await budget.reserve(40)).lease
    level_after_charge = await budget.settle(lease, used_tokens=55)
    waiting = await budget.reserve(1)
    view = await budget.view()

    assert level_after_refund == pytest.approx(60 - 20, abs=0.1)
    assert level_after_charge == pytest.approx(40 - 40 - (55 - 40), abs=0.1)  # the overshoot is owed
    assert waiting.lease is None and waiting.wait_s == pytest.approx(16.0, abs=0.2)
    assert (view.used_tokens_total, view.used_requests_total) == (75, 2)


async def test_a_lower_remaining_header_from_the_upstream_clamps_the_shared_level(redis_client):
    budget = Budget(redis_client, "a", limits(tpm=60, rpm=60))

    lease = (await budget.reserve(10)).lease
    clamped = await budget.settle(lease, used_tokens=10, remaining_tokens=20, remaining_requests=5)
    lease = (await budget.reserve(1)).lease
    not_raised = await budget.settle(lease, used_tokens=1, remaining_tokens=59)
    view = await budget.view()

    assert clamped == pytest.approx(20, abs=0.1)
    assert not_raised == pytest.approx(19, abs=0.1)
    assert view.available_requests == pytest.approx(4, abs=0.1)


async def test_an_upstream_429_pauses_every_replica_and_costs_nothing(redis_url, redis_client):
    other_client = aioredis.from_url(redis_url)
    replica_a = Budget(redis_client, "a", limits(tpm=600))
    replica_b = Budget(other_client, "a", limits(tpm=600))

    lease = (await replica_a.reserve(100)).lease
    await replica_a.settle(lease, used_tokens=0, used_request=False, pause_s=0.5)
    paused = await replica_b.reserve(1)
    view = await replica_b.view()
    await other_client.aclose()

    assert paused.lease is None and paused.wait_s == pytest.approx(0.5, abs=0.05)
    assert view.available_tokens == pytest.approx(600, abs=0.5)
    assert view.available_requests == pytest.approx(6000, abs=0.5)
    assert view.paused_for_s == pytest.approx(0.5, abs=0.05)


async def test_the_concurrency_cap_holds_until_a_lease_is_settled_or_expires(redis_client):
    budget = Budget(redis_client, "a", limits(tpm=60_000, max_concurrency=1, lease_ttl_s=0.2))

    held = (await budget.reserve(1)).lease
    blocked = await budget.reserve(1)
    await budget.settle(held, used_tokens=1)
    abandoned = (await budget.reserve(1)).lease
    blocked_again = await budget.reserve(1)
    await asyncio.sleep(0.25)
    after_expiry = await budget.reserve(1)

    assert blocked.lease is None and blocked.wait_s == CONCURRENCY_POLL_S
    assert abandoned is not None and blocked_again.lease is None
    assert after_expiry.lease is not None
    assert (await budget.view()).inflight == 1


RACER = """
import asyncio, json, random, sys, time
import redis.asyncio as aioredis
from judge_proxy.budget import Budget, Limits

async def main(url, start_at, seconds, tpm, rpm, max_concurrency, hold_s, seed, model):
    client = aioredis.from_url(url)
    budget = Budget(client, "race", Limits(tpm, rpm, max_concurrency, 30.0, model, pace_s=0.0))
    rng = random.Random(seed)
    totals = {"tokens": 0, "requests": 0, "peak_inflight": 0}

    async def one_caller():
        while time.time() < start_at + seconds:
            cost = rng.randint(5, 50)
            admission = await budget.reserve(cost)
            if admission.lease is None:
                await asyncio.sleep(min(admission.wait_s, 0.005))
                continue
            totals["peak_inflight"] = max(totals["peak_inflight"], await client.incr("race:inflight"))
            await asyncio.sleep(hold_s)
            await client.decr("race:inflight")
            await budget.settle(admission.lease, used_tokens=cost)
            totals["tokens"] += cost
            totals["requests"] += 1

    await asyncio.sleep(max(0.0, start_at - time.time()))
    await asyncio.gather(*(one_caller() for _ in range(8)))
    print(json.dumps(totals))

a = sys.argv
asyncio.run(main(a[1], float(a[2]), float(a[3]), int(a[4]), int(a[5]), int(a[6]), float(a[7]), int(a[8]), a[9]))
"""


async def race(
    redis_url: str,
    redis_client,
    *,
    tpm: int,
    rpm: int,
    max_concurrency: int,
    hold_s: float,
    seconds: float = 1.0,
    replicas: int = 4,
    model: str = "bucket",
) -> list[dict]:
    """`replicas` processes with 8 callers each hammer one budget that starts empty (a
    bucket) or full (a window)."""
    now_s, now_us = await redis_client.time()
    start_at = now_s + now_us / 1e6 + 2.0  # after the processes have imported (slow on a busy machine)
    if model == "bucket":
        await redis_client.hset(
            Keys.judge_budget("race"), mapping={"tokens": 0, "requests": 0, "ts": f"{start_at:.6f}"}
        )
    args = [str(a) for a in (start_at, seconds, tpm, rpm, max_concurrency, hold_s)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, redis_url, *args, str(seed), model], stdout=subprocess.PIPE, text=True
        )
        for seed in range(replicas)
    ]
    outputs = await asyncio.gather(*(asyncio.to_thread(p.communicate, timeout=30) for p in processes))
    assert all(p.returncode == 0 for p in processes)
    return [json.loads(out) for out, _ in outputs]


async def test_replicas_racing_never_admit_more_than_the_token_budget_and_use_nearly_all(redis_url, redis_client):
    tpm, seconds = 60_000, 1.0  # 1000 tokens a second from an empty bucket

    results = await race(redis_url, redis_client, tpm=tpm, rpm=10**7, max_concurrency=1000, hold_s=0.0, seconds=seconds)

    admitted = sum(r["tokens"] for r in results)
    assert admitted <= tpm / 60 * (seconds + 0.05)
    assert admitted >= 0.9 * tpm / 60 * seconds
    assert all(r["requests"] > 0 for r in results)


async def test_replicas_racing_never_admit_more_than_the_request_budget(redis_url, redis_client):
    rpm, seconds = 6000, 1.0  # 100 requests a second from an empty bucket

    results = await race(redis_url, redis_client, tpm=10**9, rpm=rpm, max_concurrency=1000, hold_s=0.0, seconds=seconds)

    admitted = sum(r["requests"] for r in results)
    assert 0.9 * rpm / 60 * seconds <= admitted <= rpm / 60 * (seconds + 0.05)


async def test_replicas_racing_share_one_concurrency_cap(redis_url, redis_client):
    results = await race(redis_url, redis_client, tpm=10**9, rpm=10**9, max_concurrency=3, hold_s=0.02, seconds=0.5)

    assert max(r["peak_inflight"] for r in results) == 3


async def test_replicas_racing_never_admit_more_than_a_window_holds(redis_url, redis_client):
    tpm = 2000  # a one-minute window: nothing leaves it during the race

    results = await race(
        redis_url, redis_client, tpm=tpm, rpm=10**7, max_concurrency=1000, hold_s=0.0, seconds=1.0, model="window"
    )

    admitted = sum(r["tokens"] for r in results)
    assert tpm - 50 <= admitted <= tpm  # 50: the largest cost that may not fit at the end


# --- the trailing window -------------------------------------------------------------------


async def test_a_window_allows_no_burst_past_its_limit_until_the_first_entry_leaves(redis_client):
    budget = Budget(redis_client, "w", window(tpm=600, window_s=60.0, margin_s=1.0))

    first = await budget.reserve(400)
    rest = await budget.reserve(200)
    one_more = await budget.reserve(1)

    assert first.lease is not None and rest.lease is not None
    # A bucket would have refilled a little by now; a window waits for the first entry to leave.
    assert one_more.lease is None and one_more.wait_s == pytest.approx(61.0, abs=0.2)
    assert (await budget.view()).tokens_reset_s == pytest.approx(61.0, abs=0.2)


async def test_window_entries_leave_after_the_window_and_settling_replaces_the_reservation(redis_client):
    budget = Budget(redis_client, "w", window(tpm=100, window_s=0.5))

    early = (await budget.reserve(60)).lease
    await budget.settle(early, used_tokens=30)  # the upstream charged less: 70 left
    await asyncio.sleep(0.2)
    late = await budget.reserve(70)
    blocked = await budget.reserve(10)
    await asyncio.sleep(0.35)  # the early entry has left, the late one has not
    after = await budget.view()

    assert late.lease is not None
    assert blocked.lease is None and blocked.wait_s == pytest.approx(0.3, abs=0.1)
    assert after.available_tokens == pytest.approx(30)
    assert (after.used_tokens_total, after.used_requests_total) == (30, 1)


async def test_a_window_call_answered_429_leaves_nothing_in_the_window(redis_client):
    budget = Budget(redis_client, "w", window(tpm=100, rpm=2))

    lease = (await budget.reserve(80)).lease
    await budget.settle(lease, used_tokens=0, used_request=False)
    view = await budget.view()

    assert (view.available_tokens, view.available_requests) == (100, 2)


async def test_a_lower_remaining_header_holds_the_difference_in_the_window_until_its_reset(redis_client):
    budget = Budget(redis_client, "w", window(tpm=100, rpm=10, window_s=60.0))

    lease = (await budget.reserve(10)).lease
    # The upstream counts 40 more than this window holds; its window resets in 0.3 s.
    left = await budget.settle(lease, used_tokens=10, remaining_tokens=50, reset_tokens_s=0.3, remaining_requests=9)
    blocked = await budget.reserve(60)
    await asyncio.sleep(0.35)
    after = await budget.view()

    assert left == pytest.approx(50)
    assert blocked.lease is None and blocked.wait_s == pytest.approx(0.3, abs=0.1)
    assert after.available_tokens == pytest.approx(90)  # the held difference is gone, the call stays
    assert after.available_requests == pytest.approx(9)


@pytest.mark.parametrize("model", ["bucket", "window"])
async def test_the_prompt_ratio_is_learned_from_usage_and_scales_the_next_reservations(redis_client, model):
    budget = Budget(redis_client, f"ratio-{model}", Limits(10**6, 10**4, 100, 30.0, model, prompt_margin=0.1))

    first = await budget.reserve(50, prompt_estimate=100)
    await budget.settle(first.lease, used_tokens=150, prompt_tokens=140)  # the upstream counts 1.4x
    second = await budget.reserve(50, prompt_estimate=100)
    await budget.settle(second.lease, used_tokens=170, prompt_tokens=120)  # then 1.2x
    third = await budget.reserve(50, prompt_estimate=100)
    view = await budget.view()

    assert first.lease.tokens == math.ceil(100 * 1.0 * 1.1) + 50  # nothing learned yet
    assert second.lease.tokens == math.ceil(100 * 1.4 * 1.1) + 50  # the first call counts in full
    assert third.lease.tokens == math.ceil(100 * 1.3 * 1.1) + 50  # then the running mean
    assert view.prompt_ratio == pytest.approx(1.3)


async def test_a_window_entry_is_restamped_when_its_request_goes_out(redis_client):
    budget = Budget(redis_client, "w", window(tpm=100, window_s=0.4))

    lease = (await budget.reserve(100)).lease
    await asyncio.sleep(0.3)  # the request waited after its reservation, before going out
    await budget.sent(lease)
    await asyncio.sleep(0.2)  # the reservation is 0.5 s old: out of a 0.4 s window, but not the request
    blocked = await budget.reserve(1)

    assert blocked.lease is None and blocked.wait_s == pytest.approx(0.2, abs=0.08)


async def test_a_paced_window_spreads_admissions_at_its_average_rate(redis_client):
    budget = Budget(redis_client, "w", window(tpm=6000, window_s=60.0, pace_s=1.0))  # 100 tokens a second

    burst = await budget.reserve(100)
    next_one = await budget.reserve(50)
    large = await budget.reserve(500)  # larger than the pacing bucket: waits for a full one only

    assert burst.lease is not None
    assert next_one.lease is None and next_one.wait_s == pytest.approx(0.5, abs=0.05)
    assert large.wait_s == pytest.approx(1.0, abs=0.05)
    await budget.settle(burst.lease, used_tokens=40)  # 60 not charged come back to the pacing too
    assert (await budget.reserve(50)).lease is not None
