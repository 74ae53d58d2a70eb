"""Only rank 0 reads the model: the other ranks build it on the meta device and receive
their shards and the buffers a state dict leaves out (rotary frequencies) from rank 0. Two
real gloo ranks; what the meta-built rank ends up with must equal the folder's weights."""

from __future__ import annotations

import pytest
import torch
from ranks import run_two_ranks

RANK = """
import sys
import torch, torch.distributed as dist

rank, port, path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
from learner import policy

model = policy.sharded_model(path, torch.device("cpu"), 2, "float32")
names = [name for name, _ in model.named_parameters()]
full = policy.full_tensors(model, names, "float32")  # a collective: both ranks' shards
if rank == 1:
    buffers = {str(i): b.clone() for i, b in enumerate(policy.non_persistent_buffers(model))}
    torch.save({"params": full, "buffers": buffers}, out)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_rank_that_built_on_meta_holds_the_folders_weights_and_buffers(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from learner import policy

    out = tmp_path / "rank1.pt"
    run_two_ranks(RANK, str(tiny_model), str(out))

    got = torch.load(out)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    expected = dict(plain.named_parameters())
    assert set(got["params"]) == set(expected)
    for name, tensor in got["params"].items():
        assert torch.equal(tensor, expected[name].detach()), name
    buffers = policy.non_persistent_buffers(plain)
    assert buffers, "the model has rotary frequencies to carry over"
    assert all(torch.equal(got["buffers"][str(i)], b) for i, b in enumerate(buffers))
