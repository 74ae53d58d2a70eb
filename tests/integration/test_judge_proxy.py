"""The judge proxy in front of real local upstreams (uvicorn threads on loopback) and a real
Redis; the proxy itself runs in-process behind httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client import REGISTRY

from devtools.provider import LocalUpstreamConfig, serve_in_thread
from devtools.provider import create_app as local_upstream_app
from judge_proxy.app import create_app
from services.config import JudgeProxySettings
from tandem.redis_embed import free_port

KEY = "sk-test-a1b2c3d4e5f6a7b8c9d0"
WRONG_KEY = "sk-test-ffffeeeeddddccccbbbb"


@dataclass
class LocalServer:
    url: str
    admin: httpx.AsyncClient

    async def script(self, *replies: dict) -> None:
        (await self.admin.post(f"{self.url}/admin/script", json={"replies": list(replies)})).raise_for_status()

    async def stats(self) -> dict:
        return (await self.admin.get(f"{self.url}/admin/stats")).json()

    async def requests(self) -> list[dict]:
        return (await self.admin.get(f"{self.url}/admin/requests")).json()


@pytest.fixture(scope="module")
def servers():
    """Two local upstreams, `a` and `b`, with room to spare (the proxy's budgets bind)."""
    with contextlib.ExitStack() as stack:
        config = LocalUpstreamConfig(tpm=6_000_000, rpm=60_000, service_ms=0, seed=1)
        yield {
            name: stack.enter_context(serve_in_thread(local_upstream_app(config), free_port())) for name in ("a", "b")
        }


@pytest.fixture
async def upstreams(servers):
    async with httpx.AsyncClient() as admin:
        for url in servers.values():
            (await admin.post(f"{url}/admin/reset")).raise_for_status()
        yield {name: LocalServer(url, admin) for name, url in servers.items()}


@pytest.fixture
async def make_proxy(redis_url, redis_client, tmp_path):
    """Builds proxies over the given upstream entries; yields clients for them."""
    made = []

    async def make(*entries: dict, **settings) -> httpx.AsyncClient:
        path = tmp_path / f"upstreams-{len(made)}.json"
        path.write_text(json.dumps({"upstreams": list(entries)}))
        app = create_app(JudgeProxySettings(redis_url=redis_url, upstreams=str(path), **settings))
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=30)
        made.append((app, client))
        return client

    yield make
    for app, client in made:
        await client.aclose()
        await app.state.proxy.aclose()


def entry(name: str, server: LocalServer | str, **overrides) -> dict:
    url = server.url if isinstance(server, LocalServer) else server
    return {
        "name": name,
        "model": "judge",
        "upstream_model": "local-model",
        "base_url": f"{url}/v1",
        "tpm": 600_000,
        "rpm": 6000,
        **overrides,
    }


