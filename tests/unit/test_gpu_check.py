"""The GPU machine's prepared command (`python -m bench.gpu_check`) works before a GPU sees it: its
`--device cpu` dry run reports every section, and the wheels it needs there fit beside the tree."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]

SECTIONS = ["versions", "matmul", "packing", "steps", "memory", "weights", "tests_gpu"]
TRAVEL_LIMIT_BYTES = 64 << 20
"""What may travel to the GPU machine: the tracked tree and the carried wheel folder together."""


@pytest.mark.slow
def test_cpu_dry_run_reports_every_section_ok_or_a_named_skip(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]

    assert [r["section"] for r in rows] == SECTIONS, done.stdout + done.stderr
    assert {r["shape"] for r in rows} == {"tiny"}
    for row in rows:
        assert row["status"] == "ok" or (row["status"] == "skip" and row["reason"]), row
    assert done.returncode == 0
    by_name = {r["section"]: r for r in rows}
    # fp32 on CPU: packing and the varlen stand-in change nothing but summation order.
    packing = by_name["packing"]
    assert packing["float32.probe_packs"] is True
    assert packing["float32.packed_vs_padded"]["max_abs"] < 1e-5
    assert packing["float32.varlen_vs_padded"]["max_abs"] < 1e-5
    steps = by_name["steps"]
    for key in ("plain_transformers", "packed.sft", "packed.rl", "padded.sft", "padded.rl", "varlen.sft", "varlen.rl"):
        assert steps[key]["tokens_per_s"] > 0, key
    weights = by_name["weights"]
    assert weights["gloo_two_process.1mib"]["bytes"] == weights["bytes"]  # every byte, checksum matched
    # tests/gpu ran and skipped every test, by name, rather than passing on a machine without CUDA.
    assert by_name["tests_gpu"]["returncode"] == 0
    assert re.fullmatch(r"\d+ skipped in [\d.]+s", by_name["tests_gpu"]["summary"]), by_name["tests_gpu"]


@pytest.mark.slow  # imports transformers
def test_llama_1b_shape_has_about_a_billion_parameters():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**gpu_check.LLAMA_1B))
    # 16 layers of attention (2 * 2048^2 + 2 * 2048 * 512) and MLP (3 * 2048 * 8192), a tied
    # 49152 x 2048 embedding, and the norms (33 * 2048).
    layer = 2 * 2048**2 + 2 * 2048 * 512 + 3 * 2048 * 8192
    assert sum(p.numel() for p in model.parameters()) == 16 * layer + 49152 * 2048 + 33 * 2048 == 1_073_809_408


def test_sections_run_in_their_fixed_order_and_unknown_names_are_refused():
    assert gpu_check.section_names("memory,steps,matmul") == ["matmul", "steps", "memory"]
    with pytest.raises(argparse.ArgumentTypeError, match="'step'"):
        gpu_check.section_names("versions,step")


@pytest.mark.slow  # downloads a dozen wheels from the package index
def test_wheel_folder_fits_beside_the_tree(tmp_path):
    """Made as the docs say (scripts/gpu_wheels.sh, from the locks), then measured with the tree."""
    wheels = tmp_path / "whl"
    subprocess.run(["scripts/gpu_wheels.sh", str(wheels)], cwd=ROOT, check=True, timeout=600)
    names = {f.name.split("-")[0].lower() for f in wheels.glob("*.whl")}
    assert {"pydantic", "msgspec", "pytest", "pluggy"} <= names, names
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree_bytes = sum((ROOT / p).stat().st_size for p in tracked.decode().split("\0") if p and (ROOT / p).is_file())
    wheel_bytes = sum(f.stat().st_size for f in wheels.rglob("*") if f.is_file())
    assert wheel_bytes + tree_bytes < TRAVEL_LIMIT_BYTES, (wheel_bytes, tree_bytes)
