"""The judge proxy as a real HTTP service: two replicas racing for one upstream's budget,
the client rollout uses, and the process the CLI starts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from devtools.provider import LocalUpstreamConfig, serve_in_thread
from devtools.provider import create_app as local_upstream_app
from judge_proxy.app import create_app
from services.config import JudgeProxySettings
from services.judge_client import JudgeClient, JudgeError
from tandem.redis_embed import free_port

PROMPT = [{"role": "user", "content": "Count the tokens of this sentence, please."}]


def upstreams_file(tmp_path, upstream_url: str, tpm: int, rpm: int, **extra) -> str:
    """The local upstream refills a bucket, and the proxy is told so (a window would forgo its burst)."""
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
                        "tpm": tpm,
                        "rpm": rpm,
                        "limit_model": "bucket",
                        **extra,
                    }
                ]
            }
        )
    )
    return str(path)


@contextlib.contextmanager
def proxies(count: int, **settings):
    """`count` proxy replicas, each a uvicorn server on its own thread and event loop."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(serve_in_thread(create_app(JudgeProxySettings(**settings)), free_port()))
            for _ in range(count)
        ]


async def test_two_replicas_keep_a_shared_upstream_under_its_limit_and_use_it(redis_url, redis_client, tmp_path):
    tpm, seconds = 3000, 2.5  # 50 tokens a second, after a first minute's worth
    upstream = local_upstream_app(LocalUpstreamConfig(tpm=tpm, rpm=6000, service_ms=1))
    with (
        serve_in_thread(upstream, free_port()) as upstream_url,
        proxies(
            2, redis_url=redis_url, upstreams=upstreams_file(tmp_path, upstream_url, tpm, 6000), queue_deadline_s=0.5
        ) as (first, second),
    ):
        statuses: list[tuple[str, int, bool]] = []
        async with httpx.AsyncClient(timeout=10) as http:
            started = time.monotonic()

            async def client(url: str) -> None:
                while time.monotonic() - started < seconds:
                    response = await http.post(
                        f"{url}/v1/chat/completions", json={"model": "judge", "messages": PROMPT, "max_tokens": 60}
                    )
                    statuses.append((url, response.status_code, "retry-after" in response.headers))

            await asyncio.gather(*(client(url) for url in [first, second] * 12))
            elapsed = time.monotonic() - started
            stats = (await http.get(f"{upstream_url}/admin/stats")).json()

    assert stats["rejected_429"] == 0
    assert stats["tokens_accepted"] >= 0.85 * (tpm + tpm / 60 * elapsed)
    assert {(status, has_retry_after) for _, status, has_retry_after in statuses} == {(200, False), (429, True)}
    assert {url for url, status, _ in statuses if status == 200} == {first, second}
    assert sum(status == 200 for _, status, _ in statuses) == stats["accepted"]


async def until_inflight(proxy_url: str, count: int) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(200):
            if (await http.get(f"{proxy_url}/v1/budget")).json()["upstreams"][0]["inflight"] == count:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"never {count} calls in flight")


@pytest.fixture
def served_proxy(redis_url, redis_client, tmp_path):
    upstream = local_upstream_app(LocalUpstreamConfig(tpm=600_000, rpm=6000, service_ms=0))
    with (
        serve_in_thread(upstream, free_port()) as upstream_url,
        proxies(
            1, redis_url=redis_url, upstreams=upstreams_file(tmp_path, upstream_url, 1200, 6000), queue_deadline_s=0.2
        ) as (proxy_url,),
    ):
        yield proxy_url, upstream_url


async def test_the_judge_client_returns_content_usage_and_scores(served_proxy):
    proxy_url, upstream_url = served_proxy
    client = JudgeClient(proxy_url)
    async with httpx.AsyncClient() as admin:
        await admin.post(
            f"{upstream_url}/admin/script",
            json={
                "replies": [
                    {"content": "Sure, which city?"},
                    {"content": '{"understanding": 10, "clarification": 5, "suggestions": 0, "verdict": "Fine."}'},
                ]
            },
        )

    reply = await client.chat(PROMPT, model="judge", max_tokens=30, job="job-7")
    result = await client.judge("interactivity", PROMPT + [{"role": "assistant", "content": reply.content}])
    await client.aclose()

    assert reply.content == "Sure, which city?"
    assert reply.usage["completion_tokens"] == 5 and reply.usage["total_tokens"] > 5
    assert result.score == pytest.approx(0.5) and result.verdict == "Fine."
    assert result.criteria == {"understanding": 1.0, "clarification": 0.5, "suggestions": 0.0}


async def test_the_judge_client_raises_at_once_on_a_client_error_and_after_retries_on_429(served_proxy):
    proxy_url, upstream_url = served_proxy
    client = JudgeClient(proxy_url, max_retries=1, max_retry_wait_s=0.05)
    async with httpx.AsyncClient() as admin:
        await admin.post(f"{upstream_url}/admin/script", json={"replies": [{"delay_s": 1.0, "content": "ok"}]})

    with pytest.raises(JudgeError) as unknown:
        await client.chat(PROMPT, model="nope", max_tokens=10)
    blocker = asyncio.create_task(client.chat(PROMPT, model="judge", max_tokens=1150))  # holds the budget
    await until_inflight(proxy_url, 1)
    started = time.monotonic()
    with pytest.raises(JudgeError) as refused:
        await client.chat(PROMPT, model="judge", max_tokens=100)
    elapsed = time.monotonic() - started
    await blocker
    await client.aclose()

    assert unknown.value.status == 404 and "unknown model 'nope'" in str(unknown.value)
    assert refused.value.status == 429 and refused.value.retry_after_s >= 1
    assert 0.4 <= elapsed < 1.5  # two 0.2 s queue deadlines and one capped wait


async def test_the_judge_client_raises_when_the_proxy_is_unreachable():
    client = JudgeClient(f"http://127.0.0.1:{free_port()}", max_retries=2, max_retry_wait_s=0.01)

    with pytest.raises(JudgeError) as unreachable:
        await client.judge("interactivity", PROMPT)
    await client.aclose()

    assert unreachable.value.status == 0 and "unreachable" in str(unreachable.value)


def test_the_cli_starts_the_proxy_as_a_process_that_never_logs_the_key(redis_url, tmp_path):
    key = "sk-test-cli-0123456789"
    upstream = local_upstream_app(LocalUpstreamConfig(api_key=key, service_ms=0))
    with serve_in_thread(upstream, free_port()) as upstream_url:
        port = free_port()
        env = {
            **os.environ,
            "TANDEM_REDIS_URL": redis_url,
            "TANDEM_PORT": str(port),
            "TEST_CLI_KEY": key,
            "TANDEM_UPSTREAMS": upstreams_file(tmp_path, upstream_url, 60_000, 600, api_key_env="TEST_CLI_KEY"),
            "TANDEM_LOG_LEVEL": "DEBUG",
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "judge-proxy"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{base}/healthz").status_code == 200:
                        break
                assert process.poll() is None and time.monotonic() < deadline, "proxy did not start"
                time.sleep(0.1)
            response = httpx.post(
                f"{base}/v1/chat/completions", json={"model": "judge", "messages": PROMPT, "max_tokens": 10}
            )
        finally:
            process.terminate()
            log, _ = process.communicate(timeout=10)

    assert response.status_code == 200 and response.json()["usage"]["total_tokens"] > 0
    assert "settings:" in log and key not in log
