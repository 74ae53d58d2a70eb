"""What the judge proxy remembers and how it batches verdicts: group verdicts, the job's
verdict cache, and replies replayed by idempotency key. Real proxy (in-process, httpx ASGI
transport), real local upstreams on loopback, real Redis."""

from __future__ import annotations

import asyncio

import pytest
from test_judge_proxy import entry, make_proxy, sample, servers, upstreams  # noqa: F401  (fixtures)

VAGUE = {"role": "user", "content": "I want a fruit."}
ASK = {"role": "assistant", "content": "Which fruit?"}
SAYS = {"role": "user", "content": "I mean mango."}
RIGHT = [VAGUE, ASK, SAYS, {"role": "assistant", "content": "A mango."}]
WRONG = [VAGUE, ASK, SAYS, {"role": "assistant", "content": "An apple."}]
GUESS = [VAGUE, {"role": "assistant", "content": "A banana."}]


def judge_body(*candidates: list[dict], **extra) -> dict:
    return {"rubric": "interactivity", "candidates": list(candidates), **extra}


async def judged_alone(proxy, conversation: list[dict]) -> float:
    response = await proxy.post("/v1/judge", json={"rubric": "interactivity", "messages": conversation, "cache": False})
    return response.json()["score"]


async def test_a_group_is_judged_in_one_call_and_scores_as_each_candidate_alone(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    duplicates = sample("tandem_judge_group_candidates_total", rubric="interactivity", outcome="duplicate")

    response = await proxy.post(
        "/v1/judge/group", json=judge_body(RIGHT, WRONG, RIGHT, GUESS), headers={"x-tandem-job": "job-g"}
    )

    assert response.status_code == 200
    body = response.json()
    assert (await upstreams["a"].stats())["requests"] == 1
    assert body["fallback"] is None and body["usage"]["total_tokens"] > 0
    alone = [await judged_alone(proxy, c) for c in (RIGHT, WRONG, GUESS)]
    assert [r["score"] for r in body["results"]] == [alone[0], alone[1], alone[0], alone[2]]
    assert len(set(alone)) == 3
    assert sample("tandem_judge_group_candidates_total", rubric="interactivity", outcome="duplicate") - duplicates == 1


async def test_an_unusable_group_verdict_falls_back_to_one_call_per_candidate_and_is_counted(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    fallbacks = sample("tandem_judge_group_fallbacks_total", rubric="interactivity", reason="missing")
    await upstreams["a"].script(
        {"content": '[{"candidate": 1, "understanding": 9, "clarification": 9, "suggestions": 9}]'}
    )

    response = await proxy.post("/v1/judge/group", json=judge_body(RIGHT, WRONG, cache=False))

    assert response.status_code == 200
    body = response.json()
    assert body["fallback"] == "missing"
    assert [r["score"] for r in body["results"]] == [await judged_alone(proxy, RIGHT), await judged_alone(proxy, WRONG)]
    assert (await upstreams["a"].stats())["requests"] == 1 + 2 + 2
    assert sample("tandem_judge_group_fallbacks_total", rubric="interactivity", reason="missing") - fallbacks == 1


async def test_a_jobs_repeated_verdict_is_answered_from_the_cache_and_other_jobs_pay_their_own(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    ask = {"rubric": "interactivity", "messages": RIGHT}

    first = await proxy.post("/v1/judge", json=ask, headers={"x-tandem-job": "job-c"})
    again = await proxy.post("/v1/judge", json=ask, headers={"x-tandem-job": "job-c"})
    grouped = await proxy.post("/v1/judge/group", json=judge_body(RIGHT, WRONG), headers={"x-tandem-job": "job-c"})
    other_job = await proxy.post("/v1/judge", json=ask, headers={"x-tandem-job": "job-d"})
    opted_out = await proxy.post("/v1/judge", json=ask | {"cache": False}, headers={"x-tandem-job": "job-c"})

    assert not first.json()["remembered"] and again.json()["remembered"]
    assert again.json()["score"] == first.json()["score"]
    assert [r["remembered"] for r in grouped.json()["results"]] == [True, False]
    assert not other_job.json()["remembered"] and not opted_out.json()["remembered"]
    # first, WRONG alone (the group's only unknown candidate), other job, opted out
    assert (await upstreams["a"].stats())["requests"] == 4
    assert sample("tandem_judge_memory_total", job="job-c", kind="cache", result="hit") >= 1


async def test_a_request_repeated_with_its_idempotency_key_is_replayed_not_sent_again(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    body = {
        "model": "judge",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 12,
        "temperature": 1.0,
    }
    headers = {"idempotency-key": "task-7/s0/f1/t2/user", "x-tandem-job": "job-r"}

    first, twin = await asyncio.gather(
        *(proxy.post("/v1/chat/completions", json=body, headers=headers) for _ in range(2))
    )
    later = await proxy.post("/v1/chat/completions", json=body, headers=headers)
    changed = await proxy.post("/v1/chat/completions", json=body | {"max_tokens": 13}, headers=headers)

    assert first.json() == twin.json() == later.json()
    assert later.headers["x-tandem-remembered"] == "true"
    assert "x-tandem-remembered" not in changed.headers
    assert (await upstreams["a"].stats())["requests"] == 2
    tags = (await upstreams["a"].admin.get(f"{upstreams['a'].url}/admin/request-tags")).json()
    assert tags == {"task-7/s0/f1/t2/user": 2}


async def test_a_call_whose_client_went_away_still_completes_for_the_client_that_retries(make_proxy, upstreams):
    proxy = await make_proxy(entry("a", upstreams["a"]))
    await upstreams["a"].script({"delay_s": 0.5, "content": "the reply the first client never read"})
    body = {"model": "judge", "messages": [{"role": "user", "content": "Slow one."}], "max_tokens": 12}
    headers = {"idempotency-key": "task-9/s1/judge", "x-tandem-job": "job-k"}

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(proxy.post("/v1/chat/completions", json=body, headers=headers), 0.1)
    retried = await proxy.post("/v1/chat/completions", json=body, headers=headers)

    assert retried.json()["choices"][0]["message"]["content"] == "the reply the first client never read"
    assert retried.headers["x-tandem-remembered"] == "true"
    assert (await upstreams["a"].stats())["requests"] == 1
