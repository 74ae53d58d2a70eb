"""Group-relative advantages (GRPO): each response is judged against its siblings."""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """(R - mean) / (std + eps), or R - mean without the scaling; std is the population std.

    A group whose rewards all lie within `eps` of each other has no spread: its advantages
    are exactly 0, not the rounding left over from the mean (about 1e-17), so a batch of
    such groups has an exactly zero gradient and the learner takes no step on it."""
    if max(rewards) - min(rewards) < eps:
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]
