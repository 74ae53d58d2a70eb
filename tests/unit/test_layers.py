"""The package layering (docs/DESIGN.md, "Code layout"): every module imports only its own
package and the layers below it, so the contracts stay importable by every process and
the processes stay independent of one another. Inside `rollout/` the same holds between
its parts: tools and user simulators know no task, a task knows no other task; in
`bench/`, a benchmark knows no other benchmark. And no module imports itself back through
others (an import cycle)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import bench

ROOT = Path(__file__).resolve().parents[2]

ROLLOUT_PARTS = {"rollout.tools", "rollout.interactions", "rollout.tasks", "rollout.rewards"}

# Each part of the tree -> the parts or modules it may import (besides itself). Bottom-up.
ALLOWED = {
    "services": set(),  # contracts every process shares
    "services.api": {"services"},  # the job API process
    "judge_proxy": {"services"},  # the judge proxy process
    # rollout servers: the runtime (server, episodes, groups, engine) over four parts
    "rollout.tools": {"services"},  # what a policy may call, the code sandbox among them
    "rollout.interactions": {"services"},  # user simulators: they play a goal, whatever the task
    "rollout.tasks": {"services", "rollout.tools", "rollout.interactions", "rollout.episode"},
    "rollout.rewards": {"services", "rollout.tasks", "rollout.tools", "rollout.episode", "rollout.concurrent"},
    "rollout": {"services"} | ROLLOUT_PARTS,
    "learner": {"services"},  # the learner
    "devtools": {"services", "judge_proxy", "rollout"},  # development doubles: no product imports them
    "tandem": {"services", "services.api", "judge_proxy", "rollout", "learner", "devtools"},  # cli, launcher, demo
    # benchmarks and maintenance scripts: above every process; a benchmark imports another
    # only through the modules they share (BENCH_SHARED)
    "bench": {"services", "services.api", "judge_proxy", "rollout", "learner", "devtools", "tandem"},
    "scripts": {"services", "services.api", "judge_proxy", "rollout", "learner", "devtools", "tandem", "bench"},
}
BENCH_SHARED = {f"bench.{name}" for name in bench.SHARED}
"""The modules of bench/ that benchmarks share; any other is a benchmark of its own."""
SHARED_TASK_MODULES = {"base", "common", "contexts", "extraction"}
"""Modules of rollout/tasks that every task may use; any other name there is a task."""


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


def allowed(own: str, name: str) -> bool:
    target = part_of(name)
    permitted = ALLOWED[own]
    return target in (None, own) or target in permitted or any(name == m or name.startswith(m + ".") for m in permitted)


def task_of(module: str | None) -> str | None:
    """The task a module of rollout/tasks belongs to (`rollout.tasks.clarify.user` ->
    "clarify"), or None for the shared modules, the package itself and other modules."""
    parts = (module or "").split(".")
    if parts[:2] != ["rollout", "tasks"] or len(parts) < 3 or parts[2] in SHARED_TASK_MODULES:
        return None
    return parts[2]


def bench_of(module: str | None) -> str | None:
    """The benchmark a module of bench/ is (`bench.vs_trl` -> itself), or None for the
    shared modules, the package itself and other modules."""
    parts = (module or "").split(".")
    if parts[0] != "bench" or len(parts) < 2 or ".".join(parts[:2]) in BENCH_SHARED:
        return None
    return ".".join(parts[:2])


def modules(root: Path) -> dict[str, Path]:
    """Every module of the project's packages, by name (a package by its own name)."""
    found = {}
    for top in {part.split(".")[0] for part in ALLOWED}:
        for path in sorted((root / top).rglob("*.py")):
            if ".venv" in path.parts:  # a benchmark's own environment (bench/trl_side/.venv)
                continue
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports: `from pkg import sub` names pkg.sub when that is
    a module, else pkg (a name defined in it)."""

    def module_of(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(module_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update(module_of(f"{node.module}.{alias.name}") for alias in node.names)
    return found - {None}


def violations(root: Path = ROOT) -> list[str]:
    found = []
    known = modules(root)
    for module, path in known.items():
        own = part_of(module)
        for name in imports_of(path):
            if not allowed(own, name):
                found.append(f"{module} imports {part_of(name)} ({own} may import only {sorted(ALLOWED[own])})")
        for target in imported_modules(path, known):
            if task_of(module) and task_of(target) not in (None, task_of(module)):
                found.append(f"{module} imports the task {task_of(target)} (a task knows no other task)")
            if bench_of(module) and bench_of(target) not in (None, bench_of(module)):
                found.append(f"{module} imports the benchmark {target} (benchmarks share only {sorted(BENCH_SHARED)})")
    return sorted(set(found))


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Every cycle of imports among the project's modules, each once. Imports inside a
    function or under TYPE_CHECKING count too: they cannot deadlock a load, but a cycle
    through them is the same tangle for a reader."""
    known = modules(root)
    graph = {module: sorted(imported_modules(path, known) - {module}) for module, path in known.items()}
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_module_imports_a_package_above_it_or_beside_it():
    assert violations() == []


