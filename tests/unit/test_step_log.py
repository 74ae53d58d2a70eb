"""The per-step record's judge-budget figures, from hand-built samples."""

from __future__ import annotations

import pytest

from learner.step_log import llm_spend, rl_record
from services import protocol


def sample(trained: int, **metrics: float) -> protocol.Sample:
    tokens = [1] * (trained + 2)
    return protocol.Sample(
        sample_id="j:0:0",
        tokens=tokens,
        mask=[0, 0] + [1] * trained,
        logprobs=[0.0] * len(tokens),
        versions=[-1, -1] + [0] * trained,
        reward=1.0,
        advantage=0.0,
        num_turns=1,
        metrics=metrics,
    )


def test_judge_tokens_per_trained_token_sums_the_batchs_spend_over_its_trained_tokens():
    samples = [
        sample(10, judge_tokens=300, simulator_tokens=100, llm_calls=4, futures=2),
        sample(30, judge_tokens=0, simulator_tokens=200, llm_calls=3, remembered_calls=1, futures=6),
    ]

    spend = llm_spend(samples)

    assert spend == {
        "judge_tokens_step": 300,
        "llm_tokens_step": 600,
        "judge_tokens_per_trained_token": 7.5,
        "llm_tokens_per_trained_token": 15.0,
        "futures_max": 6,
    }
    group = protocol.TrajectoryGroup(job_id="j", task_id=0, samples=samples, server_id="s", elapsed_s=1.0)
    record = rl_record(1, 2, [group], {}, 0.1, 0.0, {}, {})
    assert record["futures"] == pytest.approx(4.0) and record["futures_max"] == 6
    assert record["judge_tokens_per_trained_token"] == 7.5


def test_a_batch_without_llm_calls_records_no_spend():
    assert llm_spend([sample(5, success=1.0)]) == {}


def test_a_group_in_which_the_policy_never_spoke_is_counted_as_untrained():
    """Its samples hold no trained token (an episode the user ended before the policy's
    first turn): the step trains nothing on it, and the record says how many such groups."""
    spoke = protocol.TrajectoryGroup(
        job_id="j", task_id=0, samples=[sample(3), sample(0)], server_id="s", elapsed_s=1.0
    )
    silent = protocol.TrajectoryGroup(
        job_id="j", task_id=1, samples=[sample(0), sample(0)], server_id="s", elapsed_s=1.0
    )

    record = rl_record(1, 1, [spoke, silent, silent], {}, 0.1, 0.0, {}, {})

    assert (record["untrained_groups"], record["trained_tokens"]) == (2, 3)
