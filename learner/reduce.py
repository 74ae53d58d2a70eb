"""Step metrics combined: over a rank's micro-batches (`accumulate`) and over all ranks
(`reduce_over_ranks`, `all_reduce`); maxima by max, the rest by sum."""

from __future__ import annotations

import torch
import torch.distributed as dist

from learner import loss


def accumulate(totals: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    """Add one micro-batch's metrics into a rank's running totals: maxima by max, the rest
    by sum."""
    for name, value in metrics.items():
        if name not in totals:
            totals[name] = value
        elif name in loss.MAXIMA:
            totals[name] = torch.maximum(totals[name], value)
        else:
            totals[name] = totals[name] + value


def reduce_over_ranks(totals: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """All ranks' totals combined: maxima by max, the rest by sum."""
    maxima = {name: value for name, value in totals.items() if name in loss.MAXIMA}
    sums = {name: value for name, value in totals.items() if name not in maxima}
    return all_reduce(sums, device) | all_reduce(maxima, device, dist.ReduceOp.MAX)


def all_reduce(
    values: dict[str, torch.Tensor], device: torch.device, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> dict[str, float]:
    """Each named value combined over all ranks by `op`, in one collective."""
    names = sorted(values)
    packed = torch.stack([torch.as_tensor(values[n], dtype=torch.float64, device=device) for n in names])
    dist.all_reduce(packed, op=op)
    return dict(zip(names, packed.tolist()))
