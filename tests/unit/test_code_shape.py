"""The product's code stays small enough to read in one sitting: no class over 150 lines, no
module over 600 and no function over 60, in any product package. An exemption is named
here with the reason a split would not make its code clearer."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("services", "rollout", "learner", "judge_proxy", "tandem")
MAX_CLASS_LINES = 150
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
EXEMPT = {
    "rollout.engine.Engine": "the one wrapper of vLLM's engine: generation, scoring, weight updates and the "
    "pause and resume around them share its handle and its stall clock, and a split would put vLLM calls in "
    "two places",
    "services.judge_client.JudgeClient": "the client of every LLM call: chat, judge and judge_group share one "
    "session, one retry and outage loop and one spend accounting",
    "rollout.server.RolloutServer": "the process: its run loop, heartbeat and drain share `stopping` and the "
    "drain event, which a split would hand across objects",
    "rollout.tools.sandbox": "run as the program inside the sandbox (`python -I -S /sandbox.py`), where it "
    "cannot import a sibling module",
}
"""Name -> why it is as long as it is."""


def too_long(root: Path = ROOT, packages: tuple[str, ...] = PRODUCT) -> dict[str, int]:
    """Classes, modules and functions over their bound, by dotted name, with their lines."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            text = path.read_text()
            if len(text.splitlines()) > MAX_MODULE_LINES:
                found[module] = len(text.splitlines())
            for node in ast.walk(ast.parse(text, str(path))):
                lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                    found[f"{module}.{node.name}"] = lines
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
                    found[f"{module}.{node.name}"] = lines
    return found


def test_no_class_module_or_function_of_the_product_is_over_its_bound_but_the_exempt():
    assert {name: lines for name, lines in too_long().items() if name not in EXEMPT} == {}


def test_every_exemption_is_still_needed():
    assert sorted(EXEMPT.keys() - too_long().keys()) == []


def test_the_check_counts_a_long_class_module_and_function(tmp_path):
    (tmp_path / "learner").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    function = "def f():\n" + "".join(f"    y{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "learner" / "big.py").write_text(f"class Big:\n{body}\n\nclass Small:\n    pass\n\n\n{function}")
    (tmp_path / "learner" / "long.py").write_text("z = 0\n" * (MAX_MODULE_LINES + 1))
    assert too_long(tmp_path, ("learner",)) == {
        "learner.big.Big": MAX_CLASS_LINES + 1,
        "learner.big.f": MAX_FUNCTION_LINES + 1,
        "learner.long": MAX_MODULE_LINES + 1,
    }
