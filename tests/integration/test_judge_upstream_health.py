"""Upstream health in the judge proxy: each upstream's circuit, shared by replicas through a
real Redis, against real local upstreams (the stand-in's fault modes) and a closed port. The
proxies run in-process behind httpx, each with its health watcher (which also writes the
index of upstreams) as its lifespan starts it, checking every 0.05 s."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from test_judge_proxy import chat, entry, sample, servers, upstreams  # noqa: F401  (fixtures)

from judge_proxy.app import create_app
from services.config import JudgeProxySettings
from services.queues import Keys
from services.upstream_health import Outage, outage_of, read
from tandem.redis_embed import free_port

DOWN = "every upstream of model 'judge' is down: "


@pytest.fixture
async def replica(redis_url, redis_client, tmp_path):
    """Builds proxy replicas over the given upstream entries, each with its health watcher
    running; yields clients for them once the index lists their upstreams."""
    made = []

    async def make(*entries: dict, **settings) -> httpx.AsyncClient:
        path = tmp_path / f"upstreams-{len(made)}.json"
        path.write_text(json.dumps({"upstreams": list(entries)}))
        app = create_app(JudgeProxySettings(redis_url=redis_url, upstreams=str(path), **settings))
        watcher = asyncio.create_task(app.state.proxy.gateway.health.watch(every_s=0.05))
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=30)
        made.append((app, watcher, client))

        async def indexed() -> bool:
            return {e["name"].encode() for e in entries} <= (await redis_client.hgetall(Keys.upstream_index)).keys()

        await eventually(indexed, "the index to list the upstreams")
        return client

    yield make
    for app, watcher, client in made:
        watcher.cancel()
        await client.aclose()
        await app.state.proxy.aclose()


async def eventually(condition, what: str, timeout_s: float = 10.0) -> None:
    """Until the coroutine function `condition` returns true; a failure naming `what` after
    `timeout_s` (a bound for a slow machine, not a wait that decides anything)."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def fault(server, mode: str, **options) -> None:
    (await server.admin.post(f"{server.url}/admin/fault", json={"mode": mode, **options})).raise_for_status()


