"""`tandem rejudge` on a finished judge-bound job (the whole system on the tiny model, the
stand-in provider as its judge): the job's stored conversations scored again through the
proxy, by the same judge (every verdict the same: the conversations are rebuilt as the job's
judge read them) and by a second, coarse and cheaper judge the stand-in also serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import job_ended, judge_bound_spec, judge_bound_system

from devtools.provider import LocalUpstreamConfig
from tandem.cli import main

pytestmark = pytest.mark.slow
PRICES = {"input_per_mtok": 3.0, "output_per_mtok": 15.0}
CHEAP = {"input_per_mtok": 0.3, "output_per_mtok": 1.5}
"""The coarse judge's: a tenth of the judge's."""
STEPS = 6


@pytest.mark.parametrize("judge_mode", ["single", "group"])
def test_rejudge_compares_a_finished_jobs_verdicts_with_the_same_and_a_second_judge(
    tmp_path: Path, tiny_model, judge_mode: str
):
    """`group`: the job's judge scored each response's futures in one call, and so does the
    re-judging."""
    spec = judge_bound_spec(tmp_path, tiny_model, "judged", STEPS, group_size=3, judge_mode=judge_mode)
    stand_in = LocalUpstreamConfig(
        tpm=50_000_000, rpm=500_000, models=["judge", "judge-coarse"], seed=3, coarse_judge_models=["judge-coarse"]
    )
    with judge_bound_system(tmp_path, stand_in, PRICES, also={"judge-coarse": CHEAP}) as (api, _, judge_url):
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        record = job_ended(api, job_id, timeout_s=600)
        assert record["status"] == "SUCCEEDED", record.get("error")
        stored = api.get(f"/v1/jobs/{job_id}/groups", params={"limit": 200}).json()
        reports = {}
        for model in ("judge", "judge-coarse"):
            out = tmp_path / f"{model}.json"
            main(["rejudge", job_id, "--judge-model", model, "--api", str(api.base_url), "--judge-url", judge_url,
                  "--out", str(out)])  # fmt: skip
            reports[model] = json.loads(out.read_text())
        last = api.get(f"/v1/jobs/{job_id}").json()

    # Every future the judge scored is re-scored: 2 per well-formed response.
    judged = [f for g in stored for r in g["responses"] for f in r["futures"] if f["parts"]["r_llm"] is not None]
    same, coarse = reports["judge"], reports["judge-coarse"]
    assert same["groups"] == len(stored) and len(same["conversations"]) == len(judged) > 0
    assert same["left_out"] == {"cut": 0, "failed": 0, "failed_groups": 0}

    # The same judge and rubric give back every recorded verdict: the conversations are the ones it read.
    agreement = same["agreement"]
    assert agreement["conversations"] == len(judged) and agreement["mean_abs_diff"] == 0.0
    assert agreement["within_0_1"] == agreement["same_side_of_half"] == 1.0
    verdicts = [(c["recorded_verdict"], c["rejudged_verdict"]) for c in same["conversations"]]
    assert all(old == new for old, new in verdicts)
    assert same["flipped_pairs"]["count"] == 0
    assert all(g["spearman"] in (None, pytest.approx(1.0)) for g in same["rank_correlation"]["per_group"])

    # The coarse judge's comparison holds together: each flipped pair is ordered one way as
    # recorded and the other way rejudged, and its shares are of the conversations it lists.
    assert coarse["agreement"]["conversations"] == len(coarse["conversations"]) == len(judged)
    rejudged = [c["rejudged_score"] for c in coarse["conversations"]]
    assert coarse["agreement"]["mean_rejudged"] == pytest.approx(sum(rejudged) / len(rejudged))
    for pair in coarse["flipped_pairs"]["pairs"]:
        (a, b), (c, d) = pair["recorded"], pair["rejudged"]
        assert (a - b) * (c - d) < 0
    assert coarse["flipped_pairs"]["count"] <= coarse["flipped_pairs"]["comparable"]

    # The re-judging is charged to its own key, not to the job, and priced at its model's rates.
    for report, prices in ((same, PRICES), (coarse, CHEAP)):
        cost = report["cost"]
        # As the job asked: one call a conversation, the same conversation judged once (its cache).
        assert 0 < cost["calls"] <= len(judged) and cost["tokens"] > 0
        low, high = prices["input_per_mtok"], prices["output_per_mtok"]
        assert cost["tokens"] * low / 1e6 <= cost["usd"] <= cost["tokens"] * high / 1e6
    assert last["spend"]["calls"] == record["spend"]["calls"]  # the job's bill did not move
    # Priced at a tenth, the coarse judge's verdicts cost about a tenth (its replies are as long).
    assert coarse["cost"]["usd_per_verdict"] < 0.2 * same["cost"]["usd_per_verdict"]
    assert same["cost"]["recorded_judge_usd"] > 0
