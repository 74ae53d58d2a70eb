"""Per-token logprobs without the full-vocabulary logits in memory.

The logprob of token t+1 after t is `logits[t, target] - logsumexp(logits[t])` with
`logits = hidden @ W.T / temperature`. Computed the plain way, a micro-batch of T tokens
holds [T, V] logits several times over (the model's output, an fp32 copy, the tempered
copy, log_softmax saved for backward, its gradient): at T = 16k and V = 49k each fp32 copy
is 3.2 GB. Here the output projection is applied a chunk of tokens at a time and only
[T] numbers are kept: the logprob, the logsumexp and (when asked) the entropy. Backward
projects each chunk again and forms the gradient from the softmax,

    d logp[t] / d logits[t] = (onehot(target) - softmax(logits[t])) / temperature,

so the peak is one chunk's [C, V] in fp32 (`CHUNK_BYTES`) at the price of one more pass
of the output projection. The first chunks' softmax is kept for backward instead, up to
`KEEP_BYTES` in all, so a micro-batch of a few thousand tokens pays little or none of that
pass while a long one stays within a bounded memory. Only the positions that a loss reads
(`scored`) are projected at all: prompt and user tokens are context and their logprobs
are never used.

The method runs inside FSDP's forward hooks (`attach`), so the root module's parameters
(embeddings, final norm, output projection) are gathered around it as for `forward`.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from learner.micro_batch import MicroBatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CHUNK_BYTES = 64 * 2**20
"""fp32 logits per chunk: 64 MiB, about 340 tokens at a 49k vocabulary."""

KEEP_BYTES = 256 * 2**20
"""At most this much of the chunks' fp32 softmax is kept from forward for backward, where
it saves projecting those chunks again: 4 chunks, about 1,360 tokens at a 49k vocabulary.
The projection again measured 7% of an SFT step on SmolLM2 (2,048 tokens a micro-batch)."""

METHOD = "tandem_token_logprobs"


def attach(model: PreTrainedModel) -> None:
    """Give `model` (a transformers causal LM, FSDP-sharded or not) the method
    `tandem_token_logprobs(input_ids, position_ids, scored, temperature, with_entropy)`,
    run with FSDP's pre- and post-forward hooks like `forward`."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(model, METHOD, types.MethodType(_token_logprobs, model))
    register_fsdp_forward_method(model, METHOD)


def micro_batch_logprobs(
    model: torch.nn.Module,
    micro: MicroBatch,
    temperature: float,
    with_entropy: bool = False,
    scored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T] logprob of each real token of `micro` given the ones before it in its sequence,
    and optionally the entropy it was drawn from. 0 for a sequence's first token, which is
    always context, and where `scored` ([T], e.g. the loss mask) is 0: a loss never reads
    those, so they are not computed. `model` must be `attach`ed."""
    rows = micro.keep.clone()
    if scored is not None:
        rows[micro.keep] = scored > 0
    method = getattr(model, METHOD)
    picked, entropy = method(
        micro.input_ids, micro.position_ids, rows.view(micro.input_ids.shape), temperature, with_entropy
    )
    return picked.flatten()[micro.keep], entropy.flatten()[micro.keep] if entropy is not None else None


def _token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    scored: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[R, W] rows -> ([R, W] fp32 logprob of each token after the one before it in its
    sequence, 0 where `scored` [R, W] is False and where a sequence starts (position 0);
    the entropy of the tempered distribution the token was drawn from, or None)."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    where = scored & (position_ids > 0)  # a sequence's first token has nothing before it
    # The hidden state before token t scores token t.
    picked_hidden = hidden[:, :-1][where[:, 1:]]
    targets = input_ids[where]
    weight = model.get_output_embeddings().weight
    keep = KEEP_BYTES if torch.is_grad_enabled() else 0
    logp, entropy = ChunkedLogprobs.apply(picked_hidden, weight, targets, temperature, with_entropy, keep)
    out = torch.zeros(where.shape, dtype=torch.float32, device=hidden.device)
    out = out.masked_scatter(where, logp)
    if entropy is not None:
        entropy = torch.zeros_like(out).masked_scatter(where, entropy)
    return out, entropy


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk, so a chunk's fp32 logits stay within `CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * vocab))


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N], temperature, with_entropy, keep_bytes)
    -> (logprob [N] fp32, entropy [N] fp32 or None, no gradient), differentiable in hidden
    and weight; up to `keep_bytes` of the chunks' softmax is kept for backward (0 when no
    backward will run)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, keep_bytes=0):
        logp, lse, entropy, kept = _forward_chunks(hidden, weight, targets, temperature, with_entropy, keep_bytes)
        ctx.save_for_backward(hidden, weight, targets, lse, *kept)
        ctx.temperature = temperature
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse, *kept = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for i, (a, b) in enumerate(_chunks(hidden.shape[0], weight.shape[0])):
            # d logp / d logits = onehot(target) - softmax, times the incoming gradient,
            # then through the division by the temperature.
            if i < len(kept):
                grad_logits = kept[i].mul(-grad_logp[a:b, None])
            else:
                logits = _logits(hidden[a:b], weight, ctx.temperature)
                grad_logits = logits.sub_(lse[a:b, None]).exp_().mul_(-grad_logp[a:b, None])
            grad_logits.scatter_add_(-1, targets[a:b, None], grad_logp[a:b, None])
            grad_logits = grad_logits.div_(ctx.temperature).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[a:b] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T.float(), hidden[a:b].float())
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _forward_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    keep_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """`ChunkedLogprobs`' forward, a chunk of tokens at a time: (logprob [N], logsumexp [N],
    entropy [N] or None, the first chunks' softmax [C, V] up to `keep_bytes` in all)."""
    n = hidden.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    kept: list[torch.Tensor] = []
    for i, (a, b) in enumerate(_chunks(n, weight.shape[0])):
        logits = _logits(hidden[a:b], weight, temperature)
        lse[a:b] = torch.logsumexp(logits, dim=-1)
        logp[a:b] = logits.gather(-1, targets[a:b, None]).squeeze(-1) - lse[a:b]
        keep = len(kept) == i and (i + 1) * logits.nbytes <= keep_bytes  # the first chunks only
        if entropy is None and not keep:
            continue
        logp_all = logits.sub_(lse[a:b, None])  # in place: the logits are not needed again
        probs = logp_all.exp()
        if entropy is not None:
            entropy[a:b] = -(probs * logp_all).sum(-1)
        if keep:
            kept.append(probs)
    return logp, lse, entropy, kept


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[C, V] tempered fp32 logits of a chunk. 16-bit operands (mixed precision) are
    multiplied into fp32 output: rounded to bf16, a logit near 20 would move by up to 1/16."""
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return (hidden @ weight.T).div_(temperature)
    return _mm_fp32(hidden, weight.T).div_(temperature)


_FP32_OUTPUT_MM: dict[str, bool] = {}
"""Device type -> whether torch.mm takes `out_dtype` there (CUDA does: the GEMM accumulates
in fp32 already and skips the rounding; CPU builds do not), found on first use."""


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 from 16-bit operands, without a full fp32 copy of either where the device allows."""
    kind = a.device.type
    if _FP32_OUTPUT_MM.setdefault(kind, True):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUTPUT_MM[kind] = False
    return a.float() @ b.float()


def _chunks(n: int, vocab: int) -> Iterator[tuple[int, int]]:
    size = chunk_tokens(vocab)
    return ((a, min(a + size, n)) for a in range(0, n, size))
