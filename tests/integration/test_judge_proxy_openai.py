"""The judge proxy as a client that nobody here wrote sees it: the official `openai` SDK
(sync and async) against the proxy served by uvicorn on loopback, in front of a local
upstream, with a real Redis. Streaming, the model list, the rate-limit headers, the error
shape and request ids."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import openai
import pytest
from prometheus_client import REGISTRY

from devtools.provider import LocalUpstreamConfig, serve_in_thread
from devtools.provider import create_app as local_upstream_app
from judge_proxy.app import create_app
from services.config import JudgeProxySettings
from services.logs import RequestIdFilter
from tandem.redis_embed import free_port

TOKEN = "proxy-token-0123456789"
TPM, RPM = 600_000, 6000


@pytest.fixture(scope="module")
def upstream_url():
    config = LocalUpstreamConfig(tpm=6_000_000, rpm=60_000, service_ms=0, seed=2)
    with serve_in_thread(local_upstream_app(config), free_port()) as url:
        yield url


@pytest.fixture
def proxy_url(redis_url, upstream_url, tmp_path):
    """A fresh proxy (and a flushed budget) per test, served over real HTTP."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    httpx.post(f"{upstream_url}/admin/reset").raise_for_status()
    path = tmp_path / "upstreams.json"
    path.write_text(
        json.dumps(
            {
                "upstreams": [
                    {
                        "name": "a",
                        "model": "judge",
                        "upstream_model": "local-model",
                        "base_url": f"{upstream_url}/v1",
                        "tpm": TPM,
                        "rpm": RPM,
                    },
                ]
            }
        )
    )
    settings = JudgeProxySettings(redis_url=redis_url, upstreams=str(path), client_tokens=TOKEN)
    with serve_in_thread(create_app(settings), free_port()) as url:
        yield url


def script(upstream_url: str, *replies: dict) -> None:
    httpx.post(f"{upstream_url}/admin/script", json={"replies": list(replies)}).raise_for_status()


def budget(proxy_url: str) -> dict:
    response = httpx.get(f"{proxy_url}/v1/budget", headers={"authorization": f"Bearer {TOKEN}"})
    return response.json()["upstreams"][0]


def settled(proxy_url: str, timeout_s: float = 5.0) -> dict:
    """The budget once no call is in flight (a stream settles just after its last event)."""
    deadline = time.monotonic() + timeout_s
    while (view := budget(proxy_url))["inflight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return view


def streams(outcome: str) -> float:
    return REGISTRY.get_sample_value("tandem_judge_streams_total", {"upstream": "a", "outcome": outcome}) or 0.0


MESSAGES = [{"role": "user", "content": "Rate this reply."}]


def test_sync_client_plain_call_sees_usage_models_and_the_shared_budget_headers(proxy_url, upstream_url):
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key=TOKEN, max_retries=0)
    script(upstream_url, {"content": "a fine reply"})

    raw = client.chat.completions.with_raw_response.create(model="judge", messages=MESSAGES, max_tokens=16)
    completion = raw.parse()
    listed = [m.id for m in client.models.list()]
    retrieved = client.models.retrieve("judge")

    assert completion.choices[0].message.content == "a fine reply"
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 3
    assert listed == ["judge"] and retrieved.id == "judge"
    headers = raw.headers
    assert headers["x-ratelimit-limit-tokens"] == str(TPM)
    assert headers["x-ratelimit-limit-requests"] == str(RPM)
    # Read after this call was admitted: its reservation (prompt + 16) is out of the window.
    assert int(headers["x-ratelimit-remaining-tokens"]) <= TPM - 16
    assert int(headers["x-ratelimit-remaining-requests"]) == RPM - 1
    assert headers["x-ratelimit-reset-tokens"].endswith("s")  # the window empties in about a minute
    assert headers["x-request-id"].startswith("req_")


