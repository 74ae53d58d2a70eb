"""The policy model under FSDP2 on every rank: building it, its optimizer, and its weights
going out (full tensors for a weight update, a Hugging Face folder for export)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from learner import attention, durable, logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def sharded_model(
    path: str, device: torch.device, world_size: int, dtype: str, packing: str = "varlen"
) -> PreTrainedModel:
    """The model at `path` in fp32, each decoder layer and then the whole model sharded over
    `world_size` ranks; bf16 compute with fp32 gradient reduction on CUDA when `dtype` asks.
    Its attention is the one `packing` needs (`learner.attention`), and it has
    `learner.logprobs`' chunked logprob method.

    Only rank 0 reads the weights, into host memory; the other ranks build the model on the
    meta device (no memory), shard it, allocate their shards and receive them from rank 0.
    No GPU ever holds the whole fp32 model either: `fully_shard` moves each layer to the
    device as it shards it, so rank 0's GPU holds its shards and one full layer at a time."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    implementation = attention.implementation(packing)
    reads = world_size == 1 or dist.get_rank() == 0
    if reads:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=implementation)
        # Views of the host copies, for the other ranks: they outlive the parameters
        # `fully_shard` moves to the device.
        full = {name: tensor.detach() for name, tensor in model.state_dict().items()} if world_size > 1 else {}
    else:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=implementation)
        full = {}
    mesh = init_device_mesh(device.type, (world_size,))
    mixed = MixedPrecisionPolicy()  # fully_shard's default: compute in the parameters' dtype
    if compute_dtype(device, dtype) == torch.bfloat16:
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mixed)
    fully_shard(model, mesh=mesh, mp_policy=mixed)
    if world_size > 1:
        if not reads:
            model.to_empty(device=device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
        for buffer in non_persistent_buffers(model):  # computed at build (rotary frequencies), not saved
            dist.broadcast(buffer, src=0)
    logprobs.attach(model)
    return model


def non_persistent_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """Buffers a state dict leaves out, in a fixed order."""
    return [
        buffer
        for module in model.modules()
        for name, buffer in module.named_buffers(recurse=False)
        if name in module._non_persistent_buffers_set
    ]


def compute_dtype(device: torch.device, dtype: str) -> torch.dtype:
    """The dtype the sharded model computes in, for a resolved `ModelSpec.dtype`: on CUDA
    bf16 mixed precision for either 16-bit dtype (fp16 compute would need loss scaling),
    else fp32."""
    return torch.bfloat16 if device.type == "cuda" and dtype in ("bfloat16", "float16") else torch.float32


PACKING_TOLERANCE_EPS = 16
"""Packed and unpacked logprobs may differ by this many of the compute dtype's epsilon (and
at least 1e-4 nats): matrix products over rows of other lengths round differently. bf16's
epsilon is 2^-7, so 0.125 nats: an H100 measured 0.021 between its packed and padded
bf16 logprobs, while attention that leaks across sequences moves them by far more."""


def vocab_size(path: str) -> int:
    """Rows of the embedding of the model at `path`: the token ids it can take."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


def optimizer(model: torch.nn.Module, lr: float, weight_decay: float, decay_steps: int = 0):
    """AdamW over the sharded (DTensor) parameters (build it only while sharded), with a
    learning rate that decays linearly to 10% over `decay_steps` (the warm start, so the
    policy RL starts from is settled) or stays constant (RL). Fused: one kernel per
    parameter instead of a dozen elementwise passes, on CPU as on CUDA."""
    adamw = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99), fused=True)
    decay = (lambda step: max(0.1, 1.0 - step / decay_steps)) if decay_steps else (lambda step: 1.0)
    return adamw, torch.optim.lr_scheduler.LambdaLR(adamw, decay)


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float,
    finite_loss: bool = True,
) -> tuple[float, bool]:
    """Clip the gradient and step, unless it is exactly zero or not finite, or the loss is
    not (`finite_loss`); returns (norm before clipping, stepped). Skipping leaves the
    parameters, the AdamW moments and the schedule as they were.

    A zero gradient (every advantage of the batch 0, no KL term) is no reason to move, yet
    AdamW would: its momentum carries the last real update on, about ten updates' worth
    with beta1 = 0.9, so a policy whose groups have no spread would keep drifting the way it
    last went. A NaN or inf gradient would be clipped into NaN and poison every parameter
    and both moments for good. The norm is global (all ranks) and `finite_loss` must be the
    same on every rank, so all ranks agree."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    stepped = finite_loss and math.isfinite(grad_norm) and grad_norm != 0.0
    if stepped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def packing_tolerance(compute: torch.dtype) -> float:
    """How far packed logprobs may be from unpacked ones in `compute` (`PACKING_TOLERANCE_EPS`)."""
    return max(PACKING_TOLERANCE_EPS * torch.finfo(compute).eps, 1e-4)


def separates_packed_sequences(model: PreTrainedModel, device: torch.device, compute: torch.dtype) -> bool:
    """Whether this model's packed logprobs equal its unpacked ones, within the tolerance of
    the dtype it `compute`s in (`PACKING_TOLERANCE_EPS`): whether its attention keeps packed
    sequences apart (transformers' sdpa does so from restarting position ids; so does
    `learner.attention`'s varlen). Padding is used otherwise."""

    def scored(ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
        method = getattr(model, logprobs.METHOD)
        everything = torch.ones_like(ids, dtype=torch.bool)
        return method(ids, torch.tensor([positions], device=device), everything, 1.0, False)[0]

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, model.config.vocab_size, (1, n), generator=generator).to(device) for n in (5, 4))
    with torch.no_grad():
        alone = scored(b, [0, 1, 2, 3])
        both = scored(torch.cat([a, b], 1), [0, 1, 2, 3, 4, 0, 1, 2, 3])
    reshard(model)
    tolerance = packing_tolerance(compute)
    difference = float((alone - both[:, 5:]).abs().max())
    if difference > tolerance:
        log.warning(
            "packed logprobs differ from unpacked ones by %.3g (over %.3g for %s): training in padded rows",
            difference,
            tolerance,
            compute,
        )
    return difference <= tolerance


