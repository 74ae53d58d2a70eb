"""A judge-bound job with a spend cap (its own, or the operator's on its tenant's month),
through the whole system (API, learner, a rollout server on vLLM, the judge proxy in front
of the stand-in provider with example prices): it ends SUCCEEDED short of its steps with the
reason, its bill within the cap, no call past the cap at the provider, and the policy it
trained exported."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from helpers import job_ended, judge_bound_spec, judge_bound_system

from devtools.provider import LocalUpstreamConfig

pytestmark = pytest.mark.slow
PRICES = {"input_per_mtok": 3.0, "output_per_mtok": 15.0, "cached_input_per_mtok": 0.3}
STEPS = 30
CAP_USD = 0.06
"""About four steps of this job at these prices (its steps cost $0.001-0.027 each, $0.012
on average, in a run without the cap): the cap binds well before step 30 and after the
first step, whose cost never came near it."""


@pytest.mark.parametrize("capped", ["job", "tenant"])
def test_a_capped_job_ends_succeeded_at_its_cap_with_no_call_past_it(tmp_path: Path, tiny_model, capped: str):
    """`job`: the spec's `budget`; `tenant`: the operator's cap on the tenant's month, in the
    API's settings, and none in the spec."""
    spec = judge_bound_spec(tmp_path, tiny_model, "capped", STEPS)
    env = {}
    if capped == "job":
        spec["budget"] = {"usd": CAP_USD}
    else:
        env["TANDEM_TENANT_BUDGET_USD"] = str(CAP_USD)
    stand_in = LocalUpstreamConfig(tpm=50_000_000, rpm=500_000, models=["judge"], seed=3, prompt_cache=True)
    with judge_bound_system(tmp_path, stand_in, PRICES, env) as (api, stand_in_url, _):
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        record = job_ended(api, job_id, timeout_s=600)
        history = [h for h in api.get(f"/v1/jobs/{job_id}/history").json() if h["phase"] == "rl"]
        provider = httpx.get(f"{stand_in_url}/admin/stats").json()
        month = api.get("/v1/spend").json()
        if capped == "job":  # the user raises the cap, and the job goes on from where it stopped
            raised = api.post(f"/v1/jobs/{job_id}/resume", json={"budget": {"usd": 2 * CAP_USD}})
            assert raised.status_code == 200, raised.text
            again = job_ended(api, job_id, timeout_s=600)
            more = [h for h in api.get(f"/v1/jobs/{job_id}/history").json() if h["phase"] == "rl"]
            provider_again = httpx.get(f"{stand_in_url}/admin/stats").json()

    assert record["status"] == "SUCCEEDED", record.get("error")
    steps = len(history)
    assert 1 <= steps < STEPS and record["step"] == steps
    assert record["error"].startswith(f"spend cap reached at step {steps} of {STEPS}: $")
    cap = "the job's spend cap" if capped == "job" else f"the spend cap of tenant '' for {month['period']}"
    # The cap named: its plan stopped the job, or the proxy refused a call for it.
    ending = f"; {re.escape(cap)} \\(usd {CAP_USD}\\) (leaves no room for more steps|refused a call)$"
    assert re.search(ending, record["error"]), record["error"]
    spent = record["spend"]
    # The tenant's month holds this one job's calls; its cap is the operator's, or none.
    assert (month["usd"], month["calls"]) == (pytest.approx(spent["usd"]), spent["calls"])
    assert month["cap"]["usd"] == (CAP_USD if capped == "tenant" else None)
    assert spent["usd"] <= CAP_USD  # the proxy made no call that could pass it
    assert provider["accepted"] == spent["calls"]  # every call the provider answered is on the bill
    assert history[-1]["cost_usd"] <= spent["usd"]
    assert (tmp_path / "runs" / job_id / "policy" / "model.safetensors").exists()
    if capped == "job":
        # Resumed at twice the cap, it trained on past the first stop and stopped at the new cap.
        assert again["status"] == "SUCCEEDED" and again["resumes"] == 1, again.get("error")
        assert steps < again["step"] <= len({h["step"] for h in more})
        assert f"(usd {2 * CAP_USD})" in again["error"]
        assert spent["usd"] < again["spend"]["usd"] <= 2 * CAP_USD
        assert provider_again["accepted"] == again["spend"]["calls"]
