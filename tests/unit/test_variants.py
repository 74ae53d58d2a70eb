"""Tasks and tool kinds are types found by name: each name has one spec model (the job spec's
union) and one module that plays it (the rollout server's registry), and no other code asks
which task or tool kind it holds. Adding a task is a folder, its spec model and one registry
line; these tests say when one of the three is missing."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollout.tasks import TASKS
from rollout.tools.box import TOOL_MODULES
from services.config import TASK_NAMES, TASK_SPECS, TOOL_KINDS, RLJob, ToolsSpec, written_location

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("services", "rollout", "learner", "judge_proxy", "tandem")
REGISTRIES = {"rollout/tasks/__init__.py", "rollout/tools/box.py"}


def test_every_task_has_a_spec_model_and_a_module_that_loads_it():
    assert set(TASKS) == set(TASK_NAMES) == set(TASK_SPECS)
    for name, module in TASKS.items():
        assert callable(importlib.import_module(module).load), name


def test_every_task_that_says_it_writes_demonstrations_does():
    for name, model in TASK_SPECS.items():
        if model.demonstrated:
            rows = importlib.import_module(TASKS[name]).demonstrations(4, 0.5, 0)
            assert len(rows) == 4 and all(row["messages"] for row in rows), name


def test_every_tool_kind_has_a_spec_model_and_a_module_that_opens_it():
    assert set(TOOL_MODULES) == set(TOOL_KINDS)
    for kind, module in TOOL_MODULES.items():
        assert callable(importlib.import_module(module).open_tools), kind


@pytest.mark.parametrize("name", TASK_NAMES)
def test_a_task_section_is_the_model_its_name_picks(name):
    section = {"name": name} | ({"domain": "mock"} if name == "tau2" else {})
    assert type(RLJob.model_validate({"model": {"path": "m"}, "task": section}).task) is TASK_SPECS[name]


def test_a_task_section_without_a_name_is_clarify():
    assert RLJob.model_validate({"model": {"path": "m"}, "task": {}}).task.name == "clarify"


@pytest.mark.parametrize("kind", TOOL_KINDS)
def test_a_tool_section_is_the_model_its_kind_picks(kind):
    section = {"name": "t", "kind": kind} | ({"server": "catalogued"} if kind == "mcp" else {})
    assert ToolsSpec.model_validate({"tools": [section]}).tools[0].kind == kind


@pytest.mark.parametrize(
    ("section", "location", "message"),
    [
        ({"name": "chess"}, ("name",), "task.name must be 'clarify', 'multiply', 'math_chat', 'doc_edit_chat',"),
        ({"name": 3}, ("name",), "task.name must be"),
        ({"name": "clarify", "metric": "judge"}, ("metric",), "Extra inputs are not permitted"),
        ({"name": "math_chat", "metric": "vibes"}, ("metric",), "Input should be 'exact_match' or 'judge'"),
    ],
)
def test_a_bad_task_section_is_refused_naming_the_field_as_written(section, location, message):
    with pytest.raises(ValidationError) as caught:
        RLJob.model_validate({"model": {"path": "m"}, "task": section})
    [error] = caught.value.errors()
    assert written_location(error["loc"], error["type"]) == ("task", *location)
    assert message in error["msg"]


def name_branches(path: Path, root: Path = ROOT) -> list[str]:
    """Comparisons of an attribute `name` or `kind` with a task name or tool kind (`x.name ==
    "tau2"`, `t.kind in ("mcp", ...)`) in the module at `path`, as `line: source`."""
    names = set(TASK_NAMES) | set(TOOL_KINDS)
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        attributes = [s for s in sides if isinstance(s, ast.Attribute) and s.attr in ("name", "kind")]
        constants = {
            c.value
            for s in sides
            for c in ([s] if isinstance(s, ast.Constant) else getattr(s, "elts", []))
            if isinstance(c, ast.Constant)
        }
        if attributes and constants & names:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_product_module_but_a_registry_branches_on_a_task_name_or_a_tool_kind():
    found = [
        hit
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
        if str(path.relative_to(ROOT)) not in REGISTRIES
        for hit in name_branches(path)
    ]
    assert found == []


def test_the_branch_check_finds_a_branch(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('if spec.task.name == "tau2":\n    pass\nif tool.kind in ("mcp", "x"):\n    pass\n')
    assert name_branches(source, tmp_path) == [
        "m.py:1: spec.task.name == 'tau2'",
        "m.py:3: tool.kind in ('mcp', 'x')",
    ]
