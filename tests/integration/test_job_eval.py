"""`tandem eval --job`: a job's policy on its held-out examples by the code its evaluation
rounds run, as the same record, with every conversation; and a step it never exported is
refused naming what to do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "eval", *args], capture_output=True, text=True, timeout=600
    )


def test_a_jobs_policy_on_its_held_out_examples(tmp_path, tiny_model):
    job = tmp_path / "runs" / "clarify-0123abcd"
    job.mkdir(parents=True)
    spec = {
        "kind": "rl",
        "name": "clarify",
        "model": {"path": "/where/the/job/trained", "max_model_len": 512},
        "task": {"name": "clarify", "num_examples": 64},
        "rollout": {"max_new_tokens": 24, "max_turns": 2, "max_total_tokens": 160},
        "eval": {"every": 5, "examples": 32},
    }
    (job / "job.json").write_text(json.dumps(spec))
    (job / "policy").symlink_to(tiny_model)
    out = tmp_path / "eval.json"

    done = run_eval(
        "--job", job.name, "--runs-dir", str(job.parent), "--examples", "6", "--trials", "2",
        "--kv-cache-gib", "0.5", "--out", str(out),
    )  # fmt: skip

    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    held = report["held_out"]
    assert report["eval"]["examples"] == 6 and report["eval"]["trials"] == 2  # the command line over the spec
    assert held["episodes"] == 12 and held["complete"] and held["lost"] == 0
    assert 0.0 <= held["pass^2"] <= held["pass^1"] == held["success"] <= 1.0
    assert 0.0 <= held["asked"] <= 1.0 and held["tokens"] > 0
    rows = report["conversations"]
    assert sorted((r["example"], r["trial"]) for r in rows) == [(e, t) for e in range(6) for t in range(2)]
    assert all(r["conversation"][0]["role"] == "user" and len(r["conversation"]) >= 2 for r in rows)
    assert "| clarify | 12 |" in done.stdout

    missing = run_eval("--job", job.name, "--runs-dir", str(job.parent), "--step", "5")
    assert missing.returncode != 0 and "tandem export" in missing.stderr
    # A job id is one folder name: a path would read a spec and a policy outside the runs folder.
    outside = run_eval("--job", f"../{job.parent.name}/{job.name}", "--runs-dir", str(job.parent))
    assert outside.returncode != 0 and "is not a job id" in outside.stderr