def reshard(model: torch.nn.Module) -> None:
    """Free the full parameters that a forward without backward leaves gathered on the root
    module, so the optimizer (which holds the shards) and the next forward agree. `model`
    is `sharded_model`'s: `fully_shard` made it an `FSDPModule`."""
    if not isinstance(model, FSDPModule):
        raise TypeError(f"{type(model).__name__} is not sharded: only a sharded_model reshards")
    model.reshard()


def parameter_specs(model: torch.nn.Module, dtype: str) -> list[tuple[str, list[int], str]]:
    """(checkpoint name, full shape, wire dtype) of every parameter, in a fixed order."""
    return [(name, list(p.shape), dtype) for name, p in model.named_parameters()]


def full_tensors(model: torch.nn.Module, names: list[str], dtype: str) -> dict[str, torch.Tensor]:
    """Gather full tensors of `names` from their shards (a collective: all ranks call it)."""
    params = dict(model.named_parameters())
    wire = getattr(torch, dtype)
    out = {}
    for name in names:
        p = params[name].detach()
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.to(wire)
    return out


def export(model: torch.nn.Module, source: str, out_dir: str, rank: int) -> None:
    """Save the policy as a Hugging Face folder (rank 0 writes; all ranks must call)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        save_hf_folder(model, _plain_tensors(state), source, Path(out_dir))


def _plain_tensors(state: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """`state`, a full state dict, whose values are all tensors (no shards, no nested dicts)."""
    tensors = {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
    if len(tensors) != len(state):
        raise TypeError(f"not a full state dict of tensors: {sorted(state.keys() - tensors.keys())}")
    return tensors


def save_hf_folder(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, out_dir: Path) -> None:
    """`state` (full tensors of `model`) as a Hugging Face folder, with the config, tokenizer
    and generation config of the model at `source`. A weight tied to another (SmolLM2's
    lm_head is its embedding) is saved once, as transformers and vLLM expect. Written beside
    `out_dir` and renamed into place (`durable.replaced_folder`): a reader of `out_dir` (a
    rollout server, `tandem export`) finds the old export or the new one whole, never a mix."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    with durable.replaced_folder(out_dir) as staging:
        save_file({k: v.contiguous() for k, v in state.items() if k not in tied}, staging / "model.safetensors")
        AutoConfig.from_pretrained(source).save_pretrained(staging)
        AutoTokenizer.from_pretrained(source).save_pretrained(staging)
        generation = Path(source) / "generation_config.json"
        if generation.exists():
            (staging / generation.name).write_text(generation.read_text())