TRAINING = {
    "learner.trainer",
    "learner.attention",
    "learner.logprobs",
    "learner.dpo",
    "learner.reduce",
    "learner.micro_batch",
    "learner.batching",
    "learner.loss",
    "learner.policy",
    "learner.checkpoint",
    "learner.durable",
    "learner.weight_sender",
    "learner.control",
}
"""The learner's modules every rank runs (the training itself); the rest is rank 0's."""
PURE = {"learner.loss", "learner.batching"}
"""Functions of tensors and lists: they import nothing of the learner's."""


def learner_violations(root: Path = ROOT) -> list[str]:
    """Inside learner/: the training side never reaches into rank 0's bookkeeping (jobs,
    streams, versions), and the pure modules import nothing of the learner."""
    known = modules(root)
    found = []
    for module, path in known.items():
        if not module.startswith("learner."):
            continue
        for target in imported_modules(path, known):
            if not target.startswith("learner.") or target == module:
                continue
            if module in PURE:
                found.append(f"{module} imports {target} (a pure module imports nothing of the learner)")
            elif module in TRAINING and target not in TRAINING:
                found.append(f"{module} imports {target} (the training side knows nothing of rank 0's)")
    return sorted(found)


def test_the_learners_training_side_knows_nothing_of_rank_0():
    assert learner_violations() == []


def test_the_learner_check_sees_a_trainer_that_reads_the_job_stream(tmp_path):
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "intake.py").write_text("X = 1\n")
    (tmp_path / "learner" / "trainer.py").write_text("from learner.intake import X\n")
    (tmp_path / "learner" / "loss.py").write_text("from learner import trainer\n")
    assert learner_violations(tmp_path) == [
        "learner.loss imports learner.trainer (a pure module imports nothing of the learner)",
        "learner.trainer imports learner.intake (the training side knows nothing of rank 0's)",
    ]


def test_no_module_imports_itself_back_through_others():
    assert import_cycles() == []


def test_the_cycle_check_sees_a_cycle(tmp_path):
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "a.py").write_text("from learner.b import run\n")
    (tmp_path / "learner" / "b.py").write_text("def run():\n    from learner import a\n")
    assert import_cycles(tmp_path) == [["learner.a", "learner.b", "learner.a"]]


def test_the_check_sees_a_user_simulator_that_knows_a_task_and_a_task_that_knows_another(tmp_path):
    for folder, name, source in (
        ("rollout/interactions", "user.py", "from rollout.tasks import clarify\n"),
        ("rollout/tasks/clarify", "__init__.py", "def read_goal(text):\n    return None\n"),
        (
            "rollout/tasks/code",
            "__init__.py",
            "from rollout.tasks.clarify import read_goal\nfrom rollout.tasks import base\n",
        ),
    ):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / name).write_text(source)
    assert violations(tmp_path) == [
        "rollout.interactions.user imports rollout.tasks (rollout.interactions may import only ['services'])",
        "rollout.tasks.code imports the task clarify (a task knows no other task)",
    ]


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
