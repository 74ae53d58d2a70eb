"""The judge budget cannot be poisoned. The learned prompt ratio: requests that hide billed
prompt in tool calls and schemas, or calls an upstream counts far off the estimate, leave it
inside its band, and a request refused as too large changes nothing the next request meets.
The provider's bill: a reply is charged at most what its request could cost, and no budget
owes more than one call. Nor is a provider trusted for the size or shape of its replies, a
client for the size of its request, or a job for the model groups it asks for. On a real
Redis, with the proxy in front of a stand-in provider that bills every part of a request
and misbehaves when scripted to."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest

from devtools.provider import LocalUpstreamConfig, serve_in_thread
from devtools.provider import create_app as local_upstream_app
from judge_proxy.app import create_app
from judge_proxy.budget import PROMPT_RATIO_BAND, Budget, Limits
from judge_proxy.replies import MAX_REPLY_DEPTH
from judge_proxy.upstream import estimate_prompt_tokens
from services.auth import job_credential
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


@contextlib.asynccontextmanager
async def proxy_over(provider: str, redis_url: str, tmp_path, limit_model: str = "bucket", **settings):
    """The proxy over the stand-in, its one upstream 100,000 tokens a minute in `limit_model`;
    waits for budget end after 5 s."""
    async with httpx.AsyncClient() as admin:
        (await admin.post(f"{provider}/admin/reset")).raise_for_status()
    upstream = {
        "name": "a",
        "model": "judge",
        "upstream_model": "local-model",
        "base_url": f"{provider}/v1",
        "tpm": 100_000,
        "rpm": 6000,
        "limit_model": limit_model,
    }
    (tmp_path / "upstreams.json").write_text(json.dumps({"upstreams": [upstream]}))
    app = create_app(
        JudgeProxySettings(
            redis_url=redis_url, upstreams=str(tmp_path / "upstreams.json"), queue_deadline_s=5.0, **settings
        )
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=60) as client:
        yield client
    await app.state.proxy.aclose()


@pytest.fixture
async def proxy(provider, redis_url, redis_client, tmp_path):
    """The proxy over the stand-in, as a bucket."""
    async with proxy_over(provider, redis_url, tmp_path) as client:
        yield client


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


# Providers are not trusted for their own bill, nor for the size and shape of their replies.

CAP_BYTES = 1 << 20
"""The reply cap of the tests below (the default is larger)."""


async def script(provider: str, *replies: dict) -> None:
    async with httpx.AsyncClient() as admin:
        (await admin.post(f"{provider}/admin/script", json={"replies": list(replies)})).raise_for_status()


async def stand_in_stats(provider: str) -> dict:
    async with httpx.AsyncClient() as admin:
        return (await admin.get(f"{provider}/admin/stats")).json()


def most_an_ordinary_call_costs() -> int:
    """Its prompt at the band's top (with the reservation's margin) and its 20 completion tokens."""
    return math.ceil(estimate_prompt_tokens(ordinary()["messages"]) * HIGH * 1.05) + 20


@pytest.mark.parametrize("limit_model", ["bucket", "window"])
async def test_a_reply_claiming_1e15_tokens_is_charged_at_most_what_its_request_could_cost_and_other_jobs_go_on(
    provider, redis_url, redis_client, tmp_path, limit_model
):
    # Charged as reported, it left the budget (and, in a window, its pacing bucket) at -1e15:
    # every job's calls waited for budget until their deadline, for good.
    async with proxy_over(provider, redis_url, tmp_path, limit_model) as proxy:
        before = await budget_of(proxy)
        await script(provider, {"usage": {"total_tokens": 10**15}})
        lying = await proxy.post("/v1/chat/completions", json=ordinary(), headers={"x-tandem-job": "liar"})
        after = await budget_of(proxy)
        others = [
            await proxy.post("/v1/chat/completions", json=ordinary(), headers={"x-tandem-job": "other"})
            for _ in range(3)
        ]

    assert lying.status_code == 200
    assert 0 < before["available_tokens"] - after["available_tokens"] <= most_an_ordinary_call_costs()
    assert after["used_tokens_total"] <= most_an_ordinary_call_costs()
    assert after["usage_outliers"] == 1
    if limit_model == "window":
        assert 0 < before["pace_tokens"] - after["pace_tokens"] <= most_an_ordinary_call_costs()
    assert [r.status_code for r in others] == [200] * 3


@pytest.mark.parametrize("reported", [-5, "lots", 1e15, None])
async def test_usage_that_is_negative_or_not_an_integer_is_charged_as_the_reservation(proxy, provider, reported):
    await script(provider, {"usage": {"total_tokens": reported}})
    reply = await proxy.post("/v1/chat/completions", json=ordinary())
    budget = await budget_of(proxy)
    reserved = math.ceil(estimate_prompt_tokens(ordinary()["messages"]) * 1.05) + 20  # at the ratio of 1

    assert reply.status_code == 200
    assert budget["used_tokens_total"] == reserved
    assert budget["usage_outliers"] == 0


@pytest.mark.parametrize("limit_model", ["bucket", "window"])
async def test_a_budget_never_owes_more_than_one_call_can_take(redis_client, limit_model):
    # The floor holds even for a charge or an `x-ratelimit-remaining` no bound caught, and
    # for a state an older replica left deep below it: the budget owes at most `tpm` (no
    # call costs more), so it is whole again within two minutes.
    tpm = 60_000
    budget = Budget(redis_client, f"floor-{limit_model}", Limits(tpm, 600, 10, 30.0, limit_model))
    lease = (await budget.reserve(100)).lease
    await budget.settle(lease, 10**15, remaining_tokens=-1e15)
    charged = await budget.view()
    await redis_client.hset(Keys.judge_budget(f"floor-{limit_model}"), mapping={"tokens": -1e15, "pace_tokens": -1e15})
    poisoned = await budget.view()

    for view in (charged, poisoned):
        assert view.available_tokens >= -tpm - 1
        assert view.pace_tokens is None or view.pace_tokens >= -tpm - 1


def socket_buffers_bytes() -> int:
    """The most a loopback connection holds in flight: the sender's and the receiver's largest
    socket buffers (Linux's autotuning limits), and 1 MiB for what uvicorn and aiohttp buffer."""
    sizes = [int(Path(f"/proc/sys/net/ipv4/tcp_{kind}").read_text().split()[2]) for kind in ("wmem", "rmem")]
    return sum(sizes) + (1 << 20)


async def test_a_reply_over_the_size_cap_is_a_502_naming_it_and_no_more_of_it_is_read(provider, redis_url, tmp_path):
    # Read whole, 64 MB relayed cost the proxy 193 MB. Now it holds at most the cap, and a
    # copy of it joined: 2 MiB, with aiohttp's buffer (128 KiB) and the rest of the call well
    # under 2 MiB more. The stand-in writes no more than the cap and what the sockets hold.
    size = 2 * (CAP_BYTES + socket_buffers_bytes())
    async with proxy_over(provider, redis_url, tmp_path, max_reply_bytes=CAP_BYTES) as proxy:
        await script(provider, {"padding_bytes": size})
        tracemalloc.start()
        try:
            start, _ = tracemalloc.get_traced_memory()
            reply = await proxy.post("/v1/chat/completions", json=ordinary())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        await asyncio.sleep(0.5)  # the stand-in notices the closed connection
        sent = (await stand_in_stats(provider))["padded_bytes_sent"]

    assert reply.status_code == 502
    assert f"over {CAP_BYTES} bytes" in reply.json()["error"]["message"]
    assert peak - start < 2 * CAP_BYTES + (2 << 20)
    assert sent <= CAP_BYTES + socket_buffers_bytes()


async def test_a_streamed_event_over_the_size_cap_ends_the_stream_with_an_error_naming_it(
    provider, redis_url, tmp_path
):
    async with proxy_over(provider, redis_url, tmp_path, max_reply_bytes=CAP_BYTES) as proxy:
        await script(provider, {"padding_bytes": 4 * CAP_BYTES})
        reply = await proxy.post("/v1/chat/completions", json={**ordinary(), "stream": True})
        budget = await budget_of(proxy)

    assert reply.status_code == 200  # the headers went before the event
    assert f"over {CAP_BYTES} bytes" in reply.text.splitlines()[-2]
    assert "[DONE]" not in reply.text
    assert budget["inflight"] == 0  # settled


async def test_a_reply_nested_deeper_than_the_cap_is_a_502_naming_it(proxy, provider):
    # msgspec gave up at Python's recursion limit, and the proxy answered 500.
    await script(provider, {"nesting": 100_000})
    reply = await proxy.post("/v1/chat/completions", json=ordinary())

    assert reply.status_code == 502
    assert f"nested deeper than {MAX_REPLY_DEPTH}" in reply.json()["error"]["message"]


async def test_a_streamed_event_nested_deeper_than_the_cap_ends_the_stream_with_an_error_naming_it(proxy, provider):
    await script(provider, {"nesting": 5000})
    reply = await proxy.post("/v1/chat/completions", json={**ordinary(), "stream": True})

    assert reply.status_code == 200
    assert f"nested deeper than {MAX_REPLY_DEPTH}" in reply.text.splitlines()[-2]


async def test_a_reply_nested_as_deep_as_the_cap_passes(proxy, provider):
    await script(provider, {"nesting": MAX_REPLY_DEPTH - 1})  # inside the reply's own object
    reply = await proxy.post("/v1/chat/completions", json=ordinary())

    assert reply.status_code == 200
    assert reply.json()["nested"] is not None


async def test_a_request_over_the_body_limit_is_a_413_read_no_further(provider, redis_url, tmp_path):
    big = {**ordinary(), "messages": [{"role": "user", "content": "x" * 8192}]}

    async def chunked():  # no content-length: the limit counts what arrives
        yield json.dumps(big).encode()

    async with proxy_over(provider, redis_url, tmp_path, max_request_bytes=4096) as proxy:
        declared = await proxy.post("/v1/chat/completions", json=big)
        streamed = await proxy.post("/v1/chat/completions", content=chunked())
        judged = await proxy.post("/v1/judge", json={"rubric": "helpfulness", "messages": big["messages"]})
        small = await proxy.post("/v1/chat/completions", json=ordinary())

    assert [declared.status_code, streamed.status_code, judged.status_code] == [413] * 3
    assert declared.json()["error"]["code"] == "request_too_large"
    assert "over 4096 bytes" in declared.json()["error"]["message"]
    assert small.status_code == 200
    assert (await stand_in_stats(provider))["requests"] == 1


async def test_a_request_nested_too_deep_is_a_400(proxy):
    reply = await proxy.post("/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000)

    assert reply.status_code == 400


async def test_the_budget_shows_the_pacing_bucket(provider, redis_url, tmp_path):
    async with proxy_over(provider, redis_url, tmp_path, "window") as proxy:
        fresh = await budget_of(proxy)
        await proxy.post("/v1/chat/completions", json=ordinary())
        after = await budget_of(proxy)

    assert fresh["pace_tokens"] == pytest.approx(100_000 * 6 / 60)  # pace_s's worth at tpm / 60
    assert fresh["pace_requests"] == pytest.approx(6000 * 6 / 60)
    assert after["pace_tokens"] < fresh["pace_tokens"]


async def test_a_job_may_use_only_the_model_groups_the_operator_lets_jobs_use(provider, redis_url, tmp_path):
    # Unrestricted, a job's credential could spend any group's budget (an evaluation model's,
    # say) by naming it as its judge_model or user_model.
    as_job = {"authorization": f"Bearer {job_credential('secret', 'job-1')}"}
    as_operator = {"authorization": "Bearer secret"}
    settings = {"client_tokens": "secret", "job_models": "user-simulator"}
    async with proxy_over(provider, redis_url, tmp_path, **settings) as proxy:
        chat = await proxy.post("/v1/chat/completions", json=ordinary(), headers=as_job)
        judged = await proxy.post(
            "/v1/judge", json={"rubric": "interactivity", "messages": ordinary()["messages"]}, headers=as_job
        )
        operator = await proxy.post("/v1/chat/completions", json=ordinary(), headers=as_operator)

    assert [chat.status_code, judged.status_code] == [403, 403]
    assert chat.json()["error"]["param"] == "model"
    assert "'judge'" in chat.json()["error"]["message"]
    assert operator.status_code == 200