def chat(content: str = "hello", max_tokens: int = 20, model: str = "judge", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- chat completions: pass-through and reconciliation -------------------------------------


async def test_a_completion_passes_the_upstream_reply_and_usage_through(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    await upstreams["a"].script({"content": "four words of reply."})

    response = await proxy.post("/v1/chat/completions", json=chat("!!!!!!!!", temperature=0.3, seed=5))

    assert response.status_code == 200
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "four words of reply."
    assert body["usage"] == {"prompt_tokens": 8 + 4 + 3, "completion_tokens": 5, "total_tokens": 20}
    assert response.headers["x-tandem-upstream"] == "a"
    assert response.headers["server-timing"].startswith("queue;dur=")
    sent = (await upstreams["a"].requests())[-1]
    assert sent["model"] == "local-model" and sent["temperature"] == 0.3 and sent["seed"] == 5


async def test_reconciliation_corrects_a_wrong_estimate_in_both_directions_and_learns_the_ratio(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"], tpm=600, prompt_margin=0))
    refunded = sample("tandem_judge_tokens_total", upstream="a", kind="refunded")
    charged = sample("tandem_judge_tokens_total", upstream="a", kind="charged")
    bucket = "tandem_judge_reconciliation_error_tokens_bucket"
    errors = {le: sample(bucket, upstream="a", le=le) for le in ("-64.0", "-16.0", "64.0", "256.0")}
    await upstreams["a"].script({"content": "ok"}, {"content": "ok"})

    # Prompt estimate 2 + 4 + 3 = 9 (chars/4), reserved 9 + 100; the upstream counts 8 + 4 + 3 = 15
    # for the prompt, 16 in all. The first call teaches the prompt ratio in full: 15 / 9.
    over = await proxy.post("/v1/chat/completions", json=chat("!" * 8, max_tokens=100))
    # Prompt estimate 10 + 4 + 3 = 17, reserved ceil(17 * 15 / 9) + 1 = 30; counted 47 + 1 = 48.
    under = await proxy.post("/v1/chat/completions", json=chat("!" * 40, max_tokens=1))
    budget = (await proxy.get("/v1/budget")).json()["upstreams"][0]

    assert over.json()["usage"]["total_tokens"] == 16 and under.json()["usage"]["total_tokens"] == 48
    assert budget["used_tokens_total"] == 16 + 48
    assert budget["available_tokens"] == 600 - 64  # a trailing window: both calls are in it
    assert sample("tandem_judge_tokens_total", upstream="a", kind="refunded") - refunded == 109 - 16
    assert sample("tandem_judge_tokens_total", upstream="a", kind="charged") - charged == 48 - 30
    # Errors (estimate - actual) 93 and -18: cumulative buckets count them by upper bound.
    assert {le: sample(bucket, upstream="a", le=le) - before for le, before in errors.items()} == {
        "-64.0": 0,
        "-16.0": 1,
        "64.0": 1,
        "256.0": 2,
    }
    # The ratio is a running mean over calls: (15/9 + 47/17) / 2.
    assert budget["prompt_ratio"] == pytest.approx((15 / 9 + 47 / 17) / 2, abs=1e-5)


# --- malformed requests ------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, status, message",
    [
        (b"{not json", 400, "malformed JSON body"),
        (b"[1, 2]", 400, "the JSON body must be an object"),
        (json.dumps({"model": "judge"}).encode(), 400, "messages: Field required"),
        (json.dumps({"model": "judge", "messages": []}).encode(), 400, "messages: List should have at least 1 item"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "model: Field required"),
        (json.dumps(chat(model="gpt-nope")).encode(), 404, "unknown model 'gpt-nope'"),
        (json.dumps(chat(max_tokens=10**6)).encode(), 400, "more than any upstream of 'judge' allows per minute"),
        (
            json.dumps(chat([{"type": "text", "text": 123}])).encode(),
            400,
            "messages.0.content: Value error, part 0: text: Input should be a valid string",
        ),
        (
            json.dumps(chat([{"type": "text", "text": None}])).encode(),
            400,
            "messages.0.content: Value error, part 0: a 'text' part needs a string 'text'",
        ),
        (json.dumps(chat([{"text": "no type"}])).encode(), 400, "messages.0.content: Value error, part 0: type: Field"),
    ],
)
async def test_a_bad_request_gets_400_or_404_with_a_clear_message(make_proxy, upstreams, content, status, message):
    proxy = await make_proxy(entry("a", upstreams["a"]))

    response = await proxy.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})

    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    assert (await upstreams["a"].stats())["requests"] == 0


@pytest.mark.parametrize(
    "caps",
    [{"max_completion_tokens": None}, {"max_tokens": None}, {"max_tokens": None, "max_completion_tokens": None}, {}],
)
async def test_a_missing_or_null_output_cap_is_pinned_to_the_reserved_default(make_proxy, upstreams, caps):
    proxy = await make_proxy(entry("a", upstreams["a"]), default_max_tokens=7)
    await upstreams["a"].script({"content": "ok"})
    body = {"model": "judge", "messages": [{"role": "user", "content": "hi"}], **caps}

    response = await proxy.post("/v1/chat/completions", json=body)

    assert response.status_code == 200
    sent = (await upstreams["a"].requests())[-1]
    assert sent["max_tokens"] == 7 and sent.get("max_completion_tokens") is None


