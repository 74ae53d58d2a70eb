"""A job's page in a real browser: Debian's headless Chromium, driven by Selenium, against the
API on real Redis. The job's records are the ones a learner and a rollout server write
(history records, held-out results on the eval stream). The page loads, its curves are
drawn, a held-out conversation opens with its turns, model-written markup stays text, and a
wrong token gets 401 and nothing of the job."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
import redis
from polling import wait_for

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
    """Headless Chromium through Selenium, or a skip naming what is missing (a failure
    where CI requires it: TANDEM_REQUIRE_CHROMIUM)."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        message = "Debian's chromium and chromium-driver are not installed (.ci/run installs them)"
        if os.environ.get("TANDEM_REQUIRE_CHROMIUM"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1800",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def seed_job(client: redis.Redis, api_url: str) -> str:
    """A job submitted through the API, with two RL steps, a health event and two held-out
    rounds recorded as the learner and a rollout server record them."""
    spec = {"name": "page", "model": {"path": "/models/tiny"}, "train": {"num_steps": 4}, "eval": {"every": 2}}
    job_id = httpx.post(f"{api_url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {TOKEN}"}).json()["id"]
    records = [
        {"phase": "sft", "sft_step": 1, "loss": 2.0},
        {"phase": "eval", "step": 0, "version": 0, "success": 0.25, "episodes": 2, "complete": True},
        {"phase": "rl", "step": 1, "reward_mean": 0.3, "staleness_mean": 0.0, "staleness_max": 0, "trained_tokens": 90},
        {"phase": "rl", "step": 2, "reward_mean": 0.6, "staleness_mean": 1.0, "staleness_max": 1, "trained_tokens": 99,
         "health": ["health rule (warn): well_formed < 0.5 for 1 steps (step 2: 0.4)"]},
        {"phase": "eval", "step": 2, "version": 2, "success": 0.5, "episodes": 2, "complete": True},
    ]  # fmt: skip
    for index, record in enumerate(records):
        client.rpush(Keys.history(job_id), json.dumps(record | {"time": 1000.0 + index}))
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
    return job_id


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
        drawn = driver.execute_script(
            "return [...document.querySelectorAll('.chart polyline.series')].map(l => l.dataset.name)"
        )
        assert {"training reward (mean)", "held-out success", "mean", "max"} <= set(drawn)
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
