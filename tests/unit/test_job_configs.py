"""The example job files in deploy/configs: each one is a job the API accepts as it stands.

A file is read the way `tandem submit` reads it and validated the way the API validates
the JSON it receives. The compose examples load their models from /models, the folder
docker-compose.yml mounts into the rollout servers and the learner, and name only judge
rubrics and models the judge proxy can serve.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from judge_proxy.rubrics import RUBRICS
from services.config import JobSpec, JudgeProxySettings, parse_job_spec_json
from tandem.client import load_spec_file

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
UPSTREAMS_EXAMPLE = CONFIGS / "judge_upstreams.example.yaml"
UPSTREAMS_OF = {
    name: CONFIGS / "judge_upstreams.served-model.yaml"
    for name in ("smollm2-clarify-judge.yaml", "collabllm-math.yaml")
}
"""Jobs written for another upstreams file than the example (their comments say which)."""
JOB_FILES = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("judge_upstreams"))
LOCAL_JOB_FILES = ("demo.yaml", "multiply-tools.yaml")
COMPOSE_JOB_FILES = [p for p in JOB_FILES if p.name not in LOCAL_JOB_FILES]
"""demo.yaml's and multiply-tools.yaml's model paths are filled in by `tandem demo` and
bench/tool_use.py (a tiny model they build); the others run under compose."""


def load(path: Path) -> JobSpec:
    return parse_job_spec_json(json.dumps(load_spec_file(path)))


def test_the_compose_examples_are_there():
    assert {"clarify-mr.yaml", "clarify-judge.yaml", "math-chat.yaml"} <= {p.name for p in COMPOSE_JOB_FILES}


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: p.name)
def test_job_file_is_a_job_spec_the_api_accepts(path):
    spec = load(path)
    assert spec.name == path.stem


@pytest.mark.parametrize("path", COMPOSE_JOB_FILES, ids=lambda p: p.name)
def test_compose_job_file_loads_its_model_from_the_models_mount(path):
    assert load(path).model.path.startswith("/models/")


@pytest.mark.parametrize("path", COMPOSE_JOB_FILES, ids=lambda p: p.name)
def test_compose_job_file_names_rubrics_and_models_its_upstreams_serve(path):
    spec = load(path)
    upstreams = UPSTREAMS_OF.get(path.name, UPSTREAMS_EXAMPLE)
    served = {u["model"] for u in yaml.safe_load(upstreams.read_text())["upstreams"]}
    if spec.reward.judge_rubric is not None:
        assert spec.reward.judge_rubric in RUBRICS
        assert (spec.reward.judge_model or JudgeProxySettings.model_fields["judge_model"].default) in served
    if spec.task.name != "clarify" or spec.task.user == "llm":  # an LLM user, behind the judge proxy
        assert spec.reward.user_model in served


def test_clarify_mr_uses_the_papers_multiturn_reward():
    reward = load(CONFIGS / "clarify-mr.yaml").reward
    assert (reward.mode, reward.window, reward.num_futures, reward.token_penalty) == ("multiturn", 2, 3, 0.0005)
