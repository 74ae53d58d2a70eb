"""What the CUDA paths decide, checked without a GPU (a CUDA device object and vLLM's
options need none): dtype defaults that suit the device (a job that names none serves and
ships bf16 on CUDA, fp32 on CPU; the learner never trains in fp32 while vLLM serves 16-bit
weights), and a rollout engine's memory share less the weight receiver's buffers."""

import pytest
import torch

from learner import policy
from rollout import engine as engine_module
from rollout.engine import engine_options
from services.config import ModelSpec


@pytest.mark.parametrize(
    ("dtype", "on_cuda", "resolved"),
    [
        ("auto", True, "bfloat16"),
        ("auto", False, "float32"),
        ("float16", True, "float16"),
        ("float32", True, "float32"),
        ("bfloat16", False, "bfloat16"),
    ],
)
def test_auto_is_bf16_on_cuda_and_fp32_on_cpu_and_a_named_dtype_stays(dtype, on_cuda, resolved):
    assert ModelSpec(path="/m", dtype=dtype).resolved_dtype(on_cuda) == resolved


def test_a_spec_without_a_dtype_is_auto():
    assert ModelSpec(path="/m").dtype == "auto"


@pytest.mark.parametrize(
    ("device", "dtype", "compute"),
    [
        ("cuda", "bfloat16", torch.bfloat16),
        ("cuda", "float16", torch.bfloat16),  # 16-bit on both sides, without fp16's loss scaling
        ("cuda", "float32", torch.float32),
        ("cpu", "bfloat16", torch.float32),
    ],
)
def test_the_learner_computes_in_bf16_on_cuda_for_either_16_bit_dtype(device, dtype, compute):
    assert policy.compute_dtype(torch.device(device), dtype) == compute


ENGINE_ENV = ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")
"""What `engine_options` sets in the environment: restored after each test."""


@pytest.mark.parametrize(("on_gpu", "served"), [(True, "bfloat16"), (False, "float32")])
def test_vllm_serves_the_resolved_dtype(monkeypatch, tmp_path, on_gpu, served):
    for name in ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    (tmp_path / "config.json").write_text("{}")
    assert engine_options(ModelSpec(path=str(tmp_path)), 1.0)["dtype"] == served


def test_a_rollout_engine_on_a_gpu_leaves_room_for_the_weights_it_receives(monkeypatch, tmp_path):
    """The receiver keeps a whole model in the wire dtype outside vLLM's budget: 1000
    parameters in bf16 on an 80 kB GPU are 2.5% of it. A served judge receives nothing."""
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text("{}")
    save_file({"a": torch.zeros(10, 40), "b": torch.zeros(600)}, str(tmp_path / "model.safetensors"))
    for name in ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module, "gpu_total_bytes", lambda: 80_000)
    spec = ModelSpec(path=str(tmp_path))

    assert engine_module.parameter_count(str(tmp_path)) == 1000
    assert engine_options(spec, 1.0, receives_weights=True)["gpu_memory_utilization"] == pytest.approx(0.85 - 0.025)
    assert engine_options(spec, 1.0, memory_utilization=0.3, receives_weights=True)[
        "gpu_memory_utilization"
    ] == pytest.approx(0.3 - 0.025)
    assert engine_options(spec, 1.0)["gpu_memory_utilization"] == 0.85
    assert engine_options(ModelSpec(path=str(tmp_path), dtype="float32"), 1.0, receives_weights=True)[
        "gpu_memory_utilization"
    ] == pytest.approx(0.85 - 0.05)


def test_an_engine_share_the_received_weights_would_use_up_is_refused_with_the_reason(monkeypatch, tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text("{}")
    save_file({"a": torch.zeros(1000)}, str(tmp_path / "model.safetensors"))  # 2000 bytes in bf16
    for name in ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module, "gpu_total_bytes", lambda: 7_000)  # 0.3 - 0.286 left
    with pytest.raises(ValueError, match="TANDEM_MEMORY_UTILIZATION"):
        engine_options(ModelSpec(path=str(tmp_path)), 1.0, memory_utilization=0.3, receives_weights=True)


@pytest.mark.parametrize("dtype", ["float8", "torch.bfloat16", "", 16])
def test_a_dtype_outside_the_list_is_refused_naming_the_field(dtype):
    from pydantic import ValidationError

    from services.config import parse_job_spec

    with pytest.raises(ValidationError) as refused:
        parse_job_spec({"model": {"path": "/m", "dtype": dtype}})
    assert ("model", "dtype") in {error["loc"][-2:] for error in refused.value.errors()}
