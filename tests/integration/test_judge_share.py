"""Jobs' weighted shares of a judge model group's budget (`judge_proxy/share.py`): the share
arithmetic on a real Redis with hand-computed numbers, the weight lookup, then two proxy
replicas (uvicorn threads on loopback, one Redis) saturated by two jobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from devtools.provider import LocalUpstreamConfig, serve_in_thread
from devtools.provider import create_app as local_upstream_app
from judge_proxy.app import create_app
from judge_proxy.share import Share, Weights, burst_tokens
from judge_proxy.upstream import UpstreamConfig
from services.config import (
    JudgeProxySettings,
    ModelSpec,
    RLJob,
)
from services.jobs import create_job
from services.queues import Keys
from tandem.redis_embed import free_port


def test_the_group_capacity_is_a_buckets_tpm_or_a_paced_windows_pace_worth():
    def upstream(**limits) -> UpstreamConfig:
        return UpstreamConfig(name="a", model="judge", base_url="http://upstream/v1", tpm=60_000, rpm=600, **limits)

    assert burst_tokens(upstream(limit_model="bucket")) == 60_000
    assert burst_tokens(upstream(limit_model="window", pace_s=6.0)) == 6_000  # 6 s at 1000 a second
    assert burst_tokens(upstream(limit_model="window", pace_s=0.0)) == 60_000  # unpaced: the whole window


def share(redis_client, capacity_tokens: float, tokens_per_s: float, active_s: float = 5.0) -> Share:
    made = Share(redis_client, "judge", active_s=active_s)
    made.capacity_tokens, made.tokens_per_s = capacity_tokens, tokens_per_s
    return made


# --- the arithmetic: capacity 600, refilled at 1 token a second (negligible while a test runs) ---


async def test_shares_split_the_capacity_by_weight_and_lend_only_above_half(redis_client):
    shares = share(redis_client, 600, 1.0)

    alone = await shares.reserve("a", 2.0, 100)  # a alone: the whole 600 is its bucket
    joined = await shares.reserve("b", 1.0, 150)  # b joins at the group's fill, 500/600
    borrowing = await shares.reserve("b", 1.0, 100)  # 16.7 of its own, 83.3 of a's 133.3 above half
    b_refused = await shares.reserve("b", 1.0, 100)  # a (250 of 400) lends only its 50 above half
    a_refused = await shares.reserve("a", 2.0, 300)  # 250 of its own; b has nothing above half
    too_large = await shares.reserve("a", 2.0, 450)  # more than a's 400: waits for a full bucket
    refunded = await shares.refund("b", 100)  # b's reservation cost 100 less than it held
    a_spends = await shares.reserve("a", 2.0, 250)
    newcomer = await shares.reserve("c", 3.0, 1)  # the group has 100 of 600 left: c starts at 1/6 of 300

    assert (alone.admitted, alone.share, alone.tokens) == (True, 1.0, pytest.approx(500, abs=0.5))
    assert (joined.admitted, joined.share) == (True, pytest.approx(1 / 3))
    assert joined.tokens == pytest.approx(500 / 600 * 200 - 150, abs=0.5)
    assert (borrowing.admitted, borrowing.tokens) == (True, pytest.approx(0, abs=0.5))
    assert borrowing.borrowed == pytest.approx(100 - 16.67, abs=0.5)
    # Waits: what is short over the refill of the job and of lenders not yet full (weights
    # over 3 of 1 token a second): b 50 / (3/3), a 50 / (2/3), a 150 / (2/3).
    assert (b_refused.admitted, b_refused.tokens, b_refused.wait_s) == (
        False,
        pytest.approx(0, abs=0.5),
        pytest.approx(50, abs=1),
    )
    assert (a_refused.admitted, a_refused.share, a_refused.wait_s) == (
        False,
        pytest.approx(2 / 3),
        pytest.approx(75, abs=1),
    )
    assert (too_large.admitted, too_large.wait_s) == (False, pytest.approx(225, abs=1))
    assert refunded == pytest.approx(100, abs=0.5)
    assert (a_spends.admitted, a_spends.tokens, a_spends.borrowed) == (True, pytest.approx(0, abs=0.5), 0)
    assert (newcomer.share, newcomer.tokens) == (0.5, pytest.approx(100 / 600 * 300 - 1, abs=0.5))


async def test_a_bucket_refills_at_its_rate_up_to_its_capacity(redis_client):
    shares = share(redis_client, 60, 60.0)  # a full bucket's worth a second

    emptied = await shares.reserve("a", 1.0, 60)
    short = await shares.reserve("a", 1.0, 30)
    await asyncio.sleep(short.wait_s)
    refilled = await shares.reserve("a", 1.0, 30)
    await asyncio.sleep(2.0)  # 120 tokens' worth of refill; the bucket holds 60
    whole = await shares.reserve("a", 1.0, 60)
    after = await shares.reserve("a", 1.0, 30)

    assert emptied.admitted and not short.admitted and short.wait_s == pytest.approx(0.5, abs=0.05)
    assert refilled.admitted
    assert whole.admitted and whole.tokens == pytest.approx(0, abs=3)
    assert not after.admitted and after.wait_s == pytest.approx(0.5, abs=0.05)


async def test_a_request_larger_than_its_bucket_waits_for_a_full_bucket_and_leaves_a_debt(redis_client):
    shares = share(redis_client, 600, 1.0)

    await shares.reserve("a", 1.0, 0)
    await shares.reserve("b", 1.0, 200)  # b: 100 of 300 left, nothing to lend
    large = await shares.reserve("a", 1.0, 400)  # a's bucket is full (300)
    next_one = await shares.reserve("a", 1.0, 10)

    assert (large.admitted, large.tokens) == (True, pytest.approx(-100, abs=0.5))
    assert not next_one.admitted and next_one.wait_s == pytest.approx(110 / 0.5, abs=1)


async def test_a_job_that_stops_asking_leaves_the_others_its_share(redis_client):
    shares = share(redis_client, 600, 1.0, active_s=0.5)

    first = [await shares.reserve("a", 2.0, 1), await shares.reserve("b", 1.0, 1)]
    await asyncio.sleep(0.3)
    a_still_counts = await shares.reserve("b", 1.0, 1)
    await asyncio.sleep(0.3)  # a last asked 0.6 s ago
    alone = await shares.reserve("b", 1.0, 1)

    assert [h.share for h in first] == [1.0, pytest.approx(1 / 3)]
    assert a_still_counts.share == pytest.approx(1 / 3)
    # b keeps its fill (197.7 of 200 after two requests) in a bucket now of the whole 600
    assert alone.share == 1.0 and alone.tokens == pytest.approx((599 / 600 * 200 - 2) / 200 * 600 - 1, abs=1)


async def test_a_jobs_weight_is_read_from_its_record_and_kept_for_a_while(redis_client):
    weights = Weights(redis_client, ttl_s=0.3)
    job = await job_with_weight(redis_client, "heavy", 2.0)

    read = [(await weights.terms(name)).weight for name in (job, "not-a-job", "")]
    await redis_client.hset(
        Keys.job(job), "spec", RLJob(model=ModelSpec(path="unused"), judge_weight=5.0).model_dump_json()
    )
    kept = (await weights.terms(job)).weight
    await asyncio.sleep(0.3)

    assert read == [2.0, 1.0, 1.0] and kept == 2.0
    assert (await weights.terms(job)).weight == 5.0


# --- two replicas, two jobs, a saturated budget ---------------------------------------------

TPM = 30_000
TOKENS_PER_S = TPM / 60
PROMPT = [{"role": "user", "content": "Score this reply from 0 to 10 and say why, briefly."}]


@contextlib.contextmanager
def two_replicas(redis_url: str, tmp_path):
    """A generous local upstream behind two proxy replicas whose budget (a bucket of `TPM`) binds."""
    upstream = local_upstream_app(LocalUpstreamConfig(tpm=6_000_000, rpm=600_000, service_ms=2))
    with contextlib.ExitStack() as stack:
        upstream_url = stack.enter_context(serve_in_thread(upstream, free_port()))
        path = tmp_path / "upstreams.json"
        path.write_text(
            json.dumps(
                {
                    "upstreams": [
                        {
                            "name": "local",
                            "model": "judge",
                            "upstream_model": "local-model",
                            "base_url": f"{upstream_url}/v1",
                            "tpm": TPM,
                            "rpm": 60_000,
                            "max_concurrency": 32,
                            "limit_model": "bucket",
                        }
                    ]
                }
            )
        )
        settings = JudgeProxySettings(redis_url=redis_url, upstreams=str(path), queue_deadline_s=30.0)
        yield [stack.enter_context(serve_in_thread(create_app(settings), free_port())) for _ in range(2)]


async def job_with_weight(redis_client, name: str, judge_weight: float) -> str:
    return await create_job(redis_client, RLJob(name=name, model=ModelSpec(path="unused"), judge_weight=judge_weight))


class Charges(list):
    """(seconds since the start, job, usage.total_tokens, seconds the request took) of every reply."""

    def __init__(self) -> None:
        super().__init__()
        self.started = time.monotonic()

    def tokens(self, job: str, since_s: float) -> int:
        return sum(tokens for at, j, tokens, _ in self if j == job and at >= since_s)


async def send(
    http: httpx.AsyncClient, url: str, job: str, charges: Charges, max_tokens: int = 150, every_s: float = 0.0
) -> None:
    """Requests of `job` one after another (at most one per `every_s`) until cancelled."""
    while True:
        sent = time.monotonic()
        response = await http.post(
            f"{url}/v1/chat/completions",
            headers={"x-tandem-job": job},
            json={"model": "judge", "messages": PROMPT, "max_tokens": max_tokens},
        )
        if response.status_code == 200:
            charges.append(
                (
                    time.monotonic() - charges.started,
                    job,
                    response.json()["usage"]["total_tokens"],
                    time.monotonic() - sent,
                )
            )
        await asyncio.sleep(max(0.0, every_s - (time.monotonic() - sent)))


async def run_for(seconds: float, senders: list) -> None:
    tasks = [asyncio.create_task(s) for s in senders]
    await asyncio.sleep(seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.slow
async def test_two_jobs_weighted_two_to_one_get_two_thirds_and_one_third_across_replicas(
    redis_url, redis_client, tmp_path
):
    """Both jobs send 8 requests at a time through each replica for 60 s. The bucket starts
    with a minute's worth (30k tokens) that the first seconds spend in a race, so shares are
    measured on the tokens charged from 10 s on, when only the refill (500 a second) is left.
    Counted in tokens, so a slow machine changes the totals, not the shares."""
    heavy, light = await job_with_weight(redis_client, "heavy", 2.0), await job_with_weight(redis_client, "light", 1.0)
    charges = Charges()
    with two_replicas(redis_url, tmp_path) as replicas:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            await run_for(
                60.0, [send(http, url, job, charges) for url in replicas for job in (heavy, light) for _ in range(8)]
            )

    heavy_tokens, light_tokens = charges.tokens(heavy, 10.0), charges.tokens(light, 10.0)
    total = heavy_tokens + light_tokens
    print(f"from 10 s on: heavy {heavy_tokens}, light {light_tokens} tokens; heavy's share {heavy_tokens / total:.3f}")
    assert heavy_tokens / total == pytest.approx(2 / 3, rel=0.1)
    assert light_tokens / total == pytest.approx(1 / 3, rel=0.1)
    assert total >= 0.85 * TOKENS_PER_S * 50  # the budget was used, not only split


@pytest.mark.slow
async def test_a_job_alone_with_one_that_asks_little_uses_the_budget_and_the_other_is_served(
    redis_url, redis_client, tmp_path
):
    """`busy` (weight 1) sends 8 requests at a time through each replica for 40 s; `quiet`
    (weight 2, two thirds of the budget if it wanted them) sends one small request every 2 s.
    From 10 s on (after the first minute's worth of tokens is spent), `busy` gets at least
    90% of the budget's refill: what `quiet` leaves it borrows, though never `quiet`'s last half."""
    busy, quiet = await job_with_weight(redis_client, "busy", 1.0), await job_with_weight(redis_client, "quiet", 2.0)
    charges = Charges()
    with two_replicas(redis_url, tmp_path) as replicas:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            await run_for(
                40.0,
                [send(http, url, busy, charges) for url in replicas for _ in range(8)]
                + [send(http, replicas[0], quiet, charges, max_tokens=20, every_s=2.0)],
            )

    busy_tokens, quiet_tokens = charges.tokens(busy, 10.0), charges.tokens(quiet, 10.0)
    quiet_took_s = [took_s for _, job, _, took_s in charges if job == quiet]
    print(
        f"from 10 s on: busy {busy_tokens}, quiet {quiet_tokens} tokens of {TOKENS_PER_S * 30:.0f}; "
        f"quiet's {len(quiet_took_s)} requests took at most {max(quiet_took_s):.3f} s"
    )
    assert busy_tokens >= 0.9 * TOKENS_PER_S * 30
    assert len(quiet_took_s) >= 19 and max(quiet_took_s) < 1.0  # busy's backlog never holds quiet up
