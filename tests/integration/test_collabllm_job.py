"""A job under the `collabllm` preset through the whole system (API, learner, a rollout
server on vLLM, the judge proxy in front of the stand-in provider): the API stores the
spec with the paper's settings filled in, later turns of ranked conversations are trained
as contexts of their own (`task.contexts`), and the interactivity judge and the user
simulator are called through the proxy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import job_ended, judge_bound_system
from trackers import tensorboard_scalars, tensorboard_texts, wandb_run

from devtools.provider import LocalUpstreamConfig
from rollout.tasks import clarify
from tandem.demo import write_demonstrations

pytestmark = pytest.mark.slow
PRICES = {"input_per_mtok": 3.0, "output_per_mtok": 15.0, "cached_input_per_mtok": 0.3}
"""Example prices (USD per million tokens) on the stand-in, so the job has a bill."""


def ranked_conversations(path: Path, examples: list[clarify.ClarifyExample]) -> None:
    """Conversations as a generate job writes them: the request, the question, the user's
    answer and the right answer; each gives a turn-0 and a turn-1 context."""
    with path.open("w") as rows:
        for index, ex in enumerate(examples):
            messages = [
                {"role": "user", "content": clarify.request(ex)},
                {"role": "assistant", "content": clarify.question(ex.category)},
                {"role": "user", "content": clarify.clarification(ex.target)},
                {"role": "assistant", "content": clarify.answer(ex.category, ex.target)},
            ]
            rows.write(json.dumps({"messages": messages, "example": index}) + "\n")


def test_a_preset_job_trains_later_turns_with_the_judge_and_simulator_behind_the_proxy(tmp_path, tiny_model):
    contexts = tmp_path / "sft.jsonl"
    ranked_conversations(contexts, clarify.make_examples(8, seed=0))
    warm_start = tmp_path / "warm.jsonl"
    write_demonstrations(warm_start, num=1000, share=0.5)
    spec = {
        "name": "preset",
        "model": {"path": str(tiny_model), "max_model_len": 512},
        # The tiny model's vocabulary spells the collaborative prompt in most of its window.
        "task": {
            "name": "clarify",
            "user": "llm",
            "contexts": str(contexts),
            "num_examples": 16,
            "system_prompt": None,
        },
        "rollout": {"group_size": 2, "max_new_tokens": 32, "max_turns": 2, "max_total_tokens": 256},
        "reward": {"preset": "collabllm", "judge_model": "judge", "user_model": "judge"},
        "train": {"num_steps": 3, "batch_size": 4, "max_staleness": 1, "lr": 1e-4},
        "warm_start": {"steps": 150, "batch_size": 32, "lr": 3e-3, "data": str(warm_start)},
        "eval": {"every": 2, "examples": 3, "trials": 2},
        "tracking": {"tensorboard": True, "wandb": {"project": "tandem-test"}, "conversations": 4},
    }
    stand_in = LocalUpstreamConfig(tpm=50_000_000, rpm=500_000, models=["judge"], seed=3)
    with judge_bound_system(tmp_path, stand_in, PRICES) as (api, _, _):
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        record = job_ended(api, job_id, timeout_s=600)
        everything = api.get(f"/v1/jobs/{job_id}/history").json()
        history = [h for h in everything if h["phase"] == "rl"]
        evaluations = [h for h in everything if h["phase"] == "eval"]
        groups = api.get(f"/v1/jobs/{job_id}/groups", params={"limit": 200}).json()
        spent = api.get(f"/v1/jobs/{job_id}").json()["spend"]
    assert record["status"] == "SUCCEEDED", record.get("error")

    stored = record["spec"]
    for key, value in {
        "preset": "collabllm",
        "mode": "multiturn",
        "window": 2,
        "num_futures": 3,
        "token_penalty": 5e-4,
        "token_count": "all",
        "judge_rubric": "interactivity",
        "judge_reference": False,
        "future_temperature": 0.8,
    }.items():
        assert stored["reward"][key] == value, key
    assert stored["task"]["simulator"] == "person" and stored["task"]["system_prompt"] is None

    assert len(history) == 3
    turns = [h["turn"] for h in history]
    assert all(0.0 <= t <= 1.0 for t in turns) and sum(turns) > 0  # later turns trained too
    assert all(h["judge_tokens"] > 0 and h["simulator_tokens"] > 0 for h in history)

    # Held out: the warm start's policy, step 2's and the final one, each on 3 examples x 2
    # trials of another seed with the person simulator, scored by the task and the judge.
    assert [e["step"] for e in evaluations] == [0, 2, 3]
    for evaluation in evaluations:
        assert evaluation["complete"] and evaluation["episodes"] == 6 and evaluation["lost"] == 0
        assert 0.0 <= evaluation["pass^2"] <= evaluation["pass^1"] == evaluation["success"] <= 1.0
        assert evaluation["simulator_tokens"] > 0 and evaluation["versions_min"] >= evaluation["step"]
        # Job so far: round 0 may be in before any trained group, and then it is all there is.
        assert 0.0 < evaluation["eval_share_llm_tokens"] <= 1.0
        assert evaluation["step"] == 0 or evaluation["eval_share_llm_tokens"] < 1.0
    # The judge scores the well-formed ones. A later round may find a verdict in the proxy's
    # memory (the same conversation judged before: no tokens), the first judged one cannot.
    judged = [e for e in evaluations if "judge" in e]
    assert all(0.0 <= e["judge"] <= 1.0 for e in judged)
    assert not judged or judged[0]["judge_tokens"] > 0
    assert record["held_out"]["step"] == 3

    # What the job page browses: each group the servers played, as text. A well-formed
    # response's MR is the mean of its 3 futures' R*, each judged with a verdict.
    assert len(groups) >= 12 and {len(g["responses"]) for g in groups} == {2}
    futures = 0
    for group in groups:
        assert group["mode"] == "multiturn" and group["weights"]["judge_weight"] > 0
        for response in group["responses"]:
            if response["malformed"]:
                assert response["futures"] == [] and response["reward"] == -1.0
                continue
            assert len(response["futures"]) == 3
            assert response["reward"] == pytest.approx(sum(f["parts"]["reward"] for f in response["futures"]) / 3)
            for future in response["futures"]:
                futures += 1
                # The simulator answers the response first, or ends the conversation there.
                assert [m["role"] for m in future["messages"][:1]] in ([], ["user"])
                if future["parts"]["r_llm"] is not None:
                    assert future["parts"]["verdict"] and "judge_model" in group["reward_source"]
    assert futures > 0

    # The bill: every call charged to the job by role; each step records what it cost, and
    # its projection to the end is exact at the last step. The final held-out round's calls
    # come after the last step, so the proxy's sums hold at least what the steps recorded.
    assert set(spent["by_role"]) == {"simulator", "judge", "eval"}
    assert all(part["usd"] > 0 and part["calls"] > 0 for part in spent["by_role"].values())
    assert [h["cost_usd"] for h in history] == sorted(h["cost_usd"] for h in history)
    before = history[0]["cost_usd"] - history[0]["cost_usd_step"]  # spent before the first step
    assert sum(h["cost_usd_step"] for h in history) == pytest.approx(history[-1]["cost_usd"] - before)
    assert history[-1]["cost_usd_projected"] == pytest.approx(history[-1]["cost_usd"])
    assert 0 < history[-1]["cost_usd"] <= spent["usd"]
    assert history[-1]["cost_usd_per_sample"] == pytest.approx(history[-1]["cost_usd_step"] / history[-1]["samples"])
    trained = [t for h in history for t in h["task_ids"]]
    assert len(trained) == len(set(trained)) == 12  # held-out conversations are never training tasks

    # The trackers, read back by their own readers: the steps and evaluations, the spec as
    # the W&B run's config, 4 held-out conversations per round as a table.
    run_dir = tmp_path / "runs" / job_id
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert [step for step, _ in scalars["rl/reward_mean"]] == [1, 2, 3]
    assert scalars["eval/success"] == [(e["step"], pytest.approx(e["success"])) for e in evaluations]
    assert [step for step, _ in tensorboard_texts(run_dir / "tensorboard", "eval/conversations")] == [0, 2, 3]
    config, rows = wandb_run(run_dir)
    assert config["reward"]["preset"] == "collabllm" and config["eval"]["trials"] == 2
    assert [r["eval/step"] for r in rows if "eval/success" in r] == [0, 2, 3]
    assert [r["eval/conversations/nrows"] for r in rows if "eval/conversations/nrows" in r] == [4, 4, 4]
