"""What a job's calls cost, charged by the real proxy (in-process, ASGI) in front of the
stand-in provider with its prompt cache, on a real Redis: the job's `spend` hash against
the usage the provider reported, priced by hand; and the learner's step records of it."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from devtools.provider import LocalUpstreamConfig, serve_in_thread
from devtools.provider import create_app as stand_in_app
from judge_proxy.app import create_app
from judge_proxy.spend import Bill, Held, JobSpend, Refusal
from learner.cost import CostMeter
from services import bills, protocol
from services.auth import job_credential
from services.config import BudgetSpec, JudgeProxySettings
from services.queues import Keys
from tandem.redis_embed import free_port

PRICES = {"input_per_mtok": 3.0, "output_per_mtok": 15.0, "cached_input_per_mtok": 0.3}
SAMPLE = protocol.Sample(
    sample_id="s", tokens=[1], mask=[1], logprobs=[-0.1], versions=[0], reward=0.0, advantage=0.0, num_turns=1
)
SYSTEM = {"role": "system", "content": "You play a person who wants a fruit and knows which one."}
SYSTEM_ONLY = [SYSTEM, {"role": "user", "content": "Which fruit?"}]


@pytest.fixture(scope="module")
def stand_in():
    config = LocalUpstreamConfig(tpm=6_000_000, rpm=60_000, service_ms=0, seed=1, prompt_cache=True)
    with serve_in_thread(stand_in_app(config), free_port()) as url:
        yield url


@pytest.fixture
async def proxy(stand_in, redis_url, redis_client, tmp_path):
    httpx.post(f"{stand_in}/admin/reset").raise_for_status()
    await redis_client.flushdb()
    entries = [{"name": "priced", "model": "judge", "upstream_model": "local-model", "base_url": f"{stand_in}/v1"}]
    entries[0] |= {"tpm": 600_000, "rpm": 6000}
    entries[0]["prices"] = PRICES
    path = tmp_path / "upstreams.json"
    path.write_text(json.dumps({"upstreams": entries}))
    app = create_app(JudgeProxySettings(redis_url=redis_url, upstreams=str(path)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=30) as client:
        yield client
    await app.state.proxy.aclose()


async def ask(proxy, messages: list[dict], role: str = "", job: str = "job-a", **extra) -> httpx.Response:
    headers = {"x-tandem-job": job} | ({"x-tandem-role": role} if role else {})
    body = {"model": "judge", "messages": messages, "max_tokens": 20, "temperature": 0.0, **extra}
    return await proxy.post("/v1/chat/completions", json=body, headers=headers)


def usd(usage: dict) -> float:
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    fresh = usage["prompt_tokens"] - cached
    return (fresh * 3.0 + cached * 0.3 + usage["completion_tokens"] * 15.0) / 1e6


async def spend(redis_client, job: str, key: str = "") -> dict[str, float]:
    """A job's spend hash (or the one at `key`), its numbers (not `refused_by`)."""
    raw = await redis_client.hgetall(key or Keys.job_spend(job))
    return {k.decode(): float(v) for k, v in raw.items() if k != b"refused_by"}


async def test_each_call_is_charged_to_its_job_and_role_at_its_upstreams_prices(proxy, redis_client):
    first = [SYSTEM, {"role": "user", "content": "Which fruit do you want?"}]
    second = [*first, {"role": "assistant", "content": "A pear."}, {"role": "user", "content": "Ripe or not?"}]
    # The third is not at temperature 0, so the proxy's memory does not answer it for free.
    replies = [await ask(proxy, first), await ask(proxy, second), await ask(proxy, first, "eval", temperature=0.7)]
    usages = [r.raise_for_status().json()["usage"] for r in replies]

    # The second call began with the first's two messages: the provider billed them as cached.
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < usages[1]["prompt_tokens_details"]["cached_tokens"] < usages[1]["prompt_tokens"]
    charged = await spend(redis_client, "job-a")
    assert charged["usd:simulator"] == pytest.approx(usd(usages[0]) + usd(usages[1]))
    assert charged["usd:eval"] == pytest.approx(usd(usages[2]))
    assert charged["tokens:simulator"] == usages[0]["total_tokens"] + usages[1]["total_tokens"]
    assert charged["cached:simulator"] == usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert charged["cached:eval"] == usages[2]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again
    assert (charged["calls:simulator"], charged["calls:eval"]) == (2, 1)
    assert await spend(redis_client, "job-b") == {}  # another job paid nothing


