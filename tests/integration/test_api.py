"""The job API against a real Redis, in-process (httpx ASGI transport)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from services import bills, jobs
from services.api.app import create_app
from services.config import ApiSettings, parse_job_spec
from services.queues import Keys

SPEC = {"name": "t", "model": {"path": "/models/tiny"}}


@pytest.fixture
async def api(redis_url, redis_client):
    app = create_app(ApiSettings(redis_url=redis_url))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        yield client


async def test_a_submitted_job_is_pending_listed_and_queued_for_a_learner(api, redis_client):
    created = await api.post("/v1/jobs", json=SPEC)
    assert created.status_code == 201
    job_id = created.json()["id"]

    job = (await api.get(f"/v1/jobs/{job_id}")).json()
    assert job["status"] == "PENDING" and job["spec"]["model"]["path"] == "/models/tiny"
    assert job["spec"]["train"]["max_staleness"] == 1  # defaults filled in
    assert [j["id"] for j in (await api.get("/v1/jobs")).json()] == [job_id]
    assert await redis_client.zrange(Keys.jobs_queued(""), 0, -1) == [job_id.encode()]


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"name": "t"}, ["body", "model"]),
        ({**SPEC, "train": {"lr": -1}}, ["body", "train", "lr"]),
        ({**SPEC, "train": {"max_staleness": "soon"}}, ["body", "train", "max_staleness"]),
        ({**SPEC, "train": {"stragglers": "forget"}}, ["body", "train", "stragglers"]),
        ({**SPEC, "train": {"export_every": -5}}, ["body", "train", "export_every"]),
        ({**SPEC, "train": {"max_token_staleness": -1}}, ["body", "train", "max_token_staleness"]),
        ({**SPEC, "train": {"max_token_staleness": 10**9}}, ["body", "train", "max_token_staleness"]),
        (  # a token bound in a mode that never admits a late group
            {**SPEC, "train": {"stragglers": "drop", "max_token_staleness": 4}},
            ["body", "train", "max_token_staleness"],
        ),
        (  # a token bound under eta would mask what the dispatcher deliberately kept
            {**SPEC, "train": {"stragglers": "admit", "max_staleness": 3, "max_token_staleness": 1}},
            ["body", "train", "max_token_staleness"],
        ),
        ({**SPEC, "train": {"export_every": "../../etc"}}, ["body", "train", "export_every"]),
        ({**SPEC, "rollout": {"group_size": 0}}, ["body", "rollout", "group_size"]),
        ({**SPEC, "reward": {"mode": "vibes"}}, ["body", "reward", "mode"]),
        ({**SPEC, "surprise": 1}, ["body", "surprise"]),
        ({**SPEC, "budget": {"usd": -5}}, ["body", "budget", "usd"]),  # a cap no call fits, or a sign trick
        ({**SPEC, "budget": {"usd": 0}}, ["body", "budget", "usd"]),
        ({**SPEC, "budget": {"tokens": 1.5}}, ["body", "budget", "tokens"]),
        ({**SPEC, "budget": {"usd": "infinite"}}, ["body", "budget", "usd"]),
        ({**SPEC, "budget": {"usd": 5, "held_usd": -100}}, ["body", "budget", "held_usd"]),
        ({**SPEC, "health": [{"metric": "vibes", "above": 1}]}, ["body", "health", 0, "metric"]),
        ({**SPEC, "health": [{"metric": "entropy", "below": 0.1, "steps": 0}]}, ["body", "health", 0, "steps"]),
        ({**SPEC, "health": [{"metric": "entropy"}]}, ["body", "health", 0]),  # neither above nor below
        ({**SPEC, "tools": {"tools": [{"name": "abacus", "kind": "abacus"}]}}, ["body", "tools", "tools", 0, "kind"]),
        (
            {**SPEC, "tools": {"parser": "qwen9", "tools": [{"name": "c", "kind": "calculator"}]}},
            ["body", "tools", "parser"],
        ),
    ],
)
async def test_a_malformed_spec_gets_422_naming_the_field(api, redis_client, spec, field):
    response = await api.post("/v1/jobs", json=spec)

    assert response.status_code == 422
    assert field in [error["loc"] for error in response.json()["detail"]]
    assert await redis_client.keys(Keys.jobs_queued("*")) == []


async def test_malformed_json_gets_422_and_the_api_keeps_serving(api):
    response = await api.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert (await api.get("/healthz")).status_code == 200


async def test_unknown_job_is_404(api):
    assert (await api.get("/v1/jobs/nope")).status_code == 404


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", ""),
        ("GET", "/history"),
        ("GET", "/checkpoints"),
        ("GET", "/conversations"),
        ("GET", "/groups"),
        ("GET", "/events"),
        ("POST", "/cancel"),
    ],
)
async def test_an_id_naming_a_sub_key_or_a_record_without_a_spec_is_404(api, redis_client, method, path):
    job_id = (await api.post("/v1/jobs", json=SPEC)).json()["id"]
    await redis_client.xadd(Keys.tasks(job_id), {"m": "x"})  # a stream: HGETALL fails WRONGTYPE
    await redis_client.hset(Keys.weights(job_id), "version", 1)  # a hash without a spec
    await redis_client.hset(Keys.job("t-0123abcd"), "rollout_error", "late")  # ditto, well-formed id

    for bad in (f"{job_id}:tasks", f"{job_id}:weights", "t-0123abcd"):
        response = await api.request(method, f"/v1/jobs/{bad}{path}")
        assert response.status_code == 404, (bad, response.text)
        assert response.json() == {"detail": f"no job {bad!r}"}


async def test_cancelling_a_pending_job_ends_it_and_a_running_one_is_flagged(api, redis_client):
    pending = (await api.post("/v1/jobs", json=SPEC)).json()["id"]
    assert (await api.post(f"/v1/jobs/{pending}/cancel")).json()["status"] == "CANCELLED"

    running = (await api.post("/v1/jobs", json=SPEC)).json()["id"]
    await redis_client.hset(Keys.job(running), "status", "RUNNING")
    assert (await api.post(f"/v1/jobs/{running}/cancel")).json()["status"] == "RUNNING"
    assert await redis_client.hget(Keys.job(running), "cancel_requested") == b"1"


TOKENS = "alpha-token-0123456789:alpha,beta-token-9876543210:beta"


@pytest.fixture
async def secured(redis_url, redis_client):
    app = create_app(ApiSettings(redis_url=redis_url, tokens=TOKENS, max_body_bytes=4096))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        yield client


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def test_no_or_a_wrong_token_is_401(secured):
    assert (await secured.post("/v1/jobs", json=SPEC)).status_code == 401
    response = await secured.get("/v1/jobs", headers=bearer("alpha-token-0123456788"))
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert (await secured.get("/v1/jobs", headers={"Authorization": "Basic alpha-token-0123456789"})).status_code == 401
    assert (await secured.get("/healthz")).status_code == 200  # probes need no token


async def test_a_tenant_sees_and_controls_only_its_own_jobs(secured):
    alpha = (await secured.post("/v1/jobs", json=SPEC, headers=bearer("alpha-token-0123456789"))).json()["id"]

    for path in ("", "/history", "/checkpoints", "/conversations", "/groups"):
        assert (
            await secured.get(f"/v1/jobs/{alpha}{path}", headers=bearer("beta-token-9876543210"))
        ).status_code == 403
    assert (await secured.post(f"/v1/jobs/{alpha}/cancel", headers=bearer("beta-token-9876543210"))).status_code == 403
    assert (await secured.get("/v1/jobs", headers=bearer("beta-token-9876543210"))).json() == []
    assert [j["id"] for j in (await secured.get("/v1/jobs", headers=bearer("alpha-token-0123456789"))).json()] == [
        alpha
    ]


@pytest.mark.parametrize("page", [2, jobs.LIST_PAGE])
async def test_a_tenant_lists_its_newest_jobs_however_many_newer_jobs_others_have(secured, monkeypatch, page):
    monkeypatch.setattr(jobs, "LIST_PAGE", page)
    alpha, beta = bearer("alpha-token-0123456789"), bearer("beta-token-9876543210")
    submitted = {"alpha": [], "beta": []}
    for who, headers in [("alpha", alpha), ("beta", beta), ("beta", beta), ("alpha", alpha)] + [("beta", beta)] * 5:
        submitted[who].append((await secured.post("/v1/jobs", json=SPEC, headers=headers)).json()["id"])

    async def ids(headers: dict, limit: int) -> list[str]:
        return [j["id"] for j in (await secured.get(f"/v1/jobs?limit={limit}", headers=headers)).json()]

    assert await ids(alpha, 1) == submitted["alpha"][::-1][:1]
    assert await ids(alpha, 2) == await ids(alpha, 100) == submitted["alpha"][::-1]
    assert await ids(beta, 3) == submitted["beta"][::-1][:3]
    assert await ids(beta, 7) == submitted["beta"][::-1]


async def test_tokens_never_reach_the_logs(secured, caplog):
    caplog.set_level("DEBUG")
    await secured.post("/v1/jobs", json=SPEC, headers=bearer("alpha-token-0123456789"))
    await secured.get("/v1/jobs", headers=bearer("beta-token-9876543210"))
    await secured.get("/v1/jobs", headers=bearer("not-a-token-at-all"))
    assert "token-" not in caplog.text and "not-a-token" not in caplog.text


async def test_a_body_over_the_limit_is_413(secured):
    big = {**SPEC, "name": "x" * 5000}
    response = await secured.post("/v1/jobs", json=big, headers=bearer("alpha-token-0123456789"))
    assert response.status_code == 413


async def test_events_stream_steps_and_statuses_until_the_job_ends(api, redis_client):
    import json

    job_id = (await api.post("/v1/jobs", json=SPEC)).json()["id"]
    await redis_client.hset(Keys.job(job_id), "status", "RUNNING")
    await redis_client.rpush(Keys.history(job_id), json.dumps({"phase": "rl", "step": 1}))
    await redis_client.hset(Keys.job(job_id), "status", "SUCCEEDED")

    body = (await api.get(f"/v1/jobs/{job_id}/events")).text
    events = [(block.split("\n")[0], json.loads(block.split("data: ", 1)[1])) for block in body.strip().split("\n\n")]
    assert events == [
        ("event: step", {"phase": "rl", "step": 1}),
        ("event: status", {"id": job_id, "status": "SUCCEEDED", "step": 0, "version": 0, "error": None}),
    ]


async def test_a_stop_rule_is_streamed_as_a_health_event_and_named_in_the_status_and_alerts(api, redis_client):
    import json

    from services import jobs

    reason = "health rule (stop): zero_spread_share > 0.9 for 1 steps (step 1: 1)"
    job_id = (await api.post("/v1/jobs", json=SPEC)).json()["id"]
    await redis_client.hset(Keys.job(job_id), "status", "RUNNING")
    await redis_client.rpush(Keys.history(job_id), json.dumps({"phase": "rl", "step": 1, "health": [reason]}))
    await jobs.add_alert(redis_client, job_id, reason)
    await jobs.set_status(redis_client, job_id, jobs.JobStatus.FAILED, reason)

    body = (await api.get(f"/v1/jobs/{job_id}/events")).text
    events = [(block.split("\n")[0], json.loads(block.split("data: ", 1)[1])) for block in body.strip().split("\n\n")]
    assert events[1:] == [
        ("event: health", {"message": reason}),
        ("event: status", {"id": job_id, "status": "FAILED", "step": 0, "version": 0, "error": reason}),
    ]
    job = (await api.get(f"/v1/jobs/{job_id}")).json()
    assert (job["status"], job["error"], job["alerts"]) == ("FAILED", reason, [reason])


async def test_a_paused_job_shows_why_and_since_when_and_a_cancel_reaches_it(api, redis_client):
    from services import jobs

    reason = "every upstream of model 'judge' is down: stand-in: HTTP 503 since 2026-11-26T09:00:00Z (5 failures)"
    job_id = (await api.post("/v1/jobs", json=SPEC)).json()["id"]
    await jobs.set_status(redis_client, job_id, jobs.JobStatus.RUNNING)
    before = time.time()
    assert await jobs.pause(redis_client, job_id, reason)

    job = (await api.get(f"/v1/jobs/{job_id}")).json()
    assert (job["status"], job["paused_reason"]) == ("PAUSED", reason)
    assert before <= job["paused_since"] <= time.time()
    cancelled = (await api.post(f"/v1/jobs/{job_id}/cancel")).json()
    assert cancelled["status"] == "PAUSED"  # the learner ends it at its next look
    assert await jobs.cancel_requested(redis_client, job_id)

    await jobs.set_status(redis_client, job_id, jobs.JobStatus.CANCELLED)
    body = (await api.get(f"/v1/jobs/{job_id}/events")).text
    assert '"status": "CANCELLED"' in body and "paused_reason" not in body


async def test_a_running_job_whose_learner_went_silent_says_so_and_one_that_beats_does_not(api, redis_client):
    from services import jobs

    job_id = (await api.post("/v1/jobs", json=SPEC)).json()["id"]
    await jobs.set_status(redis_client, job_id, jobs.JobStatus.RUNNING)
    await redis_client.hset(Keys.job(job_id), "learner_seen", time.time() - 2)
    assert (await api.get(f"/v1/jobs/{job_id}")).json()["warning"] is None

    await redis_client.hset(Keys.job(job_id), "learner_seen", time.time() - jobs.LEARNER_SILENT_S - 10)
    warning = (await api.get(f"/v1/jobs/{job_id}")).json()["warning"]
    assert warning.startswith("the learner has not been heard from for 4")  # 40 s, give or take a second
    assert "--resume" in warning

    await jobs.set_status(redis_client, job_id, jobs.JobStatus.FAILED, "x")
    assert (await api.get(f"/v1/jobs/{job_id}")).json()["warning"] is None  # an ended job waits on nobody


async def test_checkpoints_the_learner_recorded_are_listed(api, redis_client):
    import json

    job_id = (await api.post("/v1/jobs", json=SPEC)).json()["id"]
    await redis_client.rpush(
        Keys.checkpoints(job_id), json.dumps({"step": 3, "version": 3, "path": "/runs/c", "time": 1.0})
    )
    assert (await api.get(f"/v1/jobs/{job_id}/checkpoints")).json() == [
        {"step": 3, "version": 3, "path": "/runs/c", "time": 1.0}
    ]


async def test_steps_a_resumed_learner_runs_again_are_streamed_again(redis_client, monkeypatch):
    import asyncio
    import json

    from services.api import events as api_events

    monkeypatch.setattr(api_events, "SSE_IDLE_POLL_S", 0.01)
    job_id = await jobs.create_job(redis_client, parse_job_spec(SPEC))
    await redis_client.hset(Keys.job(job_id), "status", "RUNNING")
    history = Keys.history(job_id)
    await redis_client.rpush(history, *[json.dumps({"step": s, "run": 1}) for s in (1, 2, 3)])
    events = api_events.job_events(redis_client, job_id, api_events.JobChanges(redis_client))
    first = [await anext(events) for _ in range(4)]  # three steps, then the status

    # The learner crashed after step 3 and resumed from its step-1 checkpoint: it trims the
    # history back to step 1 and runs steps 2 and 3 again, as many records as before.
    await redis_client.ltrim(history, 0, 0)
    await redis_client.rpush(history, *[json.dumps({"step": s, "run": 2}) for s in (2, 3)])
    again = [json.loads((await asyncio.wait_for(anext(events), 5)).split("data: ", 1)[1]) for _ in range(2)]
    await events.aclose()

    assert [e.split("\n")[0] for e in first] == ["event: step"] * 3 + ["event: status"]
    assert again == [{"step": 2, "run": 2}, {"step": 3, "run": 2}]


async def test_a_history_redis_keeps_only_in_part_is_paged_by_its_global_index(api, redis_client, monkeypatch):
    import asyncio

    from services.api import events as api_events

    monkeypatch.setattr(api_events, "SSE_IDLE_POLL_S", 0.01)
    job_id = (await api.post("/v1/jobs", json=SPEC)).json()["id"]
    await redis_client.hset(Keys.job(job_id), "status", "RUNNING")
    for step in range(1, 9):
        await jobs.append_history(redis_client, job_id, json.dumps({"step": step}), keep=5)  # 1-3 dropped

    from_zero = await api.get(f"/v1/jobs/{job_id}/history", params={"start": 0})
    from_six = await api.get(f"/v1/jobs/{job_id}/history", params={"start": 6})
    events = api_events.job_events(redis_client, job_id, api_events.JobChanges(redis_client))
    streamed = [json.loads((await anext(events)).split("data: ", 1)[1])["step"] for _ in range(5)]
    await anext(events)  # the status
    # A resume back to record 5 (step 6): steps 6-8 run again; then one more step.
    await jobs.trim_history(redis_client, job_id, 5)
    for step in (6, 7, 8, 9):
        await jobs.append_history(redis_client, job_id, json.dumps({"step": step, "run": 2}), keep=5)
    again = [json.loads((await asyncio.wait_for(anext(events), 5)).split("data: ", 1)[1]) for _ in range(4)]
    await events.aclose()

    assert from_zero.headers["x-tandem-history-start"] == "3" and [r["step"] for r in from_zero.json()] == [
        4,
        5,
        6,
        7,
        8,
    ]
    assert from_six.headers["x-tandem-history-start"] == "6" and [r["step"] for r in from_six.json()] == [7, 8]
    assert streamed == [4, 5, 6, 7, 8]
    assert again == [{"step": s, "run": 2} for s in (6, 7, 8, 9)]


@pytest.fixture
def files(tmp_path):
    """An operator's roots (models, data) and, outside them, another job's checkpoint."""
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text("{}\n")
    (tmp_path / "runs" / "other-job" / "step-3").mkdir(parents=True)
    (tmp_path / "models" / "borrowed").symlink_to(tmp_path / "runs" / "other-job" / "step-3")
    (tmp_path / "models" / "loop").symlink_to(tmp_path / "models" / "loop")
    return tmp_path


@pytest.fixture
async def confined(redis_url, redis_client, files):
    roots = f"{files / 'models'},{files / 'data'}"
    app = create_app(ApiSettings(redis_url=redis_url, tokens=TOKENS, path_roots=roots))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://api", headers=bearer("alpha-token-0123456789")
    ) as client:
        yield client


@pytest.mark.parametrize(
    "field, escape",
    [
        (["model", "path"], "runs/other-job/step-3"),  # outside every root
        (["model", "path"], "models/borrowed"),  # a symlink in a root leading out
        (["model", "path"], "models/../runs/other-job/step-3"),  # '..' out of a root
        (["task", "data"], "/etc/passwd"),
        (["warm_start", "data"], "data/../runs/other-job/step-3/optimizer.pt"),
        (["eval", "data"], "/etc/shadow"),  # held-out rows are read like training rows
        (["model", "path"], "models/tiny\x00"),  # no file has such a name
        (["model", "path"], "models/loop"),  # a symlink to itself
    ],
)
async def test_a_tenants_path_outside_the_roots_gets_422_naming_the_field(confined, redis_client, files, field, escape):
    spec = {"name": "t", "model": {"path": str(files / "models" / "tiny")}}
    spec.setdefault(field[0], {})[field[1]] = escape if escape.startswith("/") else f"{files}/{escape}"

    response = await confined.post("/v1/jobs", json=spec)

    assert response.status_code == 422
    assert ["body", *field] in [error["loc"] for error in response.json()["detail"]]
    assert await redis_client.keys(Keys.jobs_queued("*")) == []


async def test_a_tenants_paths_inside_the_roots_are_accepted_as_resolved(confined, files):
    spec = {
        "name": "t",
        "model": {"path": f"{files}/data/../models/./tiny"},
        "task": {"name": "math_chat", "data": f"{files}/data/rows.jsonl"},
    }

    created = await confined.post("/v1/jobs", json=spec)

    assert created.status_code == 201
    job = (await confined.get(f"/v1/jobs/{created.json()['id']}")).json()
    assert (job["spec"]["model"]["path"], job["spec"]["task"]["data"]) == (
        str(files / "models" / "tiny"),
        str(files / "data" / "rows.jsonl"),
    )


async def test_without_tokens_the_local_operators_paths_are_not_confined(api):
    assert (
        await api.post("/v1/jobs", json={**SPEC, "task": {"name": "math_chat", "data": "/etc/passwd"}})
    ).status_code == 201


async def test_a_tools_file_that_holds_no_valid_tools_gets_422_naming_tools_file(api, redis_client, tmp_path):
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - {name: abacus, kind: abacus}\n")

    response = await api.post("/v1/jobs", json={**SPEC, "tools": {"file": str(bad)}})

    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "tools", "file"] and "abacus" in error["msg"]
    assert await redis_client.keys(Keys.jobs_queued("*")) == []


async def test_an_offline_jobs_pairs_file_with_a_bad_row_gets_422_naming_train_data_and_the_line(
    api, redis_client, tmp_path
):
    pairs = tmp_path / "pairs.jsonl"
    good = {"context_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4], "chosen_score": 1.0, "rejected_score": 0.0}
    pairs.write_text(json.dumps(good) + "\n" + json.dumps(good | {"chosen_ids": "three"}) + "\n")
    offline = {**SPEC, "kind": "offline", "train": {"algorithm": "dpo", "data": str(pairs)}}

    response = await api.post("/v1/jobs", json=offline)

    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "train", "data"]
    assert "line 2: chosen_ids is not a list of integers" in error["msg"]
    pairs.write_text(json.dumps(good) + "\n")
    assert (await api.post("/v1/jobs", json=offline)).status_code == 201


@pytest.mark.parametrize(
    "spec, says",
    [
        ({**SPEC, "kind": "offline", "train": {"algorithm": "dpo"}}, "train.data"),
        ({**SPEC, "kind": "offline", "train": {"data": "/tmp/p.jsonl"}}, "train.algorithm: dpo"),
        ({**SPEC, "train": {"algorithm": "dpo", "data": "/tmp/p.jsonl"}}, "kind: offline"),
        ({**SPEC, "kind": "generate"}, "reward.mode must be multiturn"),
        ({**SPEC, "kind": "replay"}, "'rl', 'offline' or 'generate'"),
    ],
)
async def test_a_job_kind_without_what_it_needs_gets_422_saying_what(api, redis_client, spec, says):
    response = await api.post("/v1/jobs", json=spec)

    assert response.status_code == 422
    assert says in json.dumps(response.json()["detail"])
    assert await redis_client.keys(Keys.jobs_queued("*")) == []


async def register_server(redis_client, server_id: str, job_id: str = "", age_s: float = 0.0) -> None:
    import time

    from services import protocol

    info = protocol.ServerInfo(
        server_id=server_id,
        heartbeat=time.time() - age_s,
        job_id=job_id,
        version=3,
        capacity=4,
        inflight=2,
        engine="/models/tiny",
    )
    await redis_client.hset(Keys.rollout_servers, server_id, protocol.encode(info))


async def test_an_operator_lists_drains_and_lifts_a_drain_on_rollout_servers(api, redis_client):
    await register_server(redis_client, "gpu-b", job_id="j-1")
    await register_server(redis_client, "gpu-a", age_s=30)
    await register_server(redis_client, "gpu-dead", age_s=2 * 3600)  # killed long ago: forgotten

    listed = (await api.get("/v1/rollout-servers")).json()
    drained = await api.post("/v1/rollout-servers/gpu-b/drain")
    lifted = await api.delete("/v1/rollout-servers/gpu-b/drain")

    assert [s["server_id"] for s in listed] == ["gpu-a", "gpu-b"]
    assert not await redis_client.hexists(Keys.rollout_servers, "gpu-dead")
    assert listed[0]["heartbeat_age_s"] >= 30 and listed[1]["job_id"] == "j-1"
    assert drained.status_code == 200 and drained.json()["drain_requested"] is True
    assert lifted.json()["drain_requested"] is False
    assert await redis_client.smembers(Keys.rollout_drain) == set()
    missing = await api.post("/v1/rollout-servers/gpu-z/drain")
    assert missing.status_code == 404 and "gpu-z" in missing.json()["detail"]


async def test_with_tokens_only_operators_reach_the_fleet(redis_url, redis_client):
    await register_server(redis_client, "gpu-a")
    app = create_app(ApiSettings(redis_url=redis_url, tokens=TOKENS, operators="alpha"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        refused = await client.post("/v1/rollout-servers/gpu-a/drain", headers=bearer("beta-token-9876543210"))
        allowed = await client.get("/v1/rollout-servers", headers=bearer("alpha-token-0123456789"))
        anonymous = await client.get("/v1/rollout-servers")

    assert refused.status_code == 403 and "not an operator" in refused.json()["detail"]
    assert await redis_client.smembers(Keys.rollout_drain) == set()
    assert allowed.status_code == 200 and [s["server_id"] for s in allowed.json()] == ["gpu-a"]
    assert anonymous.status_code == 401


async def test_membership_changes_are_listed_and_streamed(api, redis_client):
    job_id = (await api.post("/v1/jobs", json=SPEC)).json()["id"]
    change = {"time": 1.0, "servers": ["a", "b"], "joined": ["b"], "left": {"c": "no heartbeat for 7s"}}
    await redis_client.rpush(Keys.servers(job_id), json.dumps(change))
    await redis_client.hset(Keys.job(job_id), "status", "SUCCEEDED")

    listed = (await api.get(f"/v1/jobs/{job_id}/servers")).json()
    body = (await api.get(f"/v1/jobs/{job_id}/events")).text

    assert listed == [change]
    assert body.startswith(f"event: servers\ndata: {json.dumps(change)}\n\n")


async def test_a_fleet_record_that_does_not_decode_is_left_out_not_fatal(api, redis_client):
    await register_server(redis_client, "gpu-a")
    await redis_client.hset(Keys.rollout_servers, "garbage", b"\x93not msgpack of a server")

    listed = await api.get("/v1/rollout-servers")

    assert listed.status_code == 200 and [s["server_id"] for s in listed.json()] == ["gpu-a"]


async def test_a_fleet_record_that_does_not_decode_does_not_stop_a_jobs_learner(redis_client):
    from learner.publisher import WeightPublisher
    from services.config import LearnerSettings

    await register_server(redis_client, "gpu-a", job_id="t-0123abcd")
    await redis_client.hset(Keys.rollout_servers, "garbage", b"\xc1")
    publisher = WeightPublisher(redis_client, "t-0123abcd", LearnerSettings(), worker=None)

    assert await publisher.live_servers() == ["gpu-a"]


async def test_online_tracking_is_refused_naming_the_field_unless_the_operator_allows_it(api, redis_url, redis_client):
    """A tenant's job would have the learner send its numbers out under the operator's W&B key."""
    online = {**SPEC, "tracking": {"wandb": {"mode": "online"}}}

    refused = await api.post("/v1/jobs", json=online)

    assert refused.status_code == 422
    [error] = refused.json()["detail"]
    assert error["loc"] == ["body", "tracking", "wandb", "mode"] and "TANDEM_ALLOW_ONLINE_TRACKING" in error["msg"]
    assert await redis_client.keys(Keys.jobs_queued("*")) == []
    offline = {**SPEC, "tracking": {"wandb": {}, "tensorboard": True}}
    assert (await api.post("/v1/jobs", json=offline)).status_code == 201
    allowing = create_app(ApiSettings(redis_url=redis_url, allow_online_tracking=True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=allowing), base_url="http://api") as client:
        assert (await client.post("/v1/jobs", json=online)).status_code == 201


@pytest.mark.parametrize(
    "tracking, loc",
    [
        ({"wandb": {"project": "../../etc"}}, ["body", "tracking", "wandb", "project"]),  # names a folder in W&B's tree
        ({"conversations": 100000}, ["body", "tracking", "conversations"]),
        ({"tensorboard": "yes"}, ["body", "tracking", "tensorboard"]),
    ],
)
async def test_a_bad_tracking_section_gets_422_naming_the_field(api, tracking, loc):
    response = await api.post("/v1/jobs", json={**SPEC, "tracking": tracking})
    assert response.status_code == 422
    assert loc in [error["loc"][: len(loc)] for error in response.json()["detail"]]


async def test_a_tenants_month_is_shown_to_it_alone_and_once_spent_refuses_new_jobs_with_402(redis_url, redis_client):
    app = create_app(ApiSettings(redis_url=redis_url, tokens=TOKENS, tenant_budget_usd=1.0))
    alpha, beta = bearer("alpha-token-0123456789"), bearer("beta-token-9876543210")
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as api,
    ):
        # While the API runs, the operator's cap is in Redis for the judge proxy.
        for _ in range(100):  # its first write is at once; a few round trips at most
            if bills.cap_of(await redis_client.hgetall(Keys.tenant_caps)).usd == 1.0:
                break
            await asyncio.sleep(0.05)
        assert bills.cap_of(await redis_client.hgetall(Keys.tenant_caps)).usd == 1.0
        month = Keys.tenant_spend("alpha", bills.period())
        await redis_client.hset(month, mapping={"usd:judge": 0.4, "tokens:judge": 900, "calls:judge": 3})
        shown = (await api.get("/v1/spend", headers=alpha)).json()
        assert (shown["period"], shown["usd"], shown["calls"], shown["cap"]) == (
            bills.period(),
            0.4,
            3,
            {"usd": 1.0, "tokens": None},
        )
        assert (await api.get("/v1/spend", headers=beta)).json()["usd"] == 0.0  # alpha's month is not beta's
        assert (await api.get("/v1/spend")).status_code == 401

        await redis_client.hincrbyfloat(month, "usd:simulator", 0.6)  # alpha's month reaches its cap
        refused = await api.post("/v1/jobs", json=SPEC, headers=alpha)
        assert refused.status_code == 402 and "TANDEM_TENANT_BUDGET_USD" in refused.text
        assert "'alpha' has spent its cap for" in refused.text
        assert await redis_client.zcard(Keys.jobs_queued("alpha")) == 0  # nothing queued
        assert (await api.post("/v1/jobs", json=SPEC, headers=beta)).status_code == 201
    # Gone with the API, the cap stays as last written (the proxy still holds tenants to it).
    assert bills.cap_of(await redis_client.hgetall(Keys.tenant_caps)).usd == 1.0


@pytest.mark.parametrize("value", [-1, 0, "lots"])
def test_a_tenant_cap_that_is_not_a_positive_number_is_refused_at_startup(redis_url, value):
    with pytest.raises(ValueError, match="tenant_budget_usd"):
        ApiSettings(redis_url=redis_url, tenant_budget_usd=value)
