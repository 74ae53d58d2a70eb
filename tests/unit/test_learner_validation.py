"""The learner refuses, before any rank trains on it, a group the trainer cannot take."""

from __future__ import annotations

import pytest

from learner.intake import invalid_reason
from services import protocol


def sample(tokens: int = 4, mask: int = 4, logprobs: int = 4, versions: int = 4) -> protocol.Sample:
    return protocol.Sample(
        sample_id="t:0",
        tokens=[1] * tokens,
        mask=[1] * mask,
        logprobs=[0.0] * logprobs,
        versions=[0] * versions,
        reward=1.0,
        advantage=0.0,
        num_turns=1,
    )


def group(*samples: protocol.Sample) -> protocol.TrajectoryGroup:
    return protocol.TrajectoryGroup(job_id="j", task_id=0, samples=list(samples), server_id="s", elapsed_s=0.0)


def test_a_well_formed_group_up_to_max_tokens_per_rank_is_accepted():
    assert invalid_reason(group(sample(), sample(tokens=64, mask=64, logprobs=64, versions=64)), 64) == ""


@pytest.mark.parametrize(
    "bad, reason",
    [
        (group(), "no samples"),
        (group(sample(), sample(mask=3)), "differ in length"),
        (group(sample(logprobs=5)), "differ in length"),
        (group(sample(versions=0)), "differ in length"),
        (group(sample(0, 0, 0, 0)), "no tokens"),
        (group(sample(65, 65, 65, 65)), "65 tokens exceed train.max_tokens_per_rank=64"),
    ],
)
def test_malformed_or_oversized_groups_are_refused_with_the_reason(bad, reason):
    assert reason in invalid_reason(bad, 64)