async def test_an_unknown_priority_header_is_400(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))

    response = await proxy.post("/v1/chat/completions", json=chat(), headers={"x-tandem-priority": "urgent"})

    assert response.status_code == 400 and "X-Tandem-Priority" in response.json()["error"]["message"]


# --- upstream 429s ------------------------------------------------------------------------


async def test_the_upstream_retry_after_is_honoured_by_every_request(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    await upstreams["a"].script({"status": 429, "retry_after_ms": 400})
    started = time.monotonic()

    async def later() -> httpx.Response:
        await asyncio.sleep(0.1)
        return await proxy.post("/v1/chat/completions", json=chat())

    first, second = await asyncio.gather(proxy.post("/v1/chat/completions", json=chat()), later())
    elapsed = time.monotonic() - started

    assert first.status_code == second.status_code == 200
    assert 0.4 <= elapsed < 1.2  # both waited out the pause, neither much longer
    stats = await upstreams["a"].stats()
    assert (stats["requests"], stats["scripted_errors"]) == (3, 1)


async def test_a_429_without_retry_after_backs_off_exponentially_with_jitter(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    await upstreams["a"].script({"status": 429})
    started = time.monotonic()

    response = await proxy.post("/v1/chat/completions", json=chat())

    assert response.status_code == 200
    assert 0.25 <= time.monotonic() - started < 0.9  # first backoff: 0.5 s times a jitter in [0.5, 1]


async def test_an_upstream_that_keeps_answering_429_gives_the_client_429_with_retry_after(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]), max_attempts=2)
    await upstreams["a"].script({"status": 429, "retry_after_ms": 50}, {"status": 429, "retry_after_s": 2})
    received = sample("tandem_judge_upstream_429_total", upstream="a")

    response = await proxy.post("/v1/chat/completions", json=chat())

    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert sample("tandem_judge_upstream_429_total", upstream="a") - received == 2


# --- waiting for budget --------------------------------------------------------------------


