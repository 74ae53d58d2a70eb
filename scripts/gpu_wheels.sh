#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on a GPU machine beyond what its image holds (torch,
# transformers, numpy, safetensors, but no pydantic and no registry), into .whl/ (ignored
# by git; it travels beside the tree). These are the packages importing learner.trainer,
# learner.policy, learner.loss, learner.micro_batch, learner.weight_sender and
# services.weight_group brings in: pydantic and pydantic-settings for services.config,
# msgspec for services.protocol; pytest and its dependencies for tests/gpu. Versions are
# gpu.lock's; builds are CPython 3.12 manylinux x86_64, the machine's Python.
# Usage: scripts/gpu_wheels.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
python=${PYTHON:-.venv/bin/python}
names=(pydantic pydantic-core pydantic-settings python-dotenv typing-inspection annotated-types typing-extensions msgspec
	pytest pluggy iniconfig pygments)
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

pins=()
for name in "${names[@]}"; do
	pin=$(grep -m1 -i "^${name}==" requirements/gpu.lock | cut -d' ' -f1)
	[ -n "$pin" ] || { echo "no pin for $name in requirements/gpu.lock" >&2; exit 1; }
	pins+=("$pin")
done
rm -rf "$dest"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	"${platforms[@]/#/--platform=}" -d "$dest" "${pins[@]}"
du -sh "$dest"
