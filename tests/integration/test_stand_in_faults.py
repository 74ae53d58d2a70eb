"""The stand-in provider's outages (`POST /admin/fault`), over real HTTP: each mode fails
every chat call its way until cleared."""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import httpx
import pytest

from devtools import provider
from devtools.provider import UNPARSEABLE, LocalUpstreamConfig, create_app, serve_in_thread
from judge_proxy.rubrics import RUBRICS, parse_verdict
from tandem.redis_embed import free_port

BODY = {"model": "local-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def stand_in():
    with serve_in_thread(create_app(LocalUpstreamConfig(service_ms=0)), free_port()) as url:
        yield url


@pytest.fixture
async def http(stand_in):
    async with httpx.AsyncClient(base_url=stand_in, timeout=10) as client:
        (await client.post("/admin/reset")).raise_for_status()
        yield client


async def fault(http: httpx.AsyncClient, mode: str, **options) -> None:
    (await http.post("/admin/fault", json={"mode": mode, **options})).raise_for_status()


async def arrived(http: httpx.AsyncClient, requests: int, timeout_s: float = 10.0) -> None:
    """Until the stand-in has seen `requests` chat calls (a failure after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while (await http.get("/admin/stats")).json()["requests"] < requests:
        assert time.monotonic() < deadline, f"fewer than {requests} calls arrived"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("prompt_chars", [5, 100_000])
async def test_drop_closes_the_connection_without_a_reply(http, prompt_chars):
    """A large body arrives in many packets: closing before they are all read would reset
    the connection (a read error) instead of closing it, as it did on 9 calls in 10."""
    body = {**BODY, "messages": [{"role": "user", "content": "x" * prompt_chars}]}
    await fault(http, "drop")

    for _ in range(20):
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await http.post("/v1/chat/completions", json=body)

    assert (await http.get("/admin/stats")).json()["faulted"] == 20  # the admin routes still answer


async def test_drop_of_a_body_that_never_ends_still_closes_once_its_deadline_passes(http, stand_in, monkeypatch):
    """A client that promises 1,000 bytes and sends 10 cannot hold a dropped call open: the
    stand-in stops reading at its deadline and closes, having sent nothing."""
    monkeypatch.setattr(provider, "DRAIN_S", 0.2)
    await fault(http, "drop")
    address = urlsplit(stand_in)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    started = time.monotonic()  # before the stand-in can have read the headers, so its deadline runs later
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: stand-in\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"model": "'
    )
    await writer.drain()

    answer = await asyncio.wait_for(reader.read(), timeout=10)  # b"" once the stand-in closes
    waited_s = time.monotonic() - started
    writer.close()

    assert answer == b"" and waited_s >= 0.2  # nothing sent, and not before the deadline
    assert (await http.get("/admin/stats")).json()["faulted"] == 1


async def test_hang_answers_only_once_the_fault_is_cleared(http):
    await fault(http, "hang")
    call = asyncio.create_task(http.post("/v1/chat/completions", json=BODY))
    await arrived(http, 1)
    await asyncio.sleep(0.2)
    still_waiting = not call.done()

    await fault(http, "none")

    assert still_waiting and (await call).status_code == 200


async def test_429_and_5xx_answer_every_call_with_their_status(http):
    await fault(http, "429", retry_after_s=2.5)
    limited = [await http.post("/v1/chat/completions", json=BODY) for _ in range(3)]
    await fault(http, "5xx", status=503)
    failed = await http.post("/v1/chat/completions", json=BODY)
    await fault(http, "5xx")
    default = await http.post("/v1/chat/completions", json=BODY)

    assert [r.status_code for r in limited] == [429, 429, 429]
    assert limited[0].headers["retry-after"] == "3" and limited[0].headers["retry-after-ms"] == "2500"
    assert failed.status_code == 503 and default.status_code == 500


async def test_garbage_is_a_200_that_is_not_json_and_unparseable_is_a_reply_no_rubric_reads(http):
    await fault(http, "garbage")
    garbage = await http.post("/v1/chat/completions", json=BODY)
    await fault(http, "unparseable")
    unparseable = await http.post("/v1/chat/completions", json=BODY)

    assert garbage.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        garbage.json()
    content = unparseable.json()["choices"][0]["message"]["content"]
    assert unparseable.status_code == 200 and content == UNPARSEABLE
    assert all(parse_verdict(rubric, content) is None for rubric in RUBRICS.values())


async def test_stall_stream_sends_headers_and_one_chunk_then_nothing_until_cleared(http):
    await fault(http, "stall_stream")

    async with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as stream:
        lines = stream.aiter_lines()
        first, _blank = await anext(lines), await anext(lines)
        pending = asyncio.ensure_future(anext(lines))
        arrived_while_stalled, _ = await asyncio.wait({pending}, timeout=0.3)
        await fault(http, "none")
        rest = [await pending, *[line async for line in lines]]

    assert stream.status_code == 200 and '"role": "assistant"' in first and not arrived_while_stalled
    assert [line for line in rest if line.startswith("data: ")][-1] == "data: [DONE]"


async def test_a_reset_clears_the_fault(http):
    await fault(http, "5xx")
    (await http.post("/admin/reset")).raise_for_status()

    assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
