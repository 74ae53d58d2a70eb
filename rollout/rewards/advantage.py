"""Group-relative advantages (GRPO): each response is judged against its siblings."""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """(R - mean) / (std + eps), or R - mean without the scaling; std is the population std."""
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]
