"""CUDA-only tests, each marked `gpu`: skipped (and reported as skipped) where torch sees no GPU.

This conftest stands alone: `python -m bench.gpu_check` runs this folder on a GPU machine with
`--confcutdir=tests/gpu`, where the root conftest's imports (Redis, vLLM) are absent. The
skip hook sees every item of a session, so a `gpu` test anywhere under tests/ is skipped
on a machine without CUDA whenever this folder is part of the run (`make test` is).
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import SHAPE, free_port


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch sees no GPU on this machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def process_group():
    """A one-rank default group on GPU 0, as torchrun gives a single learner rank."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(folder)
    return folder