async def test_an_over_budget_request_waits_then_gets_429_with_retry_after(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"], tpm=600, pace_s=0), queue_deadline_s=0.3)
    await upstreams["a"].script({"delay_s": 0.5, "content": "ok"})
    rejected = sample("tandem_judge_rejected_total", priority="judge")

    holder = asyncio.create_task(proxy.post("/v1/chat/completions", json=chat(max_tokens=550)))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    refused = await proxy.post(
        "/v1/chat/completions",
        json=chat(max_tokens=100),
        headers={"x-tandem-priority": "judge", "x-tandem-job": "job-1"},
    )

    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limited"
    assert 0.25 <= time.monotonic() - started < 0.6
    assert sample("tandem_judge_rejected_total", priority="judge") - rejected == 1
    assert (await holder).status_code == 200


async def test_a_waiting_request_goes_as_soon_as_a_settled_call_refunds_its_tokens(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"], tpm=600, pace_s=0), queue_deadline_s=5)
    await upstreams["a"].script({"delay_s": 0.3, "content": "ok"})
    started = time.monotonic()

    holder = asyncio.create_task(proxy.post("/v1/chat/completions", json=chat(max_tokens=550)))
    await asyncio.sleep(0.05)
    waiter = await proxy.post("/v1/chat/completions", json=chat(max_tokens=100))

    assert waiter.status_code == 200 and (await holder).status_code == 200
    assert time.monotonic() - started < 0.8  # refill alone would take (109 - 44) / 10 = 6.5 s
    queue_ms = float(waiter.headers["server-timing"].split(",")[0].split("=")[1])
    assert queue_ms >= 200


# --- failover ------------------------------------------------------------------------------


async def test_a_server_error_fails_over_to_another_upstream(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"], weight=1e9), entry("b", upstreams["b"], weight=1))
    await upstreams["a"].script({"status": 500})

    first = await proxy.post("/v1/chat/completions", json=chat())
    second = await proxy.post("/v1/chat/completions", json=chat())

    assert first.status_code == second.status_code == 200
    assert first.headers["x-tandem-upstream"] == second.headers["x-tandem-upstream"] == "b"
    assert (await upstreams["a"].stats())["requests"] == 1  # cooling down: the second went straight to b


async def test_a_timeout_fails_over_to_another_upstream(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"], weight=1e9, timeout_s=0.3), entry("b", upstreams["b"]))
    await upstreams["a"].script({"delay_s": 1.0})
    started = time.monotonic()

    response = await proxy.post("/v1/chat/completions", json=chat())

    assert response.status_code == 200 and response.headers["x-tandem-upstream"] == "b"
    assert time.monotonic() - started < 1.0


async def test_a_refused_connection_fails_over_to_another_upstream(make_proxy, upstreams):
    nobody = f"http://127.0.0.1:{free_port()}"
    proxy = await make_proxy(entry("a", nobody, weight=1e9), entry("b", upstreams["b"]))

    response = await proxy.post("/v1/chat/completions", json=chat())

    assert response.status_code == 200 and response.headers["x-tandem-upstream"] == "b"


async def test_when_every_upstream_fails_the_client_gets_502_naming_each_failure(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]), entry("b", upstreams["b"]))
    await upstreams["a"].script({"status": 500})
    await upstreams["b"].script({"status": 503})

    response = await proxy.post("/v1/chat/completions", json=chat())

    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "a: server_error HTTP 500" in message and "b: server_error HTTP 503" in message


# --- keys and client tokens ------------------------------------------------------------------


async def test_a_client_cannot_read_an_upstream_key(make_proxy, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("TEST_UPSTREAM_KEY", KEY)
    monkeypatch.setenv("TEST_WRONG_KEY", WRONG_KEY)
    keyed = local_upstream_app(LocalUpstreamConfig(api_key=KEY, service_ms=0))
    with serve_in_thread(keyed, free_port()) as url:
        async with httpx.AsyncClient() as admin:
            server = LocalServer(url, admin)
            proxy = await make_proxy(
                entry("right", url, api_key_env="TEST_UPSTREAM_KEY"),
                entry("wrong", url, model="judge-wrong", api_key_env="TEST_WRONG_KEY"),
            )
            ok = await proxy.post("/v1/chat/completions", json=chat())
            await server.script({"status": 400, "message": "bad request from key {authorization}"})
            echoed = await proxy.post("/v1/chat/completions", json=chat())
            rejected = await proxy.post("/v1/chat/completions", json=chat(model="judge-wrong"))
            others = [
                await proxy.get("/v1/budget"),
                await proxy.get("/healthz"),
                await proxy.get("/metrics"),
                await proxy.post("/v1/chat/completions", json=chat(model="nope")),
            ]

    assert ok.status_code == 200  # the right key was sent upstream
    assert echoed.status_code == 400 and "bad request from key [redacted]" in echoed.text
    assert rejected.status_code == 502 and "wrong: auth_error HTTP 401" in rejected.text
    for response in [ok, echoed, rejected, *others]:
        assert KEY not in response.text and WRONG_KEY not in response.text
        assert KEY not in str(response.headers) and WRONG_KEY not in str(response.headers)
    assert "wrong" in caplog.text  # the failure was logged, by name only
    assert KEY not in caplog.text and WRONG_KEY not in caplog.text


async def test_client_tokens_are_required_when_configured(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]), client_tokens="token-one, token-two")

    missing = await proxy.post("/v1/chat/completions", json=chat())
    unknown = await proxy.get("/v1/budget", headers={"authorization": "Bearer token-three"})
    accepted = await proxy.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer token-two"})

    assert missing.status_code == unknown.status_code == 401
    assert accepted.status_code == 200
    assert (await proxy.get("/healthz")).status_code == 200


# --- budget view and metrics -----------------------------------------------------------------


async def test_the_budget_view_shows_limits_and_shared_usage_per_upstream(make_proxy, upstreams):
    proxy = await make_proxy(
        entry("a", upstreams["a"], tpm=90_000, rpm=900, max_concurrency=7), entry("b", upstreams["b"], model="other")
    )
    other_replica = await make_proxy(entry("a", upstreams["a"], tpm=90_000, rpm=900, max_concurrency=7))

    usage = (await other_replica.post("/v1/chat/completions", json=chat())).json()["usage"]
    view = {u["name"]: u for u in (await proxy.get("/v1/budget")).json()["upstreams"]}

    assert view["a"]["model"] == "judge" and view["b"]["model"] == "other"
    assert (view["a"]["tpm"], view["a"]["rpm"], view["a"]["max_concurrency"]) == (90_000, 900, 7)
    assert (view["a"]["used_tokens_total"], view["a"]["used_requests_total"]) == (usage["total_tokens"], 1)
    assert view["a"]["available_tokens"] == pytest.approx(90_000 - usage["total_tokens"], abs=50)
    assert view["a"]["inflight"] == 0 and view["b"]["used_requests_total"] == 0


JUDGE_METRICS = [
    "tandem_judge_budget_tokens_per_minute",
    "tandem_judge_budget_requests_per_minute",
    "tandem_judge_tokens_total",
    "tandem_judge_upstream_requests_total",
    "tandem_judge_upstream_429_total",
    "tandem_judge_rejected_total",
    "tandem_judge_queue_wait_seconds_bucket",
    "tandem_judge_upstream_latency_seconds_bucket",
    "tandem_judge_reconciliation_error_tokens_bucket",
    "tandem_judge_verdicts_total",
]


async def test_the_metrics_dashboards_use_are_exported(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]), max_attempts=1)
    await upstreams["a"].script({"status": 429, "retry_after_ms": 10}, {"content": '{"correctness": 7}'})
    await proxy.post("/v1/chat/completions", json=chat())
    await proxy.post(
        "/v1/judge", json={"rubric": "accuracy", "reference": "4", "messages": [{"role": "user", "content": "2+2?"}]}
    )

    exported = (await proxy.get("/metrics")).text

    for name in JUDGE_METRICS:
        assert f"\n{name}{{" in exported, name