async def test_a_verdict_is_charged_as_the_judges(proxy, redis_client):
    conversation = [{"role": "user", "content": "I want a fruit."}, {"role": "assistant", "content": "Which one?"}]
    reply = await proxy.post(
        "/v1/judge", json={"rubric": "interactivity", "messages": conversation}, headers={"x-tandem-job": "job-j"}
    )
    verdict = reply.raise_for_status().json()
    charged = await spend(redis_client, "job-j")
    assert set(charged) == {"usd:judge", "tokens:judge", "cached:judge", "calls:judge"}
    assert charged["tokens:judge"] == sum(verdict["usage"][k] for k in ("prompt_tokens", "completion_tokens"))
    assert charged["usd:judge"] > 0


async def test_a_provider_whose_usage_does_not_add_up_is_billed_the_budgets_count_at_the_dearer_price(
    proxy, redis_client, stand_in
):
    httpx.post(f"{stand_in}/admin/script", json={"replies": [{"usage": {"prompt_tokens": 10**9}}]}).raise_for_status()
    reply = await ask(proxy, [{"role": "user", "content": "hello"}], job="job-x")
    usage = reply.raise_for_status().json()["usage"]
    assert usage["prompt_tokens"] == 10**9  # passed through as reported; its total is the honest count
    charged = await spend(redis_client, "job-x")
    assert charged["tokens:simulator"] == usage["total_tokens"] < 100  # what the budget billed
    assert charged["usd:simulator"] == pytest.approx(usage["total_tokens"] * 15 / 1e6)  # not 10**9 tokens


async def test_an_unknown_role_is_400_naming_the_roles_and_charges_nothing(proxy, redis_client):
    reply = await ask(proxy, [{"role": "user", "content": "hello"}], role="free", job="job-r")
    assert reply.status_code == 400 and "X-Tandem-Role must be one of" in reply.text
    assert await spend(redis_client, "job-r") == {}


async def test_the_learners_step_records_price_steps_and_project_the_end_by_hand(redis_client):
    meter = CostMeter(redis_client, "job-m")
    key = Keys.job_spend("job-m")
    await redis_client.hset(key, mapping={"usd:eval": 0.5, "calls:eval": 4})  # round 0, before step 1
    await meter.begin(0)
    group = protocol.TrajectoryGroup(job_id="job-m", task_id=0, samples=[SAMPLE] * 4, server_id="s", elapsed_s=0.0)

    await redis_client.hset(key, mapping={"usd:simulator": 0.6, "usd:judge": 0.4, "tokens:judge": 900})
    first = await meter.after_step(1, [group, group], total_steps=10)
    assert first["cost_usd"] == pytest.approx(1.5) and first["cost_usd_step"] == pytest.approx(1.0)
    assert first["cost_usd_per_sample"] == pytest.approx(1.0 / 8)  # 2 groups of 4
    assert first["cost_usd_projected"] == pytest.approx(1.5 + 1.0 * 9)
    assert (first["cost_usd_judge"], first["cost_usd_eval"], first["cost_tokens"]) == (0.4, 0.5, 900.0)

    await redis_client.hincrbyfloat(key, "usd:judge", 0.5)
    second = await meter.after_step(2, [group], total_steps=10)
    assert second["cost_usd_step"] == pytest.approx(0.5)
    assert second["cost_usd_projected"] == pytest.approx(2.0 + (2.0 - 0.5) / 2 * 8)  # this run's mean step: 0.75


