"""The weight broadcast with CUDA tensors: a one-rank NCCL group (the learner alone, as
the sender opens it), gloo between two processes with buffers on the GPU (the path a
learner and an engine sharing one GPU take), and the backend choice from real device names."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from gpu_support import free_port

from services import weight_group

pytestmark = pytest.mark.gpu


def model_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"embed": (2048, 256), "a.weight": (256, 256), "a.bias": (256,), "norm": (256,), "big": (4096, 1024)}
    return {name: torch.randn(*shape, generator=generator).bfloat16().cuda() for name, shape in shapes.items()}


def buckets_of(tensors: dict[str, torch.Tensor], mib: int) -> list:
    return weight_group.plan_buckets([(n, list(t.shape), "bfloat16") for n, t in tensors.items()], mib << 20)


def checksum(pairs) -> float:
    return sum(float(t.double().sum()) for _, t in pairs)


def test_a_one_rank_nccl_group_sends_every_bucket():
    tensors = model_tensors()
    buckets = buckets_of(tensors, 1)
    store = weight_group.host_store(free_port(), 60)
    group = weight_group.open_group(store, "nccl", 1, 0, 1, 60)
    fetch = lambda bucket: {t.name: tensors[t.name] for t in bucket.tensors}  # noqa: E731
    sent = weight_group.send_buckets(group, buckets, fetch, 60, torch.device("cuda", 0), [None, None])
    torch.cuda.synchronize()
    assert sent == sum(t.numel() * 2 for t in tensors.values())
    weight_group.close_group(group)


def receive(port: int, buckets: list, sums) -> None:
    torch.cuda.set_device(0)
    store = weight_group.connect_store("127.0.0.1", port, 60)
    group = weight_group.open_group(store, "gloo", 1, 1, 2, 60)
    sums.put(checksum(weight_group.receive_buckets(group, buckets, 60, torch.device("cuda", 0), [])))


def test_gloo_carries_cuda_buffers_between_two_processes():
    tensors = model_tensors()
    buckets = buckets_of(tensors, 4)
    port = free_port()
    store = weight_group.host_store(port, 60)
    spawn = mp.get_context("spawn")
    sums = spawn.Queue()
    receiver = spawn.Process(target=receive, args=(port, buckets, sums))
    receiver.start()
    group = weight_group.open_group(store, "gloo", 1, 0, 2, 60)
    fetch = lambda bucket: {t.name: tensors[t.name] for t in bucket.tensors}  # noqa: E731
    weight_group.send_buckets(group, buckets, fetch, 60, torch.device("cuda", 0), [None, None])
    received = sums.get(timeout=60)
    receiver.join(timeout=30)
    assert received == pytest.approx(checksum(tensors.items()), rel=1e-9)


def test_a_learner_and_an_engine_on_this_gpu_get_gloo():
    here = weight_group.device_identity(torch.device("cuda", 0))
    assert here.startswith("cuda:") and here == weight_group.device_identity(torch.device("cuda", 0))
    assert weight_group.choose_backend(here, [[here]])[0] == "gloo"
    assert weight_group.choose_backend(here, [["cuda:another-gpu"]])[0] == "nccl"