def test_sync_client_streams_the_reply_as_it_comes_and_the_budget_settles_on_its_usage(proxy_url, upstream_url):
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key=TOKEN, max_retries=0)
    script(upstream_url, {"content": "one two three four"})
    complete_before = streams("complete")

    chunks = list(client.chat.completions.create(model="judge", messages=MESSAGES, max_tokens=16, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    view = settled(proxy_url)
    asked = httpx.get(f"{upstream_url}/admin/requests").json()[-1]

    assert text == "one two three four"
    # The proxy asked for usage to settle with, and kept the usage chunk from this client.
    assert asked["stream_options"] == {"include_usage": True}
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    stats = httpx.get(f"{upstream_url}/admin/stats").json()
    assert view["used_tokens_total"] == stats["tokens_accepted"] == stats["prompt_tokens"] + 4
    assert view["available_tokens"] == TPM - stats["tokens_accepted"]
    assert streams("complete") - complete_before == 1


async def test_async_client_streams_with_usage_when_it_asks(proxy_url, upstream_url):
    client = openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key=TOKEN, max_retries=0)
    script(upstream_url, {"content": "alpha beta"})

    stream = await client.chat.completions.create(
        model="judge", messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    await client.close()

    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert settled(proxy_url)["used_tokens_total"] == chunks[-1].usage.total_tokens


async def test_async_client_plain_calls_run_concurrently_through_one_budget(proxy_url):
    client = openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key=TOKEN, max_retries=0)

    replies = await asyncio.gather(
        *(client.chat.completions.create(model="judge", messages=MESSAGES, max_tokens=8, n=2) for _ in range(8))
    )
    await client.close()

    assert all(len(r.choices) == 2 for r in replies)
    assert settled(proxy_url)["used_tokens_total"] == sum(r.usage.total_tokens for r in replies)


def test_a_stream_the_upstream_cuts_off_raises_in_the_client_and_settles_all_it_reserved(proxy_url, upstream_url):
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key=TOKEN, max_retries=0)
    script(upstream_url, {"content": "one two three four five six", "cut_after": 2})
    cut_before = streams("cut")
    received = []

    with pytest.raises(openai.APIError, match="cut off"):
        for chunk in client.chat.completions.create(model="judge", messages=MESSAGES, max_tokens=50, stream=True):
            received.append(chunk.choices[0].delta.content or "")
    view = settled(proxy_url)

    assert "".join(received) == "one two"
    assert streams("cut") - cut_before == 1
    assert view["inflight"] == 0
    # Nothing came back to count with: the whole reservation (prompt estimate + 50) stays charged.
    assert view["used_tokens_total"] >= 50 and view["available_tokens"] == TPM - view["used_tokens_total"]


async def test_a_client_leaving_a_stream_midway_settles_it_and_is_counted(proxy_url, upstream_url):
    client = openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key=TOKEN, max_retries=0)
    script(upstream_url, {"content": " ".join(["word"] * 40), "token_delay_s": 0.05})  # 2 s in all
    left_before = streams("client_closed")

    stream = await client.chat.completions.create(model="judge", messages=MESSAGES, max_tokens=64, stream=True)
    async for _ in stream:
        break
    await stream.close()
    await client.close()
    view = await asyncio.to_thread(settled, proxy_url)

    assert view["inflight"] == 0
    assert streams("client_closed") - left_before == 1
    assert view["used_tokens_total"] >= 64  # no usage came: the whole reservation stays charged


def test_errors_keep_openais_shape_and_the_sdk_maps_them(proxy_url):
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key=TOKEN, max_retries=0)
    stranger = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="not-the-token", max_retries=0)

    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model="judge", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="judge", messages=MESSAGES, max_tokens=0)
    no_route = httpx.get(f"{proxy_url}/v1/embeddings")

    assert unknown.value.body["code"] == "model_not_found"
    assert set(bad.value.body) == {"message", "type", "param", "code"} and bad.value.body["param"] == "max_tokens"
    assert no_route.status_code in (404, 405)
    assert set(no_route.json()["error"]) == {"message", "type", "param", "code"}
    assert no_route.headers["x-request-id"].startswith("req_")


def test_a_request_id_sent_by_the_client_comes_back_and_marks_the_log_lines(proxy_url, upstream_url, caplog):
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key=TOKEN, max_retries=0)
    script(upstream_url, {"status": 500}, {"content": "after a retry"})  # one upstream: the retry is the 502
    caplog.handler.addFilter(RequestIdFilter())

    with caplog.at_level(logging.WARNING, logger="judge_proxy"), pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model="judge", messages=MESSAGES, extra_headers={"x-request-id": "job7-turn3"})
    weird = httpx.get(
        f"{proxy_url}/v1/models", headers={"authorization": f"Bearer {TOKEN}", "x-request-id": "bad id\twith spaces"}
    )

    assert failed.value.response.headers["x-request-id"] == "job7-turn3"
    assert any(r.request == " [request job7-turn3]" and "upstream a failed" in r.getMessage() for r in caplog.records)
    assert weird.headers["x-request-id"].startswith("req_")  # not echoed: not a sane id
