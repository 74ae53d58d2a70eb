"""The learned prompt ratio cannot be poisoned: requests that hide billed prompt in tool
calls and schemas, or calls an upstream counts far off the estimate, leave it inside its
band, and a request refused as too large changes nothing the next request meets. On a real
Redis, with the proxy in front of a stand-in provider that bills every part of a request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time

import httpx
import pytest

from devtools.provider import LocalUpstreamConfig, serve_in_thread
from devtools.provider import create_app as local_upstream_app
from judge_proxy.app import create_app
from judge_proxy.budget import PROMPT_RATIO_BAND, Budget, Limits
from services.config import JudgeProxySettings
from services.queues import Keys
from tandem.redis_embed import free_port

LOW, HIGH = PROMPT_RATIO_BAND
HIDDEN = "word " * 3000
"""15,000 characters a provider bills: 3,000 tokens at the stand-in, 3,750 by chars/4."""
ORDINARY = "a judge prompt of ordinary size " * 60
"""1,920 characters: 480 tokens by chars/4."""


@pytest.fixture(scope="module")
def provider():
    with contextlib.ExitStack() as stack:
        config = LocalUpstreamConfig(tpm=6_000_000, rpm=60_000, service_ms=0, seed=1)
        yield stack.enter_context(serve_in_thread(local_upstream_app(config), free_port()))


@pytest.fixture
async def proxy(provider, redis_url, redis_client, tmp_path):
    """The proxy over the stand-in, as a bucket of 100,000 tokens a minute; waits for budget
    end after 5 s."""
    async with httpx.AsyncClient() as admin:
        (await admin.post(f"{provider}/admin/reset")).raise_for_status()
    upstream = {
        "name": "a",
        "model": "judge",
        "upstream_model": "local-model",
        "base_url": f"{provider}/v1",
        "tpm": 100_000,
        "rpm": 6000,
        "limit_model": "bucket",
    }
    (tmp_path / "upstreams.json").write_text(json.dumps({"upstreams": [upstream]}))
    app = create_app(
        JudgeProxySettings(redis_url=redis_url, upstreams=str(tmp_path / "upstreams.json"), queue_deadline_s=5.0)
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=30) as client:
        yield client
    await app.state.proxy.aclose()


def ordinary() -> dict:
    return {"model": "judge", "messages": [{"role": "user", "content": ORDINARY}], "max_tokens": 20}


def hiding(hidden: str = HIDDEN) -> dict:
    """A request whose content is two words; its prompt is in a tool call and a tool schema."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": hidden})}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": hidden, "parameters": {"type": "object"}}}]
    return {"model": "judge", "messages": messages, "tools": tools, "max_tokens": 5}


async def budget_of(proxy: httpx.AsyncClient) -> dict:
    return (await proxy.get("/v1/budget")).json()["upstreams"][0]


async def test_requests_hiding_their_prompt_in_tool_calls_leave_the_ratio_in_its_band_and_ordinary_ones_admitted(proxy):
    # Each bills about 6,000 prompt tokens. Counted from its content alone (17 tokens) they
    # taught a ratio of ~350, and an ordinary 480-token prompt then needed ~180,000 tokens,
    # more than the budget: every ordinary request was refused.
    attacks = [await proxy.post("/v1/chat/completions", json=hiding()) for _ in range(10)]
    ordinaries = [await proxy.post("/v1/chat/completions", json=ordinary()) for _ in range(5)]
    budget = await budget_of(proxy)

    assert [r.status_code for r in attacks] == [200] * 10
    assert [r.status_code for r in ordinaries] == [200] * 5
    counted = attacks[0].json()["usage"]["prompt_tokens"]
    assert counted > 6000  # the stand-in billed the hidden parts
    assert LOW <= budget["prompt_ratio"] <= HIGH
    assert budget["prompt_outliers"] == 0  # estimated in full, none of them is an outlier
    assert budget["prompt_ratio"] == pytest.approx(0.8, abs=0.05)  # words over chars/4 of "word "


