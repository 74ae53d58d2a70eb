"""Attention over packed rows, without a dense mask.

A micro-batch is one row of sequences laid end to end, position ids restarting at each.
transformers' own `sdpa` keeps them apart by building a block-diagonal T x T mask, so a row
of 8 sequences pays for 8x the attention it needs, saves the mask per layer for backward,
and on CUDA rules out the flash kernel. The `varlen` attention registered here finds the
sequences where the position ids restart and attends within each:

- on CUDA, in 16-bit, through torch's variable-length flash kernel
  (`torch.nn.attention.varlen.varlen_attn`), one call per layer;
- elsewhere (CPU, fp32), causal SDPA per sequence, sequences of similar length batched
  into one call (`length_groups`).

Either costs the sum of the squared sequence lengths instead of the square of the row. On
CPU, per-sequence SDPA measured 5-8x faster than the dense mask per layer (forward and
backward, SmolLM2's heads, 4096-token rows of 4 to 17 sequences), and faster than padding
the sequences inside attention to the longest one, which loses on rows of one long and many
short sequences (`docs/results/real-model.md`, "Packed attention"). On an H100 the varlen kernel gave
the learner its best step (`docs/results/gpu_check_h100*.jsonl`). flex attention was not
used: it needs torch.compile and a new block mask for every micro-batch.

`TrainSpec.packing` picks the path: `varlen` (this module), `mask` (transformers' dense
mask) or `padded` (a row per sequence, no packing).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

VARLEN = "tandem_varlen"
"""The name the varlen attention is registered under with transformers."""

IMPLEMENTATION = {"varlen": VARLEN, "mask": "sdpa", "padded": "sdpa"}
"""TrainSpec.packing -> the transformers attention implementation the model runs."""


def implementation(packing: str) -> str:
    """The attention implementation for `packing`, registered with transformers if it is
    ours. transformers builds no mask for a name it has no mask function for, so the
    varlen path never pays for one."""
    if IMPLEMENTATION[packing] == VARLEN:
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN, varlen_attention)
    return IMPLEMENTATION[packing]


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, T, D], key and value [B, Hkv, T, D]
    -> ([B, T, H, D], no weights). Each row's sequences start where its position ids are
    0; a row without position ids is one sequence. Padded rows (B > 1, right padding, no
    mask) are one sequence each: their padding sits after every real token, so causal
    attention never lets a real token see it."""
    if attention_mask is not None:
        raise ValueError("varlen attention keeps packed sequences apart by position ids and takes no mask")
    rows = []
    for b, plan in enumerate(_row_plans(position_ids, query.shape[0], query.shape[2], query.device)):
        q, k, v = (x[b].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
        rows.append(_attend(q, k, v, plan, scaling))
    return torch.stack(rows), None


@dataclass
class RowPlan:
    """How one row's attention runs: its sequences' offsets, and on the per-sequence path
    the padded groups (`length_groups`): each reads the G x L row positions of its
    sequences, right padding repeating a sequence's last token, by a gather, or as a view
    where the group is a run of the row as it stands (sequences of one length, end to
    end). `output` picks each row position's result out of the groups' flattened results
    laid end to end; None where that is the row."""

    bounds: torch.Tensor
    longest: int
    groups: list[tuple[int, int, int, torch.Tensor | None]]
    """Per group: how many sequences, padded to what length, where the group's run starts
    in the row, and its gather index (None for a run)."""
    output: torch.Tensor | None


_last_plans: tuple[torch.Tensor | None, tuple, list[RowPlan]] = (None, (), [])
"""The plans of the latest call, by its position ids (held, so never another tensor at the
same address): every layer of a forward gets the same tensor, and planning reads it back
from the device (a sync on CUDA) and builds index tensors."""


def _row_plans(position_ids: torch.Tensor | None, rows: int, length: int, device: torch.device) -> list[RowPlan]:
    global _last_plans
    shape = (rows, length, device, GROUP_SLACK)
    if position_ids is None or position_ids is not _last_plans[0] or shape != _last_plans[1]:
        plans = [row_plan(position_ids[b] if position_ids is not None else None, length, device) for b in range(rows)]
        _last_plans = (position_ids, shape, plans)
    return _last_plans[2]


def row_plan(positions: torch.Tensor | None, length: int, device: torch.device) -> RowPlan:
    """The plan of a row with these position ids (None: one sequence of `length`).
    Gathers are `index_select`s, whose backward adds rows back (`index_add_`); indexing
    by an index tensor would go back through `index_put_` with accumulation, which
    measured a quarter of the attention's time on CPU."""
    bounds = sequence_bounds(positions, length).to(device)
    spans = bounds.tolist()
    groups, output, done = [], [0] * length, 0
    for group in length_groups(list(zip(spans[:-1], spans[1:]))):
        longest = group[0][1] - group[0][0]
        for i, (a, b) in enumerate(group):
            output[a:b] = range(done + i * longest, done + i * longest + b - a)
        done += len(group) * longest
        starts = [a for a, _ in group]
        run = all(b - a == longest for a, b in group) and starts == list(range(starts[0], group[-1][1], longest))
        index = None if run else [min(a + j, b - 1) for a, b in group for j in range(longest)]
        groups.append((len(group), longest, starts[0], torch.tensor(index, device=device) if index else None))
    as_is = done == length and output == list(range(length))
    longest = max(b - a for a, b in zip(spans, spans[1:]))
    return RowPlan(bounds, longest, groups, None if as_is else torch.tensor(output, device=device))


def sequence_bounds(positions: torch.Tensor | None, length: int) -> torch.Tensor:
    """int32 [n + 1] offsets of the n sequences in a row: 0, where each later one starts
    (its position id is 0), and the row's length."""
    if positions is None:
        return torch.tensor([0, length], dtype=torch.int32)
    starts = torch.nonzero(positions[1:] == 0).flatten() + 1
    zero, end = starts.new_tensor([0]), starts.new_tensor([length])
    return torch.cat([zero, starts, end]).to(torch.int32)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RowPlan, scale: float | None) -> torch.Tensor:
    """[T, H, D] causal attention within each sequence of the row `plan` describes."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _varlen_kernel() is not None:
        return _varlen(q, k, v, plan, scale)
    # Causal attention never lets a real position see the padding after it, and the
    # padded positions' results are never picked.
    parts = [
        _causal(_gather(q, group), _gather(k, group), _gather(v, group), scale).flatten(0, 1) for group in plan.groups
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if plan.output is None else out.index_select(0, plan.output)


def _gather(x: torch.Tensor, group: tuple[int, int, int, torch.Tensor | None]) -> torch.Tensor:
    """[T, H, D] -> the group's [G, L, H, D] (see `RowPlan.groups`)."""
    size, longest, start, index = group
    if index is None:
        return x[start : start + size * longest].view(size, longest, *x.shape[1:])
    return x.index_select(0, index).view(size, longest, *x.shape[1:])


