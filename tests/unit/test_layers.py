"""The package layering (docs/DESIGN.md, "Code layout"): every module imports only its own
package and the layers below it, so the contracts stay importable by every process and
the processes stay independent of one another."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each part of the tree -> the parts it may import (besides itself). Listed bottom-up.
ALLOWED = {
    "services": set(),  # contracts every process shares
    "services.api": {"services"},  # the job API process
    "judge_proxy": {"services"},  # the judge proxy process
    "rollout": {"services"},  # rollout servers
    "learner": {"services"},  # the learner
    "tandem": {"services", "services.api", "judge_proxy", "rollout", "learner"},  # cli, launcher, demo
}


def part_of(module: str) -> str | None:
    """The most specific entry of ALLOWED that `module` belongs to."""
    matches = [part for part in ALLOWED if module == part or module.startswith(part + ".")]
    return max(matches, key=len, default=None)


def imports_of(path: Path) -> set[str]:
    """Absolute module names `path` imports anywhere (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # from pkg import module
    return names


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for top in {part.split(".")[0] for part in ALLOWED}:
        for path in sorted((root / top).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            own = part_of(module)
            for name in imports_of(path):
                target = part_of(name)
                if target not in (None, own) and target not in ALLOWED[own]:
                    found.append(f"{module} imports {target} ({own} may import only {sorted(ALLOWED[own])})")
    return sorted(set(found))


def test_no_module_imports_a_package_above_it_or_beside_it():
    assert violations() == []


def test_the_check_sees_a_violation(tmp_path):
    """The check itself can fail: a contracts module importing the rollout server, and the
    learner importing the rollout server beside it."""
    for part, source in (
        ("services", "def f():\n    from rollout.server import RolloutServer\n"),
        ("learner", "from rollout import engine\nfrom services import protocol\n"),
    ):
        (tmp_path / part).mkdir()
        (tmp_path / part / "bad.py").write_text(source)
    assert violations(tmp_path) == [
        "learner.bad imports rollout (learner may import only ['services'])",
        "services.bad imports rollout (services may import only [])",
    ]


def test_the_contracts_import_without_torch_or_vllm():
    """Every process imports `services`; the API and the judge proxy must not pay for torch."""
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "services").rglob("*.py")
        if p.name != "__init__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted({'torch', 'vllm', 'transformers'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
