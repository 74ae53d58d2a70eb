"""The figures bench/async_speedup.py judges issue 52 by, on hand-made step records."""

from __future__ import annotations

from bench import async_speedup
from bench.judge_bound import ratio


def test_dropped_share_counts_refused_groups_against_all_decided():
    history = [{"groups": 8, "stale_dropped": 0}, {"groups": 8, "stale_dropped": 4}]
    assert async_speedup.dropped_share(history) == 4 / 20  # the last record's count is the run's


def test_the_asked_gap_is_the_worst_step_and_none_without_the_figures():
    history = [
        {"asked_share_trained": 0.70, "asked_share_generated": 0.75},
        {"asked_share_trained": 0.74, "asked_share_generated": 0.73},
        {"asked_share_trained": None, "asked_share_generated": 0.9},  # a task without `asked`
    ]
    assert abs(async_speedup.asked_gap_max(history) - 0.05) < 1e-12
    assert async_speedup.asked_gap_max([{"groups": 8}]) is None


def test_the_plateau_is_the_mean_of_the_second_halfs_evaluations():
    curve = [{"step": step, "success": success} for step, success in [(0, 0.3), (10, 0.5), (20, 0.8), (40, 0.9)]]
    assert abs(async_speedup.plateau(curve, steps=40) - 0.85) < 1e-12


def test_a_ratio_with_a_missing_or_zero_side_is_none():
    assert ratio(6.0, 2.0) == 3.0
    assert ratio(None, 2.0) is None and ratio(6.0, None) is None
    assert ratio(6.0, 0.0) is None  # a target reached at 0 s is not infinitely sooner


def test_a_runs_cost_is_the_proxys_bill_per_step_and_per_trained_sample():
    spend = {"usd": 0.012, "tokens": 40_000, "cached": 10_000, "calls": 90}
    spend["by_role"] = {"judge": {"usd": 0.004}, "simulator": {"usd": 0.008}}
    run = {"spend": spend, "history": [{"samples": 32}, {"samples": 32}, {"samples": 16}]}
    cost = async_speedup.run_cost(run)
    assert cost["cost_usd"] == 0.012 and abs(cost["cost_usd_per_step"] - 0.004) < 1e-15
    assert abs(cost["cost_usd_per_sample"] - 0.012 / 80) < 1e-15
    assert cost["cost_usd_by_role"] == {"judge": 0.004, "simulator": 0.008} and cost["cost_cached_share"] == 0.25
    assert async_speedup.run_cost({"history": [{"samples": 8}]}) == {}  # a run kept from before costs were kept