# --- /v1/judge -------------------------------------------------------------------------------


def conversation() -> list[dict]:
    return [
        {"role": "user", "content": "Plan me a trip."},
        {"role": "assistant", "content": "Where to, and for how long?"},
    ]


async def test_judge_scores_interactivity_as_the_mean_of_its_three_criteria(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    verdict = (
        'It asks the two questions that matter. {"understanding": 8, "clarification": 9, '
        '"suggestions": 1, "verdict": "Good questions, no suggestions."}'
    )
    await upstreams["a"].script({"content": verdict})

    response = await proxy.post("/v1/judge", json={"rubric": "interactivity", "messages": conversation()})

    assert response.status_code == 200
    body = response.json()
    assert body["criteria"] == {"understanding": 0.8, "clarification": 0.9, "suggestions": 0.1}
    assert body["score"] == pytest.approx(0.6)
    assert body["verdict"] == "Good questions, no suggestions." and body["raw"] == verdict
    assert body["usage"]["total_tokens"] > 0
    sent = (await upstreams["a"].requests())[-1]
    assert sent["temperature"] == 0.0 and sent["max_tokens"] == 400
    assert "understanding" in sent["messages"][0]["content"]
    assert "Where to, and for how long?" in sent["messages"][1]["content"]


async def test_an_unreadable_verdict_is_asked_again_once_with_a_stricter_instruction(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    await upstreams["a"].script(
        {"content": "I think it is quite good."},
        {"content": "<understanding>9</understanding><clarification>3</clarification><suggestions>6</suggestions>"},
    )

    response = await proxy.post("/v1/judge", json={"rubric": "interactivity", "messages": conversation()})

    assert response.status_code == 200 and response.json()["score"] == pytest.approx(0.6)
    retry = (await upstreams["a"].requests())[-1]
    assert retry["messages"][-2] == {"role": "assistant", "content": "I think it is quite good."}
    assert "exactly one JSON object" in retry["messages"][-1]["content"]


async def test_a_verdict_unreadable_twice_is_an_error_with_the_raw_replies_and_no_score(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    await upstreams["a"].script({"content": "meh"}, {"content": "still meh: 8/10"})

    response = await proxy.post("/v1/judge", json={"rubric": "helpfulness", "messages": conversation()})

    assert response.status_code == 502
    body = response.json()
    assert body["error"]["type"] == "unparseable_verdict"
    assert body["raw"] == ["meh", "still meh: 8/10"] and "score" not in body
    assert (await upstreams["a"].stats())["requests"] == 2


async def test_accuracy_judges_against_the_reference_and_needs_one(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    await upstreams["a"].script({"content": '{"correctness": 10, "verdict": "Same number."}'})
    messages = [{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "It is 42."}]

    judged = await proxy.post("/v1/judge", json={"rubric": "accuracy", "messages": messages, "reference": "42"})
    missing = await proxy.post("/v1/judge", json={"rubric": "accuracy", "messages": messages})

    assert judged.status_code == 200 and judged.json()["score"] == 1.0
    assert "<reference>\n42\n</reference>" in (await upstreams["a"].requests())[-1]["messages"][1]["content"]
    assert missing.status_code == 400 and "needs a reference" in missing.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"rubric": "vibes", "messages": [{"role": "user", "content": "hi"}]}, 404, "unknown rubric 'vibes'"),
        ({"rubric": "interactivity"}, 400, "messages: Field required"),
        (
            {"rubric": "interactivity", "messages": [{"role": "user", "content": "hi"}], "model": "nope"},
            404,
            "unknown model 'nope'",
        ),
    ],
)
async def test_a_bad_judge_request_gets_a_clear_error(make_proxy, upstreams, body, status, message):
    proxy = await make_proxy(entry("a", upstreams["a"]))

    response = await proxy.post("/v1/judge", json=body)

    assert response.status_code == status and message in response.json()["error"]["message"]


