"""`python -m bench`: the benchmarks and what each measures; `python -m bench NAME ...` runs
those (`all`: every one), one after another, with their default flags (`python -m
bench.NAME --help` lists a benchmark's own)."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

from bench import PARTS, SHARED

FOLDER = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """Each benchmark's name and the first line of its docstring."""
    found = {}
    for path in sorted(FOLDER.glob("*.py")):
        if not path.stem.startswith("__") and path.stem not in SHARED + PARTS:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            found[path.stem] = doc.splitlines()[0] if doc else ""
    return found


def main() -> None:
    known = benchmarks()
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run, or all: {', '.join(known)}")
    args = parser.parse_args()
    names = list(known) if args.names == ["all"] else args.names
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"no benchmark {', '.join(unknown)}: run python -m bench to list them")
    if not names:
        for name, line in known.items():
            print(f"{name:20} {line}")
    for name in names:
        print(f"== python -m bench.{name}", flush=True)
        if subprocess.run([sys.executable, "-m", f"bench.{name}"], cwd=FOLDER.parent).returncode != 0:
            sys.exit(f"bench.{name} failed")


if __name__ == "__main__":
    main()
