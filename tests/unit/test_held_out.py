"""Which examples a job evaluates on (`services.held_out`): never the trained ones, the same
reading on every process, and a spec that would evaluate on trained examples is refused."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from services.config import parse_job_spec
from services.held_out import check_loaded, held_out

MODEL = {"path": "/models/tiny"}


def job(task: dict, evaluation: dict | None = None, **train):
    return parse_job_spec({"model": MODEL, "task": task, "train": train, "eval": evaluation or {}})


def test_generated_tasks_draw_held_out_examples_from_their_own_seed_and_bare_openings():
    held = held_out(job({"name": "clarify", "num_examples": 64, "followup_share": 0.5}, {"examples": 16}))
    assert held.seed == 10_000 and held.examples == tuple(range(16))
    assert held.task.num_examples == 16 and held.task.followup_share == 0.0 and held.task.contexts is None


def test_data_tasks_hold_out_the_rows_after_the_trained_ones_or_read_their_own_file():
    after = held_out(job({"name": "math_chat", "num_examples": 8}, {"examples": 4}))
    assert after.examples == (8, 9, 10, 11) and after.task.num_examples == 12
    with pytest.raises(ValueError, match="leaving 4 of the 6 held-out rows"):
        check_loaded(held_out(job({"name": "math_chat", "num_examples": 8}, {"examples": 6})), 12)
    own = held_out(job({"name": "math_chat", "num_examples": 8}, {"examples": 4, "data": "/data/held.jsonl"}))
    assert own.examples == (0, 1, 2, 3) and own.task.data == "/data/held.jsonl"
    with pytest.raises(ValueError, match="fewer than eval.examples"):
        check_loaded(own, 3)


def test_tau2_evaluates_another_split_never_base():
    held = held_out(job({"name": "tau2", "domain": "mock", "split": "train"}, {"examples": 64}))
    assert held.task.split == "test" and held.examples == (0, 1, 2)  # the mock test split's 3 tasks
    for task, evaluation in (({"split": "base"}, {}), ({"split": "test"}, {"split": "test"})):
        with pytest.raises(ValidationError, match="split"):
            job({"name": "tau2", "domain": "mock"} | task, evaluation)


def test_a_held_out_seed_equal_to_the_training_seed_is_refused():
    with pytest.raises(ValidationError, match="eval.seed must differ from train.seed"):
        job({"name": "multiply"}, {"seed": 7}, seed=7)


def test_only_rl_jobs_evaluate():
    with pytest.raises(ValidationError, match="eval"):
        parse_job_spec({"kind": "offline", "model": MODEL, "train": {"algorithm": "dpo"}, "eval": {}})


def test_tandem_eval_of_a_job_folder_that_is_not_rl_exits_naming_its_kind(tmp_path):
    from rollout.job_eval import job_policy

    spec = {"kind": "offline", "model": MODEL, "train": {"algorithm": "dpo", "data": "/runs/gen/pairs.jsonl"}}
    (tmp_path / "offline-1").mkdir()
    (tmp_path / "offline-1" / "job.json").write_text(json.dumps(spec))
    with pytest.raises(SystemExit, match="is a offline job; only an RL job's task is evaluated"):
        job_policy(tmp_path, "offline-1", None)
