"""The learner on a GPU: a sharded model that lands there and scores as transformers does,
packed and varlen rows equal to padded ones within the compute dtype's tolerance (and the
packing probe passing, so a bf16 job packs), finite steps that move the weights, and
logits kept in fp32 under bf16 mixed precision."""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import make_samples, make_trainer

from bench.gpu_check import logprobs as per_token_logprobs  # the GPU check's own reading, one copy

pytestmark = pytest.mark.gpu

COMPUTE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def test_the_sharded_model_is_on_the_gpu_and_scores_as_transformers_does(process_group, model_folder):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(model_folder, "float32")
    assert {p.device.type for p in trainer.model.parameters()} == {"cuda"}
    samples = make_samples(4, (20, 60))
    ours = per_token_logprobs(trainer, samples, "padded")

    plain = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).cuda()
    theirs = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens], device="cuda")
            logp = torch.log_softmax(plain(input_ids=ids).logits.float()[0, :-1], -1)
            values = torch.cat([torch.zeros(1, device="cuda"), logp.gather(-1, ids[0, 1:, None])[:, 0]])
            theirs.append(values[torch.tensor(s.mask, device="cuda") > 0])
    assert (ours - torch.cat(theirs)).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_and_varlen_rows_score_as_padded_rows_within_the_dtypes_tolerance(process_group, model_folder, dtype):
    from learner import policy

    trainer = make_trainer(model_folder, dtype)
    assert trainer.can_pack, "the packing probe must pass on CUDA, or every job trains in padded rows"
    samples = make_samples(12, (16, 200), seed=1)
    padded = per_token_logprobs(trainer, samples, "padded")
    tolerance = policy.packing_tolerance(COMPUTE[dtype])
    for packing in ("packed", "varlen"):  # packed: transformers' dense mask (`train.packing: mask`)
        packed = per_token_logprobs(trainer, samples, packing)
        difference = float((packed - padded).abs().max())
        print(f"{dtype} {packing} vs padded: max {difference:.3g} (tolerance {tolerance:.3g})")
        assert difference <= tolerance, packing


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sft_and_rl_steps_are_finite_and_move_the_weights(process_group, model_folder, dtype):
    trainer = make_trainer(model_folder, dtype)
    samples = make_samples(8, (32, 128), seed=2)
    before = next(trainer.model.parameters()).full_tensor().clone()
    for step in (trainer.sft_step, trainer.rl_step):
        stats = step(samples)
        assert all(math.isfinite(v) for v in stats.values()), stats
    assert not torch.equal(before, next(trainer.model.parameters()).full_tensor())


def test_bf16_operands_give_fp32_logits_on_the_gpu():
    from learner import logprobs

    generator = torch.Generator().manual_seed(3)
    hidden = (4 * torch.randn(256, 512, generator=generator)).bfloat16().cuda()
    weight = torch.randn(4096, 512, generator=generator).bfloat16().cuda()
    exact = hidden.double() @ weight.double().T
    logits = logprobs._logits(hidden, weight, 1.0)
    print(f"torch.mm out_dtype on CUDA: {logprobs._FP32_OUTPUT_MM.get('cuda')}")
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max() < 1e-4 * exact.abs().max()