async def until_not_503(proxy: httpx.AsyncClient, body: dict, timeout_s: float = 10.0) -> httpx.Response:
    """The first reply that is not a 503 (an open circuit's), posting again until then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = await proxy.post("/v1/chat/completions", json=body)
        if response.status_code != 503:
            return response
        await asyncio.sleep(0.02)
    raise TimeoutError("the circuit never let a call through")


async def has_requests(server, requests: int) -> bool:
    return (await server.stats())["requests"] >= requests


async def health(proxy: httpx.AsyncClient, name: str) -> dict:
    return next(u for u in (await proxy.get("/v1/upstreams")).json()["upstreams"] if u["name"] == name)


# --- the circuit ---------------------------------------------------------------------------


async def test_an_upstream_that_refuses_connections_opens_its_circuit_and_later_calls_get_503_at_once_naming_it(
    replica,
):
    nobody = f"http://127.0.0.1:{free_port()}"
    proxy = await replica(entry("stand-in", nobody), circuit_failures=3, circuit_open_s=60)

    failed = [await proxy.post("/v1/chat/completions", json=chat()) for _ in range(3)]
    budget = (await proxy.get("/v1/budget")).json()["upstreams"][0]
    started = time.monotonic()
    refused = await proxy.post("/v1/chat/completions", json=chat())
    judged = await proxy.post(
        "/v1/judge", json={"rubric": "interactivity", "messages": [{"role": "user", "content": "hi"}]}
    )

    assert [r.status_code for r in failed] == [502, 502, 502]
    assert refused.status_code == judged.status_code == 503
    assert time.monotonic() - started < 1.0
    error = refused.json()["error"]
    assert error["type"] == "upstream_unavailable"
    assert error["message"].startswith(DOWN + "stand-in: connect_error ClientConnectorError since 20")
    assert error["message"].endswith("Z (3 failures)")
    assert judged.json()["error"]["message"] == error["message"]
    assert 59 <= int(refused.headers["retry-after"]) <= 60
    after = (await proxy.get("/v1/budget")).json()["upstreams"][0]
    assert after["available_requests"] == budget["available_requests"]  # nothing reserved for a 503
    assert after["used_requests_total"] == budget["used_requests_total"]


async def test_a_half_open_probe_that_succeeds_closes_the_circuit_and_calls_flow_again(replica, upstreams):
    proxy = await replica(entry("a", upstreams["a"]), circuit_failures=2, circuit_open_s=0.3)
    await fault(upstreams["a"], "5xx")
    failed = [await proxy.post("/v1/chat/completions", json=chat()) for _ in range(2)]
    refused = await proxy.post("/v1/chat/completions", json=chat())
    await fault(upstreams["a"], "none")

    probed = await until_not_503(proxy, chat())
    after = [await proxy.post("/v1/chat/completions", json=chat()) for _ in range(3)]

    assert [r.status_code for r in failed] == [502, 502] and refused.status_code == 503
    assert probed.status_code == 200 and [r.status_code for r in after] == [200, 200, 200]
    assert (await upstreams["a"].stats())["requests"] == 2 + 1 + 3  # nothing reached it while open
    assert await health(proxy, "a") == {
        "name": "a",
        "model": "judge",
        "state": "closed",
        "since": 0.0,
        "failures": 0,
        "reason": "",
        "next_probe_s": 0.0,
    }


async def test_a_failed_probe_reopens_the_circuit_and_the_outage_keeps_its_start(replica, upstreams, redis_client):
    proxy = await replica(entry("a", upstreams["a"]), circuit_failures=1, circuit_open_s=0.3)
    await fault(upstreams["a"], "5xx", status=503)
    await proxy.post("/v1/chat/completions", json=chat())
    first = await redis_client.hgetall(Keys.upstream_health("a"))

    probed = await until_not_503(proxy, chat())
    second = await redis_client.hgetall(Keys.upstream_health("a"))

    assert probed.status_code == 502 and (await upstreams["a"].stats())["requests"] == 2
    assert second[b"state"] == b"open" and second[b"failures"] == b"2" and second[b"reason"] == b"server_error HTTP 503"
    assert second[b"since"] == first[b"since"]
    assert float(second[b"opened_at"]) >= float(first[b"opened_at"]) + 0.3
    assert float(second[b"probe_until"]) == pytest.approx(float(second[b"opened_at"]) + 0.3)


@pytest.mark.parametrize(
    "mode, options, reason, tries",
    [
        ("garbage", {}, "server_error reply is not JSON", 1),
        ("5xx", {"status": 502}, "server_error HTTP 502", 1),
        # A disconnect is tried once more on a fresh connection (a stale pooled one looks alike).
        ("drop", {}, "connect_error ServerDisconnectedError", 2),
    ],
)
async def test_garbage_json_and_5xx_count_as_failures(replica, upstreams, mode, options, reason, tries):
    proxy = await replica(entry("a", upstreams["a"]), circuit_failures=2, circuit_open_s=60)
    await fault(upstreams["a"], mode, **options)

    failed = [await proxy.post("/v1/chat/completions", json=chat()) for _ in range(2)]
    refused = await proxy.post("/v1/chat/completions", json=chat())

    assert [r.status_code for r in failed] == [502, 502] and refused.status_code == 503
    assert f"a: {reason} since " in refused.json()["error"]["message"]
    assert (await upstreams["a"].stats())["requests"] == 2 * tries


async def test_429_forever_opens_the_circuit_only_after_rate_limit_outage_s(replica, upstreams, redis_client):
    proxy = await replica(
        entry("a", upstreams["a"]), circuit_failures=2, rate_limit_outage_s=0.5, max_backoff_s=0.05, circuit_open_s=60
    )
    await fault(upstreams["a"], "429", retry_after_s=0.02)

    statuses = []

    async def opened() -> bool:
        statuses.append((await proxy.post("/v1/chat/completions", json=chat())).status_code)
        return statuses[-1] == 503

    await eventually(opened, "the circuit to open")
    record = await redis_client.hgetall(Keys.upstream_health("a"))

    assert set(statuses[:-1]) == {429}  # pacing, not an outage, while the 429s last under 0.5 s
    assert (await upstreams["a"].stats())["faulted"] > 2  # more 429s than circuit_failures
    assert float(record[b"opened_at"]) - float(record[b"limited_since"]) >= 0.5
    assert record[b"failures"] == b"0" and record[b"reason"].startswith(b"429 for ")


async def test_a_429_burst_then_a_success_ends_the_streak(replica, upstreams):
    proxy = await replica(entry("a", upstreams["a"]), rate_limit_outage_s=60, max_backoff_s=0.05)
    await upstreams["a"].script({"status": 429, "retry_after_ms": 10}, {"status": 429, "retry_after_ms": 10})

    response = await proxy.post("/v1/chat/completions", json=chat())

    assert response.status_code == 200
    assert (await health(proxy, "a"))["state"] == "closed" and (await health(proxy, "a"))["since"] == 0.0


# --- hung and slow -------------------------------------------------------------------------


async def test_a_hung_upstream_fails_by_first_byte_timeout_and_a_slow_stream_still_arriving_is_not_cut(
    replica, upstreams
):
    proxy = await replica(
        entry("a", upstreams["a"], weight=1e9, first_byte_timeout_s=0.3, timeout_s=0.5, idle_timeout_s=0.5),
        entry("b", upstreams["b"]),
        failure_cooldown_s=0,  # the stream goes to a again
    )
    await fault(upstreams["a"], "hang")
    hung = await proxy.post("/v1/chat/completions", json=chat())
    hung_reason = (await health(proxy, "a"))["reason"]
    await fault(upstreams["a"], "none")
    words = " ".join(["slow"] * 12)  # 12 chunks 0.1 s apart: longer than timeout_s, never idle 0.5 s
    await upstreams["a"].script({"content": words, "token_delay_s": 0.1})

    async with proxy.stream("POST", "/v1/chat/completions", json=chat(max_tokens=50, stream=True)) as streamed:
        events = [line async for line in streamed.aiter_lines() if line.startswith("data: ")]

    assert hung.status_code == 200 and hung.headers["x-tandem-upstream"] == "b"
    assert hung_reason == "timeout (no first byte in 0.3 s)"
    assert streamed.headers["x-tandem-upstream"] == "a" and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == words
    assert (await health(proxy, "a"))["failures"] == 0  # the whole stream closed the streak


async def test_a_stalled_stream_is_cut_by_idle_timeout_and_counts_as_a_failure(replica, upstreams):
    proxy = await replica(entry("a", upstreams["a"], idle_timeout_s=0.3))
    await fault(upstreams["a"], "stall_stream")

    async with proxy.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as streamed:
        events = [line async for line in streamed.aiter_lines() if line.startswith("data: ")]

    assert len(events) == 2  # the role chunk, then the proxy's error event
    assert "stream was cut off (timeout (no byte in 0.3 s))" in events[-1]
    a = await health(proxy, "a")
    assert a["failures"] == 1 and a["reason"] == "stream_cut timeout (no byte in 0.3 s)"


# --- replicas ------------------------------------------------------------------------------


async def test_open_circuit_is_shared_by_a_second_proxy_replica(replica, upstreams):
    first = await replica(entry("a", upstreams["a"]), circuit_failures=2, circuit_open_s=60)
    second = await replica(entry("a", upstreams["a"]), circuit_failures=2, circuit_open_s=60)
    await fault(upstreams["a"], "5xx")
    for _ in range(2):
        await first.post("/v1/chat/completions", json=chat())

    refused = await second.post("/v1/chat/completions", json=chat())

    assert refused.status_code == 503 and refused.json()["error"]["type"] == "upstream_unavailable"
    assert (await upstreams["a"].stats())["requests"] == 2


async def test_only_one_call_across_replicas_probes_a_half_open_upstream(replica, upstreams):
    settings = {"circuit_failures": 1, "circuit_open_s": 0.2}
    first = await replica(entry("a", upstreams["a"], first_byte_timeout_s=5), **settings)
    second = await replica(entry("a", upstreams["a"], first_byte_timeout_s=5), **settings)
    await fault(upstreams["a"], "5xx")
    await first.post("/v1/chat/completions", json=chat())
    await fault(upstreams["a"], "hang")

    probe = asyncio.create_task(until_not_503(first, chat()))
    await eventually(lambda: has_requests(upstreams["a"], 2), "the probe to reach the upstream")
    others = [await proxy.post("/v1/chat/completions", json=chat()) for proxy in (first, second, second)]
    await fault(upstreams["a"], "none")  # the hung probe is answered

    assert [r.status_code for r in others] == [503, 503, 503]
    assert (await probe).status_code == 200 and (await upstreams["a"].stats())["requests"] == 2
    assert (await health(second, "a"))["state"] == "closed"


# --- visible -------------------------------------------------------------------------------


async def test_healthz_is_degraded_with_the_reason_and_v1_upstreams_shows_the_state(replica, upstreams):
    proxy = await replica(
        entry("a", upstreams["a"]), entry("b", upstreams["b"], model="other"), circuit_failures=2, circuit_open_s=60
    )
    fine = (await proxy.get("/healthz")).json()
    await fault(upstreams["a"], "5xx")
    for _ in range(2):
        await proxy.post("/v1/chat/completions", json=chat())

    healthz = await proxy.get("/healthz")
    shown = (await proxy.get("/v1/upstreams")).json()

    assert fine["status"] == "ok" and fine["degraded"] == []
    assert healthz.status_code == 200 and healthz.json()["status"] == "degraded"
    [reason] = healthz.json()["degraded"]
    assert reason.startswith(DOWN + "a: server_error HTTP 500 since 20") and reason.endswith("Z (2 failures)")
    a = next(u for u in shown["upstreams"] if u["name"] == "a")
    assert a["state"] == "open" and a["failures"] == 2 and a["reason"] == "server_error HTTP 500"
    assert 59 < a["next_probe_s"] <= 60 and a["since"] > 1.7e9
    assert shown["models"] == {
        "judge": {"available": False, "reason": reason},
        "other": {"available": True, "reason": ""},
    }
    assert sample("tandem_judge_upstream_state", upstream="a") == 2
    assert sample("tandem_judge_model_available", model="judge") == 0
    assert sample("tandem_judge_model_available", model="other") == 1


async def test_a_replica_with_no_calls_sees_the_outage_by_its_timer(replica, upstreams):
    first = await replica(entry("a", upstreams["a"]), circuit_failures=1, circuit_open_s=60)
    idle = await replica(entry("a", upstreams["a"]), circuit_failures=1, circuit_open_s=60)
    await fault(upstreams["a"], "5xx")
    await first.post("/v1/chat/completions", json=chat())

    async def degraded() -> bool:
        return (await idle.get("/healthz")).json()["status"] == "degraded"

    await eventually(degraded, "the idle replica to see the outage")

    assert (await upstreams["a"].stats())["requests"] == 1


async def outages(client, models: list[str]) -> dict[str, Outage]:
    """The models of `models` whose every upstream is down, read from the shared records
    through the proxies' index, as any process can (`services.upstream_health`)."""
    index = {k.decode(): v.decode() for k, v in (await client.hgetall(Keys.upstream_index)).items()}
    healths = await read(client, {name: model for name, model in index.items() if model in models})
    found = {model: outage_of(model, [h for h in healths if h.model == model]) for model in models}
    return {model: outage for model, outage in found.items() if outage is not None}


async def test_outages_reader_reports_a_model_only_when_every_upstream_is_open(replica, upstreams, redis_client):
    proxy = await replica(
        entry("a", upstreams["a"], weight=1e9), entry("b", upstreams["b"]), circuit_failures=1, circuit_open_s=60
    )
    await fault(upstreams["a"], "5xx")
    served = await proxy.post("/v1/chat/completions", json=chat())  # a fails, b answers
    one_down = await outages(redis_client, ["judge", "unregistered"])
    await fault(upstreams["b"], "drop")
    await proxy.post("/v1/chat/completions", json=chat())  # b fails too

    found = await outages(redis_client, ["judge", "unregistered"])

    assert served.headers["x-tandem-upstream"] == "b" and one_down == {}
    assert list(found) == ["judge"]
    a = await redis_client.hgetall(Keys.upstream_health("a"))
    assert found["judge"].since == float(a[b"since"])  # a's outage began first
    assert found["judge"].reason.startswith(DOWN + "a: server_error HTTP 500 since 20")
    assert "; b: connect_error ServerDisconnectedError since 20" in found["judge"].reason
