"""How the trainer combines its minibatches' metrics into one step's."""

from __future__ import annotations

import pytest

from learner.trainer import merge_minibatches


def test_a_step_reports_the_largest_importance_weight_of_its_minibatches_and_the_mean_of_the_rest():
    stats = [{"loss": 0.5, "clip_fraction": 0.1, "is_weight_max": 1.5},
             {"loss": 1.5, "clip_fraction": 0.3, "is_weight_max": 4.0},
             {"loss": 1.0, "clip_fraction": 0.2, "is_weight_max": 2.0}]

    merged = merge_minibatches(stats)

    assert merged["is_weight_max"] == 4.0  # not the mean of maxima, 2.5
    assert merged["loss"] == pytest.approx(1.0)
    assert merged["clip_fraction"] == pytest.approx(0.2)
