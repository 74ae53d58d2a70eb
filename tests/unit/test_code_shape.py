"""Classes stay small enough to read in one sitting: none in the learner or the judge proxy
over 150 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CLASS_LINES = 150


def long_classes(root: Path = ROOT, packages: tuple[str, ...] = ("learner", "judge_proxy")) -> dict[str, int]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                    found[f"{module}.{node.name}"] = node.end_lineno - node.lineno + 1
    return found


def test_no_class_in_the_learner_or_the_judge_proxy_is_over_150_lines():
    assert long_classes() == {}


def test_the_check_counts_a_long_class(tmp_path):
    (tmp_path / "learner").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    (tmp_path / "learner" / "big.py").write_text(f"class Big:\n{body}\n\nclass Small:\n    pass\n")
    assert long_classes(tmp_path, ("learner",)) == {"learner.big.Big": MAX_CLASS_LINES + 1}
