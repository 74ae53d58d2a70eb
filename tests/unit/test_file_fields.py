"""Every job-spec field that names a file is found by `file_fields`, which a multi-tenant API
confines to the operator's folders: a field missed here would let a tenant's job read any
file the learner or a rollout server can."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from services import config
from services.config import OfflineJob, RLJob, file_fields
from services.config.common import FILE_MARK

FILE_NAMES = {"path", "data", "file", "contexts"}
"""Field names that, in a job spec, name a file or folder."""


def every_model() -> set[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    todo = [*config.JOB_KINDS, *config.TASK_SPECS.values(), *config.tools._TOOL_MODELS]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for info in model.model_fields.values():
            todo += [t for t in _types(info.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    return seen


def _types(annotation) -> list:

    args = typing.get_args(annotation)
    return [annotation] if not args else [t for a in args for t in _types(a)]


def test_every_field_named_as_a_file_is_declared_one():
    unmarked = [
        f"{model.__name__}.{name}"
        for model in every_model()
        for name, info in model.model_fields.items()
        if name in FILE_NAMES
        and not (isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get(FILE_MARK))
    ]
    assert unmarked == []


def test_file_fields_finds_every_file_a_spec_names_wherever_it_is():
    spec = RLJob.model_validate(
        {
            "model": {"path": "/m"},
            "task": {"name": "math_chat", "data": "/d.jsonl", "system_prompt": "hi"},
            "warm_start": {"data": "/w.jsonl"},
            "eval": {"data": "/e.jsonl"},
            "tools": {
                "file": "/t.yaml",
                "tools": [{"name": "c", "kind": "calculator"}, {"name": "s", "kind": "search", "data": "/s.jsonl"}],
            },
        }
    )
    found = {".".join(map(str, loc)): getattr(owner, name) for loc, owner, name in file_fields(spec)}
    assert found == {
        "model.path": "/m",
        "task.data": "/d.jsonl",
        "warm_start.data": "/w.jsonl",
        "tools.tools.1.data": "/s.jsonl",
        "tools.file": "/t.yaml",
        "eval.data": "/e.jsonl",
    }
    contexts = RLJob.model_validate({"model": {"path": "/m"}, "task": {"name": "clarify", "contexts": "/c.jsonl"}})
    assert [loc for loc, _, _ in file_fields(contexts)] == [("model", "path"), ("task", "contexts")]
    offline = OfflineJob.model_validate(
        {"kind": "offline", "model": {"path": "/m"}, "train": {"algorithm": "dpo", "data": "/p.jsonl"}}
    )
    assert [loc for loc, _, _ in file_fields(offline)] == [("model", "path"), ("train", "data")]