@pytest.mark.parametrize("cap, limit", [("usd", 0.002), ("tokens", 200)])
async def test_no_call_is_made_that_could_take_a_job_past_its_cap(proxy, redis_client, stand_in, cap, limit):
    spec = {"model": {"path": "/models/tiny"}, "budget": {cap: limit}}
    await redis_client.hset(Keys.job("job-cap"), mapping={"spec": json.dumps(spec)})
    refused = None
    for turn in range(100):  # each call holds ~40 tokens at $15/M ($0.0006): either cap ends it in a few
        reply = await ask(proxy, [{"role": "user", "content": f"question {turn}"}], job="job-cap", temperature=0.7)
        if reply.status_code != 200:
            refused = reply
            break
    assert refused is not None and refused.status_code == 402
    assert refused.json()["error"]["type"] == "spend_cap_reached" and "job-cap" in refused.json()["error"]["message"]
    stats = httpx.get(f"{stand_in}/admin/stats").json()
    charged = await spend(redis_client, "job-cap")
    assert stats["accepted"] == charged["calls:simulator"] == turn  # the refused call never went upstream
    assert turn >= 2 and charged[f"{cap}:simulator"] <= limit  # the cap holds; nothing is held once calls settle
    assert f"${charged['usd:simulator']:.4f} and {charged['tokens:simulator']:.0f} tokens spent" in refused.text
    refused_by = await redis_client.hget(Keys.job_spend("job-cap"), "refused_by")
    assert refused_by == f"the job's spend cap ({cap} {limit})".encode()
    assert charged["held_usd"] == pytest.approx(0.0, abs=1e-12) and charged["held_tokens"] == 0
    # Another job, without a cap, is not held back.
    assert (await ask(proxy, [{"role": "user", "content": "hello"}], job="job-free")).status_code == 200
    # A cap raised since the proxy read it (a resume) counts at once, not after its cache's 10 s.
    await redis_client.hset(Keys.job("job-cap"), "spec", json.dumps({**spec, "budget": {cap: limit * 100}}))
    await redis_client.hdel(Keys.job_spend("job-cap"), "refused", "refused_by")
    assert (await ask(proxy, [{"role": "user", "content": "again"}], job="job-cap", temperature=0.7)).status_code == 200
    assert await redis_client.hget(Keys.job_spend("job-cap"), "refused") is None


async def test_a_tenants_month_is_capped_across_its_jobs_and_other_tenants_are_not_held_back(
    proxy, redis_client, stand_in
):
    await bills.write_caps(redis_client, BudgetSpec(usd=0.002))
    spec = json.dumps({"model": {"path": "/models/tiny"}})
    for job, tenant in (("job-t1", "acme"), ("job-t2", "acme"), ("job-o", "other")):
        await redis_client.hset(Keys.job(job), mapping={"spec": spec, "tenant": tenant})
    refused, turn = None, 0
    for turn in range(100):  # each call holds ~40 tokens at $15/M ($0.0006): the cap ends it in a few
        job = ("job-t1", "job-t2")[turn % 2]  # two jobs of one tenant, neither with a cap of its own
        reply = await ask(proxy, [{"role": "user", "content": f"question {turn}"}], job=job, temperature=0.7)
        if reply.status_code != 200:
            refused = reply
            break
    assert refused is not None and refused.status_code == 402, refused
    label = f"the spend cap of tenant 'acme' for {bills.period()} (usd 0.002)"
    assert refused.json()["error"]["type"] == "spend_cap_reached" and label in refused.json()["error"]["message"]
    month = await spend(redis_client, "", Keys.tenant_spend("acme", bills.period()))
    first, second = await spend(redis_client, "job-t1"), await spend(redis_client, "job-t2")
    assert stats_accepted(stand_in) == month["calls:simulator"] == turn >= 2  # the refused call never went upstream
    assert month["usd:simulator"] == pytest.approx(first["usd:simulator"] + second["usd:simulator"])
    assert month["usd:simulator"] <= 0.002
    assert month["held_usd"] == pytest.approx(0.0, abs=1e-12) and month["held_tokens"] == 0
    # The refused job's own bill says which cap refused it, for the learner to end it on.
    refused_job = ("job-t1", "job-t2")[turn % 2]
    assert await redis_client.hget(Keys.job_spend(refused_job), "refused_by") == label.encode()
    assert (await spend(redis_client, refused_job))["refused"] == 1
    # Another tenant's job is not held back; its month is its own.
    assert (await ask(proxy, [{"role": "user", "content": "hello"}], job="job-o")).status_code == 200
    assert (await spend(redis_client, "", Keys.tenant_spend("other", bills.period())))["calls:simulator"] == 1


