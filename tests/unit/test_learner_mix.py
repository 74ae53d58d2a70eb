"""What the learner trained against what was finished (`learner.mix`), on hand-built groups,
and the train spec's token bound."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from learner.mix import Mix
from services import protocol
from services.config import TrainSpec


def group(task_id: int, *samples: tuple[int, float | None, float]) -> protocol.TrajectoryGroup:
    """A group of samples given as (sequence tokens, asked or None, judge tokens); each
    sample's user simulator charged half its judge tokens."""
    return protocol.TrajectoryGroup(
        job_id="j",
        task_id=task_id,
        server_id="s",
        elapsed_s=1.0,
        samples=[
            protocol.Sample(
                sample_id=f"j:{task_id}:{index}",
                tokens=[1] * length,
                mask=[0] * (length - 1) + [1],
                logprobs=[0.0] * length,
                versions=[0] * length,
                reward=0.0,
                advantage=0.0,
                num_turns=1,
                metrics={"judge_tokens": judge, "simulator_tokens": judge / 2}
                | ({} if asked is None else {"asked": asked}),
            )
            for index, (length, asked, judge) in enumerate(samples)
        ],
    )


def test_the_record_compares_trained_with_finished_groups_and_counts_the_refused_spend():
    mix = Mix()
    mix.decided(group(0, (10, 1.0, 100.0), (20, 0.0, 100.0)), "trained")
    mix.decided(group(1, (40, 1.0, 200.0), (40, 1.0, 200.0)), "stale")
    mix.decided(group(2, (1000, 0.0, 9999.0)), "invalid")  # left out: its fields are not trusted
    mix.decided(group(3, (30, None, 0.0)), "duplicate")  # no first turn: no asked share

    record = mix.record()

    # trained: 2 samples, 30 tokens (mean 15); finished: 5 samples, 140 tokens (mean 28)
    assert record["trained_vs_generated_length_ratio"] == pytest.approx(15 / 28)
    assert record["asked_share_trained"] == 0.5
    assert record["asked_share_generated"] == 0.75  # 3 of the 4 that say
    # llm tokens: trained 2 x 150 = 300, refused 2 x 300 = 600 and 0
    assert record["wasted_llm_tokens"] == 600.0
    assert record["llm_tokens_per_trained_sample"] == 450.0  # 900 / 2


def test_nothing_trained_yet_records_only_the_waste():
    mix = Mix()
    mix.decided(group(0, (10, None, 10.0)), "stale")
    assert mix.record() == {"wasted_llm_tokens": 15.0}


def test_the_sums_survive_a_checkpoint_and_an_older_checkpoint_starts_at_zero():
    mix = Mix()
    mix.decided(group(0, (10, 1.0, 100.0)), "trained")
    mix.decided(group(1, (30, 0.0, 100.0)), "stale")
    assert Mix.from_state(mix.state()) == mix
    assert Mix.from_state(None) == Mix()


def test_the_token_bound_is_refused_outside_admit_and_below_eta():
    assert TrainSpec(stragglers="admit", max_staleness=2, max_token_staleness=4).max_token_staleness == 4
    with pytest.raises(ValidationError, match="applies only with stragglers: admit"):
        TrainSpec(stragglers="drop", max_staleness=2, max_token_staleness=4)
    with pytest.raises(ValidationError, match="max_token_staleness 1 is below max_staleness 2"):
        TrainSpec(stragglers="admit", max_staleness=2, max_token_staleness=1)