async def test_a_request_larger_than_the_budget_is_refused_alone_and_changes_nothing_shared(
    proxy, provider, redis_client
):
    # 400,000 characters in a tool call and as many in a schema: ~200,000 tokens by chars/4,
    # twice the budget. Counted from its content alone, it went upstream.
    too_large = hiding("word " * 80_000)

    refused = await proxy.post("/v1/chat/completions", json=too_large)
    state = await redis_client.hgetall(Keys.judge_budget("a"))
    share = await redis_client.exists(Keys.judge_share("judge"), Keys.judge_share("judge") + ":asked")
    async with httpx.AsyncClient() as admin:
        sent = (await admin.get(f"{provider}/admin/stats")).json()["requests"]
    admitted = await proxy.post("/v1/chat/completions", json=ordinary())

    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "request_too_large"
    assert sent == 0  # the provider never saw it
    assert state == {} and share == 0  # no reservation, no lease, no share, nothing learned
    assert admitted.status_code == 200


async def test_a_request_over_the_limit_at_the_shared_ratio_is_refused_at_once_and_alone(proxy, redis_client):
    # Other replicas learned 4 (the band's top); this one last saw 1. At 1, a 25,000-token
    # prompt fits 100,000 a minute; at 4 it never does. It used to wait at the queue's head
    # until its deadline, and the requests behind it with it.
    await redis_client.hset(Keys.judge_budget("a"), mapping={"prompt_ratio": HIGH, "prompt_calls": 100})
    large = {**ordinary(), "messages": [{"role": "user", "content": "abcd" * 25_000}]}

    started = time.monotonic()
    refused, admitted = await asyncio.gather(
        proxy.post("/v1/chat/completions", json=large), proxy.post("/v1/chat/completions", json=ordinary())
    )
    elapsed_s = time.monotonic() - started
    budget = await budget_of(proxy)

    assert refused.status_code == 400 and refused.json()["error"]["code"] == "request_too_large"
    assert admitted.status_code == 200
    assert elapsed_s < 2.0
    assert budget["used_requests_total"] == 1


@pytest.mark.parametrize("model", ["bucket", "window"])
async def test_a_call_counted_outside_the_band_teaches_nothing_and_is_counted_as_an_outlier(redis_client, model):
    budget = Budget(redis_client, f"outlier-{model}", Limits(10**6, 10**4, 100, 30.0, model, prompt_margin=0.0))

    for counted in (10_000, 10):  # 100x, then a tenth of the estimate of 100
        lease = (await budget.reserve(50, prompt_estimate=100)).lease
        await budget.settle(lease, used_tokens=counted + 50, prompt_tokens=counted)
    after_outliers = await budget.reserve(50, prompt_estimate=100)
    await budget.settle(after_outliers.lease, used_tokens=200, prompt_tokens=150)  # 1.5x: in the band
    learned = await budget.reserve(50, prompt_estimate=100)
    view = await budget.view()

    assert after_outliers.lease.tokens == 100 + 50  # the ratio is still 1
    assert learned.lease.tokens == 150 + 50  # the first call in the band counts in full
    assert view.prompt_ratio == pytest.approx(1.5)
    assert view.prompt_outliers == 2


@pytest.mark.parametrize("model", ["bucket", "window"])
async def test_a_stored_ratio_outside_the_band_is_read_at_its_bound_and_learns_back(redis_client, model):
    budget = Budget(redis_client, f"stored-{model}", Limits(10**6, 10**4, 100, 30.0, model, prompt_margin=0.0))
    # A ratio poisoned before the band existed, after many calls (weight 0.05 now).
    await redis_client.hset(Keys.judge_budget(f"stored-{model}"), mapping={"prompt_ratio": 250, "prompt_calls": 100})

    first = await budget.reserve(50, prompt_estimate=100)
    before = await budget.view()
    await budget.settle(first.lease, used_tokens=150, prompt_tokens=100)  # the upstream counts 1x
    after = await budget.view()

    assert first.lease.tokens == 100 * HIGH + 50
    assert before.prompt_ratio == HIGH
    assert after.prompt_ratio == pytest.approx(HIGH + 0.05 * (1.0 - HIGH))


async def test_calls_at_the_bands_edge_move_the_ratio_no_further_than_the_edge(redis_client):
    budget = Budget(redis_client, "edge", Limits(10**6, 10**4, 100, 30.0, prompt_margin=0.0))

    for _ in range(30):
        lease = (await budget.reserve(0, prompt_estimate=100)).lease
        await budget.settle(lease, used_tokens=int(100 * HIGH), prompt_tokens=int(100 * HIGH))
    view = await budget.view()
    ordinary_cost = (await budget.reserve(20, prompt_estimate=480)).lease.tokens

    assert view.prompt_ratio == pytest.approx(HIGH)
    assert ordinary_cost == math.ceil(480 * HIGH) + 20