def stats_accepted(stand_in: str) -> int:
    return httpx.get(f"{stand_in}/admin/stats").json()["accepted"]


async def test_a_caller_reads_only_its_own_jobs_bill(stand_in, redis_url, redis_client, tmp_path):
    entries = [{"name": "priced", "model": "judge", "upstream_model": "local-model", "base_url": f"{stand_in}/v1"}]
    entries[0] |= {"tpm": 600_000, "rpm": 6000}
    entries[0]["prices"] = PRICES
    path = tmp_path / "upstreams.json"
    path.write_text(json.dumps({"upstreams": entries}))
    app = create_app(JudgeProxySettings(redis_url=redis_url, upstreams=str(path), client_tokens="secret"))
    await redis_client.hset(Keys.job_spend("job-b"), mapping={"usd:judge": 0.5, "calls:judge": 2})
    as_a = {"authorization": f"Bearer {job_credential('secret', 'job-a')}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as proxy:
        asked = await proxy.post("/v1/chat/completions", json={"model": "judge", "messages": SYSTEM_ONLY}, headers=as_a)
        own = await proxy.get("/v1/spend", headers=as_a)
        other = await proxy.get("/v1/spend", headers=as_a | {"x-tandem-job": "job-b"})  # job-b's bill is not a's
        no_job = await proxy.get("/v1/spend", headers={"authorization": "Bearer secret"})
        anonymous = await proxy.get("/v1/spend", headers={"x-tandem-job": "job-b"})
    await app.state.proxy.aclose()

    assert asked.status_code == 200
    assert own.status_code == 200 and own.json()["job"] == "job-a" and own.json()["calls"] == 1
    assert own.json()["usd"] == pytest.approx(usd(asked.json()["usage"]))
    assert (other.status_code, no_job.status_code, anonymous.status_code) == (403, 400, 401)
    assert "job-b" not in no_job.text and "0.5" not in other.text


async def test_a_hold_its_proxy_never_gave_back_expires_and_the_cap_frees_its_room(redis_client):
    # A proxy killed with a call in flight never releases its hold: the hold expires.
    spend = JobSpend(redis_client)
    key = Keys.job_spend("job-k")
    bill = Bill(key, BudgetSpec(usd=1.0), "the job's spend cap (usd 1.0)")
    # TTLs of 2 s: the few Redis round trips before the sleep take milliseconds, not seconds.
    lost = await spend.hold([bill], 0.7, 100, ttl_s=2.0)  # its proxy dies now
    assert isinstance(lost, Held)
    refused = await spend.hold([bill], 0.5, 100, ttl_s=30)
    assert isinstance(refused, Refusal) and refused.wait  # the lost hold leaves no room yet
    kept = await spend.hold([bill], 0.2, 50, ttl_s=2.0)
    assert isinstance(kept, Held)
    await spend.renew(kept, ttl_s=30)  # a stream still arriving keeps its hold
    await asyncio.sleep(2.5)
    second = await spend.hold([bill], 0.5, 100, ttl_s=30)  # the lost hold is dropped on the way
    assert isinstance(second, Held)
    assert float(await redis_client.hget(key, "held_usd")) == pytest.approx(0.2 + 0.5)
    await spend.release(lost)  # a late release of an expired hold gives nothing back twice
    await spend.release(kept)
    await spend.release(second)
    assert float(await redis_client.hget(key, "held_usd")) == pytest.approx(0.0, abs=1e-12)
    assert int(await redis_client.hget(key, "held_tokens")) == 0
    assert await redis_client.zcard(Keys.cap_holds(key)) == 0
