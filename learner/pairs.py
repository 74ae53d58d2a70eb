"""Preference pairs picked from groups of scored responses (online DPO, and the pairs a
generate job writes): the response with the highest reward is chosen, the one with the
lowest rejected, when their rewards differ by at least the job's `pair_margin` (a group
without such a gap trains nothing, like a GRPO group without spread)."""

from __future__ import annotations

from services import protocol


def pick_pair(samples: list[protocol.Sample], margin: float) -> tuple[protocol.Sample, protocol.Sample] | None:
    """(chosen, rejected): the first sample with the highest reward and the last with the
    lowest, or None when their rewards are equal or closer than `margin`."""
    if len(samples) < 2:
        return None
    chosen = max(samples, key=lambda s: s.reward)
    rejected = min(reversed(samples), key=lambda s: s.reward)
    gap = chosen.reward - rejected.reward
    return (chosen, rejected) if gap > 0 and gap >= margin else None


def pairs_from_groups(
    groups: list[protocol.TrajectoryGroup], margin: float, max_pair_tokens: int
) -> tuple[list[protocol.Sample], int]:
    """Every group's pair, flattened chosen, rejected, chosen, rejected..., and how many
    pairs were left out for having more tokens together than a rank takes."""
    flat: list[protocol.Sample] = []
    too_long = 0
    for group in groups:
        pair = pick_pair(group.samples, margin)
        if pair and sum(len(s.tokens) for s in pair) > max_pair_tokens:
            too_long += 1
        elif pair:
            flat += pair
    return flat, too_long