@pytest.mark.parametrize("named", ["m" * 10_000, {"nested": "object"}, None])
async def test_a_verdict_records_the_judge_model_a_provider_names_short_and_as_a_string(make_proxy, upstreams, named):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    verdict = '{"understanding": 8, "clarification": 9, "suggestions": 1, "verdict": "Fine."}'
    await upstreams["a"].script({"content": verdict, "model": named})

    body = (await proxy.post("/v1/judge", json={"rubric": "interactivity", "messages": conversation()})).json()

    assert body["model"] == ("m" * 128 if isinstance(named, str) else "") and body["score"] == pytest.approx(0.6)
    assert len(body["rubric_sha256"]) == 64


async def test_a_structured_upstream_is_asked_for_the_verdict_schema_and_says_so_in_its_model_card(
    make_proxy, upstreams
):
    from judge_proxy.rubrics import RUBRICS, verdict_schema

    proxy = await make_proxy(entry("a", upstreams["a"], structured_output=True))
    await upstreams["a"].script(
        {"content": '{"understanding": 8, "clarification": 9, "suggestions": 1, "verdict": "Fine."}'}
    )

    assert (
        await proxy.post("/v1/judge", json={"rubric": "interactivity", "messages": conversation()})
    ).status_code == 200
    sent = (await upstreams["a"].requests())[-1]
    assert sent["response_format"]["json_schema"]["schema"] == verdict_schema(RUBRICS["interactivity"])
    assert "Reply with only one JSON object" in sent["messages"][0]["content"]
    assert (await proxy.get("/v1/models/judge")).json()["structured_output"] is True
