"""A job's page in a real browser: Debian's headless Chromium, driven by Selenium, against the
API on real Redis. The job's records are the ones a learner and a rollout server write
(history records, held-out results on the eval stream, group views on the groups stream).
The page loads, its curves are drawn, a held-out conversation opens with its turns, a
training group opens with its best and worst response and a future with the judge's
verdict, model-written markup stays text, and a wrong token gets 401 and nothing of the
job."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import redis
from polling import wait_for

from devtools.browser import MISSING, chromium
from devtools.browser import available as chromium_available
from devtools.provider import serve_in_thread
from services import protocol
from services.api.app import create_app
from services.config import ApiSettings
from services.queues import Keys
from tandem.redis_embed import free_port

pytestmark = pytest.mark.slow

TOKEN = "page-token-0123456789"
INJECTED = '<img src=x onerror="window.pwned = 1">'
"""What a model could write into a conversation: the page must show it, not run it."""


def browser():
    """Headless Chromium, or a skip naming what is missing (a failure where CI requires it:
    TANDEM_REQUIRE_CHROMIUM)."""
    if not chromium_available():
        if os.environ.get("TANDEM_REQUIRE_CHROMIUM"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    return chromium()


def seed_job(client: redis.Redis, api_url: str) -> str:
    """A job submitted through the API, with two RL steps, a health event and two held-out
    rounds recorded as the learner and a rollout server record them."""
    spec = {"name": "page", "model": {"path": "/models/tiny"}, "train": {"num_steps": 4}, "eval": {"every": 2}}
    job_id = httpx.post(f"{api_url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {TOKEN}"}).json()["id"]
    records = [
        {"phase": "sft", "sft_step": 1, "loss": 2.0},
        {"phase": "eval", "step": 0, "version": 0, "success": 0.25, "episodes": 2, "complete": True},
        {"phase": "rl", "step": 1, "reward_mean": 0.3, "staleness_mean": 0.0, "staleness_max": 0, "trained_tokens": 90,
         "cost_usd": 0.01, "cost_usd_step": 0.01, "cost_usd_projected": 0.04},
        {"phase": "rl", "step": 2, "reward_mean": 0.6, "staleness_mean": 1.0, "staleness_max": 1, "trained_tokens": 99,
         "cost_usd": 0.025, "cost_usd_step": 0.015, "cost_usd_projected": 0.05,
         "health": ["health rule (warn): well_formed < 0.5 for 1 steps (step 2: 0.4)"]},
        {"phase": "eval", "step": 2, "version": 2, "success": 0.5, "episodes": 2, "complete": True},
    ]  # fmt: skip
    for index, record in enumerate(records):
        client.rpush(Keys.history(job_id), json.dumps(record | {"time": 1000.0 + index}))
    client.hset(Keys.job(job_id), "metrics", json.dumps(records[3]))  # as the learner's step writes it
    spend = {"usd:judge": 0.02, "tokens:judge": 5000, "cached:judge": 0, "calls:judge": 10}
    spend |= {"usd:simulator": 0.01, "tokens:simulator": 3000, "cached:simulator": 1200, "calls:simulator": 20}
    client.hset(Keys.job_spend(job_id), mapping=spend)  # as the judge proxy charges it
    ask = [("user", "I'd like a fruit."), ("assistant", "Which fruit?")]
    turns = {
        (0, 0): [("user", "I'd like a fruit."), ("assistant", "an apple")],
        (0, 1): [*ask, ("user", "a pear"), ("assistant", "a pear")],
        (2, 0): [*ask, ("user", "a plum"), ("assistant", "a plum")],
        (2, 1): [("user", "I'd like a fruit."), ("assistant", INJECTED)],
    }
    for (step, example), conversation in turns.items():
        success = 1.0 if conversation[-1][1].startswith("a p") else 0.0
        result = protocol.EvalResult(
            job_id=job_id,
            round=step,
            example=example,
            trial=0,
            server_id="rollout-0",
            metrics={"success": success, "tokens": 9.0, "turns": 2.0, "well_formed": 1.0, "asked": float(success)},
            versions=[step, step + 1],
            elapsed_s=1.0,
            conversation=[{"role": role, "content": content} for role, content in conversation],
        )
        client.xadd(Keys.eval_results(job_id), {b"m": protocol.encode(result)})
    for view in group_views(job_id):
        client.xadd(Keys.groups(job_id), {b"m": protocol.encode(view)})
    client.xadd(Keys.groups(job_id), {b"m": b"not a view"})  # skipped, not a failure
    return job_id


def parts(r_ext: float, r_llm: float, verdict: str) -> protocol.RewardParts:
    return protocol.RewardParts(
        reward=r_ext - 0.01 + 0.5 * r_llm, token_penalty=0.01, r_ext=r_ext, r_llm=r_llm, verdict=verdict
    )


def group_views(job_id: str) -> list[protocol.GroupView]:
    """Two multiturn groups, at versions 1 and 2: in the newer one response 0 asked and its
    futures did well, response 1 guessed (its future is judged with markup in the verdict)
    and response 2 was cut short."""
    request = {"role": "user", "content": "I'd like a fruit."}

    def future(answer: str, r_ext: float, r_llm: float, verdict: str) -> protocol.FutureView:
        turns = [{"role": "user", "content": "a pear"}, {"role": "assistant", "content": answer}]
        return protocol.FutureView(messages=turns, parts=parts(r_ext, r_llm, verdict))

    def response(index: int, text: str, futures: list, malformed: str = "") -> protocol.ResponseView:
        reward = sum(f.parts.reward for f in futures) / len(futures) if futures else -1.0
        return protocol.ResponseView(
            index=index,
            messages=[{"role": "assistant", "content": text}],
            reward=reward,
            advantage=0.0,
            malformed=malformed,
            futures=futures,
            metrics={"asked": float(text.endswith("?"))},
        )

    def view(task_id: int, version: int, responses: list) -> protocol.GroupView:
        return protocol.GroupView(
            job_id=job_id,
            task_id=task_id,
            example=task_id,
            server_id="rollout-0",
            mode="multiturn",
            dispatched_version=version - 1,
            versions=[version - 1, version],
            weights={"extrinsic_weight": 1.0, "judge_weight": 0.5},
            context=[request],
            responses=responses,
            reward_source={"judge_model": "judge-9", "seed": "7"},
        )

    asking = response(
        0,
        "Which fruit?",
        [future("a pear", 1.0, 0.9, "asked first, then answered"), future("a pear", 1.0, 0.8, "clear")],
    )
    guessing = response(1, "an apple", [future("an apple", 0.0, 0.1, INJECTED)])
    cut = response(2, "a pe", [], malformed="truncated")
    return [
        view(3, 1, [response(0, "a plum", [future("a plum", 0.0, 0.2, "guessed")])]),
        view(5, 2, [asking, guessing, cut]),
    ]


@pytest.fixture
def page_api(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    app = create_app(ApiSettings(redis_url=redis_url, tokens=f"{TOKEN}:alpha"))
    with serve_in_thread(app, free_port()) as url:
        yield url, client


def test_the_job_page_shows_curves_and_opens_a_held_out_conversation_and_refuses_a_wrong_token(page_api):
    url, client = page_api
    job_id = seed_job(client, url)
    driver = browser()
    try:
        driver.get(f"{url}/jobs/{job_id}#token={TOKEN}")
        wait_for(lambda: driver.execute_script("return document.body.dataset.loaded === 'true'"), 30, "the page")
        assert "#token" not in driver.current_url  # taken out of the address at once

        status = driver.find_element("id", "status").text
        assert status.startswith("PENDING") and "step 0 of 4" in status
        titles = driver.execute_script("return [...document.querySelectorAll('.chart')].map(c => c.dataset.title)")
        assert "Reward and held-out success" in titles and "Staleness (versions)" in titles
        assert "Cost of LLM calls (USD)" in titles
        summary = driver.find_element("id", "summary").text
        assert "cost of LLM calls: $0.03 so far (judge $0.02, simulator $0.01; 8000 tokens, 1200 cached)" in summary
        assert "about $0.05 by the end at this rate" in summary
        drawn = driver.execute_script(
            "return [...document.querySelectorAll('.chart polyline.series')].map(l => l.dataset.name)"
        )
        assert {"training reward (mean)", "held-out success", "mean", "max", "so far", "projected at the end"} <= set(
            drawn
        )
        assert "well_formed < 0.5" in driver.find_element("id", "alerts").text

        # The newest round is shown; its rows open their conversation, turn by turn.
        rows = driver.find_elements("css selector", "#conversations tbody tr")
        assert len(rows) == 2
        rows[0].click()
        shown = driver.find_element("id", "conversation").text
        assert "Which fruit?" in shown and "a plum" in shown
        best = driver.find_element("css selector", "[data-side=best]").text
        worst = driver.find_element("css selector", "[data-side=worst]").text
        assert "success 1" in best and "a plum" in best and INJECTED in worst
        assert driver.execute_script("return window.pwned") is None  # shown as text, never run
        assert driver.find_elements("css selector", "#job img") == []

        driver.find_element("css selector", "#round option[value='0']").click()
        wait_for(lambda: "an apple" in driver.find_element("id", "extremes").text, 10, "round 0's conversations")

        # Training groups: newest first; one opens with its best and worst response side by
        # side, and a future opens to the simulator's and the policy's turns and the verdict.
        groups = driver.find_elements("css selector", "#groups tbody tr")
        assert [r.find_element("css selector", "td").text for r in groups] == ["5", "3"]
        groups[0].click()
        shown = driver.find_element("id", "group")
        assert "judge_model judge-9" in shown.text
        best = shown.find_element("css selector", "[data-side=best]")
        worst = shown.find_element("css selector", "[data-side=worst]")
        assert "Which fruit?" in best.text and "malformed (truncated)" in worst.text
        future = best.find_element("css selector", "details.future[data-future='1']")
        assert "judge: clear" not in future.text  # closed: only its summary shows
        assert "R* 1.39 = 1 × R_ext 1 − token penalty 0.01 + 0.5 × R_llm 0.8" in future.text
        future.find_element("css selector", "summary").click()
        wait_for(lambda: "judge: clear" in future.text, 10, "the future opened")
        roles = [t.text for t in future.find_elements("css selector", ".turn .role")]
        assert roles == ["user", "assistant"] and "a pear" in future.text
        guessed = shown.find_element("css selector", ".response[data-response='1']:not(.side) details.future")
        guessed.find_element("css selector", "summary").click()
        wait_for(lambda: INJECTED in guessed.text, 10, "the guess's future")
        assert driver.execute_script("return window.pwned") is None
        assert driver.find_elements("css selector", "#job img") == []

        # Filters: the malformed groups, then a version (the table read in one script: a
        # redraw may replace its rows between two reads from here).
        first_cells = "return [...document.querySelectorAll('#groups tbody tr')].map(r => r.cells[0].textContent)"
        driver.find_element("css selector", "#group-only option[value='malformed']").click()
        wait_for(lambda: driver.execute_script(first_cells) == ["5"], 10, "malformed only")
        driver.find_element("css selector", "#group-only option[value='all']").click()
        driver.find_element("css selector", "#group-version option[value='1']").click()
        wait_for(lambda: driver.execute_script(first_cells) == ["3"], 10, "version 1's group")

        # Another tab with a wrong token: 401, and nothing of the job on the page.
        driver.execute_script("sessionStorage.clear()")
        driver.get(f"{url}/jobs/{job_id}#token=wrong-token-9876543210")
        wait_for(lambda: driver.find_element("id", "error").is_displayed(), 30, "the refusal")
        assert "401" in driver.find_element("id", "error").text
        assert not driver.find_element("id", "job").is_displayed()
        assert driver.find_element("id", "login").is_displayed()
    finally:
        driver.quit()


def test_the_page_is_a_static_file_with_a_policy_that_runs_only_its_own_script(page_api):
    url, client = page_api
    job_id = seed_job(client, url)
    page = httpx.get(f"{url}/jobs/{job_id}")
    assert page.status_code == 200 and job_id not in page.text  # no data in it
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(f"{url}/jobs/static/job.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{url}/jobs/static/..%2Fapp.py").status_code == 404
    assert httpx.get(f"{url}/v1/jobs/{job_id}/conversations").status_code == 401
    conversations = httpx.get(
        f"{url}/v1/jobs/{job_id}/conversations",
        params={"step": 0, "order": "highest"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).json()
    assert [(c["example"], c["metrics"]["success"]) for c in conversations] == [(1, 1.0), (0, 0.0)]


def test_the_groups_route_filters_and_orders_recorded_groups_and_skips_bad_entries(page_api):
    url, client = page_api
    job_id = seed_job(client, url)
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def tasks(**params) -> list[int]:
        reply = httpx.get(f"{url}/v1/jobs/{job_id}/groups", params=params, headers=auth)
        assert reply.status_code == 200, reply.text
        return [g["task_id"] for g in reply.json()]

    assert tasks() == [5, 3]  # newest first; the entry that is not a view is skipped
    whole = httpx.get(f"{url}/v1/jobs/{job_id}/groups", params={"version": 1}, headers=auth)
    assert whole.headers["x-tandem-group-versions"] == "2,1"  # every recorded version, whatever the filter
    assert tasks(order="lowest") == [5, 3]  # task 5 holds the truncated response at -1
    assert tasks(order="highest") == [3, 5]
    assert tasks(only="malformed") == [5]
    assert tasks(only="asked") == [5] and tasks(only="not_asked") == [3]
    assert tasks(version=1) == [3] and tasks(version=9) == []
    assert tasks(limit=1) == [5]
    [group] = httpx.get(f"{url}/v1/jobs/{job_id}/groups", params={"version": 2}, headers=auth).json()
    future = group["responses"][0]["futures"][0]
    assert future["parts"] == {
        "reward": pytest.approx(1.0 - 0.01 + 0.45), "token_penalty": 0.01, "r_ext": 1.0, "r_llm": 0.9,
        "tool_terms": 0.0, "verdict": "asked first, then answered",
    }  # fmt: skip
    for bad in ({"limit": 0}, {"limit": 10_000}, {"order": "random"}, {"only": "x"}, {"version": -1}):
        reply = httpx.get(f"{url}/v1/jobs/{job_id}/groups", params=bad, headers=auth)
        assert reply.status_code == 422 and next(iter(bad)) in reply.text, bad
    assert httpx.get(f"{url}/v1/jobs/{job_id}/groups").status_code == 401
