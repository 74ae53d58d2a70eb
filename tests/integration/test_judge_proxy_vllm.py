"""vLLM's own OpenAI-compatible server (`tandem serve-model` on the tiny model) behind the judge
proxy, driven by the official `openai` SDK: what the proxy charges the shared budget is what
vLLM counted, by vLLM's replies and by vLLM's own metrics, streamed or not."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from helpers import served_model, vllm_counted

from devtools.provider import serve_in_thread
from judge_proxy.app import create_app
from judge_proxy.upstream import estimate_prompt_tokens
from services.config import JudgeProxySettings
from tandem.redis_embed import free_port


@pytest.fixture(scope="module")
def vllm_url(tiny_model, tmp_path_factory):
    """`tandem serve-model` (vLLM's OpenAI API server) on the tiny model, on loopback; stopped
    after this module."""
    with served_model(
        tiny_model, "tiny", tmp_path_factory.mktemp("vllm-server") / "server.log", max_model_len=512
    ) as url:
        yield url


@pytest.fixture
def proxy_url(redis_url, vllm_url, tmp_path):
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    path = tmp_path / "upstreams.json"
    path.write_text(
        json.dumps(
            {
                "upstreams": [
                    {
                        "name": "vllm",
                        "model": "judge",
                        "upstream_model": "tiny",
                        "base_url": f"{vllm_url}/v1",
                        "tpm": 1_000_000,
                        "rpm": 10_000,
                        "prompt_margin": 0.0,
                    },
                ]
            }
        )
    )
    with serve_in_thread(create_app(JudgeProxySettings(redis_url=redis_url, upstreams=str(path))), free_port()) as url:
        yield url


def budget(proxy_url: str) -> dict:
    deadline = time.monotonic() + 5
    while (view := httpx.get(f"{proxy_url}/v1/budget").json()["upstreams"][0])["inflight"]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return view


MESSAGES = [
    {"role": "system", "content": "You judge replies."},
    {"role": "user", "content": "Is the reply helpful? Answer briefly."},
]


def test_usage_charged_to_the_budget_is_what_vllm_counted(proxy_url, vllm_url):
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0)
    counted_before = vllm_counted(vllm_url)

    plain = client.chat.completions.create(model="judge", messages=MESSAGES, max_tokens=12, temperature=0.0)
    several = client.chat.completions.create(
        model="judge", messages=MESSAGES, max_tokens=6, n=2, logprobs=True, top_logprobs=2, seed=3
    )
    chunks = list(client.chat.completions.create(model="judge", messages=MESSAGES, max_tokens=10, stream=True))
    view = budget(proxy_url)
    counted = vllm_counted(vllm_url) - counted_before

    streamed = sum(len(c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert streamed > 0 and all(c.usage is None for c in chunks)  # the usage chunk was the proxy's
    assert len(several.choices) == 2 and several.choices[0].logprobs.content
    replied = plain.usage.total_tokens + several.usage.total_tokens
    # The stream's usage never reached this client; vLLM's metrics and the budget both have it.
    # vLLM's engine runs the n=2 request as two sequences and counts its prompt twice; its
    # `usage` (what a provider bills) counts it once, and so does the budget.
    assert view["used_tokens_total"] == counted - several.usage.prompt_tokens
    assert view["used_tokens_total"] > replied  # the stream's share
    assert view["used_requests_total"] == 3
    # vLLM counts the chat template's tokens; the learned ratio says by how much chars/4 was off.
    estimate = estimate_prompt_tokens(MESSAGES)
    assert view["prompt_ratio"] == pytest.approx(plain.usage.prompt_tokens / estimate, rel=1e-4)


def test_the_proxy_lists_its_model_and_passes_vllms_client_errors_through(proxy_url):
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0)

    listed = [m.id for m in client.models.list()]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model="judge", messages=[{"role": "user", "content": "word " * 2000}], max_tokens=8
        )

    assert listed == ["judge"]
    assert too_long.value.status_code == 400 and "context length" in too_long.value.message


def test_seeded_requests_whose_prompts_overflow_a_step_all_complete(vllm_url):
    """The judge proxy seeds every call. Ten concurrent seeded 450-token prompts overflow
    one engine step's token budget: with chunked prefill a prompt is split across steps and
    vLLM's CPU engine dies winding back the seeded generator ("CPU Generator does not use
    offset"); `tandem serve-model` prefills whole prompts, so every request completes."""
    import concurrent.futures

    def complete(seed: int) -> int:
        reply = httpx.post(
            f"{vllm_url}/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": [5 + seed] * 450, "max_tokens": 8, "temperature": 1.0, "seed": seed},
        )
        return reply.status_code

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        assert list(pool.map(complete, range(10))) == [200] * 10
    assert httpx.get(f"{vllm_url}/health", timeout=5).status_code == 200