GROUP_SLACK = 1.25
"""Sequences share one batched SDPA call while the padded call costs at most this much more
attention than one call per sequence: on CPU a call per short sequence and layer costs more
in overhead than the padding does."""


def length_groups(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`spans` ([start, end) of each sequence) in groups of similar length, longest first: a
    group of n sequences padded to its longest, L, costs n L^2, kept within `GROUP_SLACK`
    of the sum of their own squares."""
    groups: list[list[tuple[int, int]]] = []
    for span in sorted(spans, key=lambda s: s[0] - s[1]):
        n = span[1] - span[0]
        if groups:
            group = groups[-1]
            longest = group[0][1] - group[0][0]
            own = sum((b - a) ** 2 for a, b in group) + n * n
            if (len(group) + 1) * longest**2 <= GROUP_SLACK * own:
                group.append(span)
                continue
        groups.append([span])
    return groups


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal SDPA on [batch, s, heads, D]. Always 4-D: on CPU, SDPA takes its general
    (math) kernel for 3-D inputs and its flash kernel only for 4-D ones."""
    gqa = k.shape[-2] != q.shape[-2]
    out = F.scaled_dot_product_attention(
        q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), is_causal=True, scale=scale, enable_gqa=gqa
    )
    return out.transpose(-3, -2)


@functools.cache
def _varlen_kernel():
    """torch's varlen attention and its parameter names, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RowPlan, scale: float | None) -> torch.Tensor:
    kernel, params = _varlen_kernel()
    # Its keywords changed between torch releases: causality was `is_causal`, then a window;
    # grouped-query attention is either native (`enable_gqa`) or needs the heads repeated.
    kwargs: dict[str, object] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    kwargs |= {"scale": scale} if "scale" in params else {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    q, k, v = (x.contiguous() for x in (q, k, v))
    return kernel(q, k, v, plan.bounds, plan.bounds, plan.longest, plan.longest, **kwargs)
