"""A job spec is one model per kind, `kind` selecting: a spec gets its kind's fields and
rules and no other kind's, whatever a tenant sends."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.config import GenerateJob, OfflineJob, RLJob, parse_job_spec, parse_job_spec_json

MODEL = {"path": "models/tiny"}


def errors(spec: dict) -> list[tuple[tuple, str]]:
    with pytest.raises(ValidationError) as caught:
        parse_job_spec(spec)
    return [(tuple(e["loc"]), e["msg"]) for e in caught.value.errors()]


def test_a_spec_without_a_kind_is_an_rl_job_and_a_stored_one_reads_back_as_its_kind():
    assert type(parse_job_spec({"model": MODEL})) is RLJob
    generate = parse_job_spec({"model": MODEL, "kind": "generate", "reward": {"mode": "multiturn"}})
    assert type(generate) is GenerateJob and generate.progress() == (64, "conv")
    assert parse_job_spec_json(generate.model_dump_json()) == generate


@pytest.mark.parametrize("kind", ["replay", 5, None, ["rl"]])
def test_a_kind_that_is_none_of_them_is_refused_naming_the_kinds(kind):
    assert errors({"model": MODEL, "kind": kind}) == [((), "kind must be 'rl', 'offline' or 'generate'")]


def test_another_kinds_field_is_refused_where_a_flat_spec_ignored_it():
    assert errors({"model": MODEL, "generate": {"conversations": 5}}) == [
        (("rl", "generate"), "Extra inputs are not permitted")
    ]
    offline = {"model": MODEL, "kind": "offline", "train": {"algorithm": "dpo", "data": "pairs.jsonl"}}
    assert type(parse_job_spec(offline)) is OfflineJob and not OfflineJob.uses_rollout_servers
    assert errors(offline | {"health": [{"metric": "success", "below": 0.1}]}) == [
        (("offline", "health"), "Extra inputs are not permitted")
    ]


def test_each_kind_keeps_its_own_rules():
    assert errors({"model": MODEL, "kind": "generate"})[0][1].endswith("reward.mode must be multiturn")
    assert "set train.algorithm: dpo and train.data" in errors({"model": MODEL, "kind": "offline"})[0][1]
    assert errors({"model": MODEL, "train": {"data": "pairs.jsonl"}})[0][1].endswith(
        "train.data is read by offline jobs only (kind: offline)"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stall_timeout_s", 0),
        ("stall_timeout_s", -5),
        ("stall_timeout_s", 1e12),  # a "never" that would make the stall bound meaningless
        ("stall_timeout_s", "soon"),
        ("max_dead_share", 0),
        ("max_dead_share", 1.5),
    ],
)
def test_the_progress_bounds_refuse_values_that_disarm_or_break_them_naming_the_field(field, value):
    with pytest.raises(ValidationError) as refused:
        parse_job_spec({"model": {"path": "/models/tiny"}, "train": {field: value}})
    assert any(error["loc"][-1] == field for error in refused.value.errors())
