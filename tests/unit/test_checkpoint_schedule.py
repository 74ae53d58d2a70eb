"""When an RL or offline run writes a periodic checkpoint: by steps, by time, or both."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from learner.runs.checkpoints import checkpoint_due
from services.config import TrainSpec


@pytest.mark.parametrize(
    "step, since_s, every_steps, every_s, due",
    [
        (6, 10.0, 3, 1800.0, True),  # a multiple of the steps, long before the time
        (7, 10.0, 3, 1800.0, False),
        (7, 1800.0, 3, 1800.0, True),  # the time has come, between two multiples
        (7, 1799.9, 3, 1800.0, False),
        (7, 5000.0, 0, 1800.0, True),  # by time only
        (9, 5000.0, 3, 0.0, True),  # by steps only
        (10, 5000.0, 3, 0.0, False),
        (9, 5000.0, 0, 0.0, False),  # both off: only a stop writes one
    ],
)
def test_a_checkpoint_is_due_every_so_many_steps_or_seconds_whichever_comes_first(
    step, since_s, every_steps, every_s, due
):
    assert checkpoint_due(step, since_s, every_steps, every_s) is due


def test_checkpoints_are_on_by_default_every_half_hour():
    assert (TrainSpec().checkpoint_every, TrainSpec().checkpoint_every_s) == (0, 1800.0)


@pytest.mark.parametrize("every_s", [-1.0, float("nan"), float("inf"), "soon"])
def test_a_checkpoint_period_that_is_not_a_finite_number_of_seconds_is_refused_naming_the_field(every_s):
    with pytest.raises(ValidationError, match="checkpoint_every_s"):
        TrainSpec(checkpoint_every_s=every_s)
