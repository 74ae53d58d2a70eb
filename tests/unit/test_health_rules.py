"""Health rules on a job's per-step metrics (learner.health)."""

from __future__ import annotations

from learner.health import alerts, history_needed
from services.config import HealthRule

STOP = HealthRule(metric="zero_spread_share", above=0.9, steps=3, action="stop")
WARN = HealthRule(metric="entropy", below=0.05, steps=2, action="warn")


def steps(key: str, values: list[float | None]) -> list[dict]:
    return [{"step": i + 1} | ({} if v is None else {key: v}) for i, v in enumerate(values)]


def fired_at(rule: HealthRule, key: str, values: list[float | None]) -> list[int]:
    """The steps at which `rule` fires, judging each step by the history up to it."""
    records = steps(key, values)
    depth = history_needed([rule])
    return [records[i]["step"] for i in range(len(records)) if alerts([rule], records[max(0, i + 1 - depth) : i + 1])]


def test_a_rule_fires_when_its_condition_has_held_for_its_steps_and_once_per_stretch():
    # above 0.9 at steps 2-6 (fires at 4, the third), broken at 7, again at 8-10 (fires at 10).
    assert fired_at(STOP, "zero_spread_share", [0.5, 1.0, 0.95, 1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0]) == [4, 10]


def test_below_bounds_and_a_missing_metric_breaks_the_stretch():
    assert fired_at(WARN, "entropy", [0.01, 0.02, 0.5, 0.01, None, 0.01, 0.0]) == [2, 7]


def test_the_alert_names_the_rule_the_steps_and_the_values():
    [alert] = alerts([STOP], steps("zero_spread_share", [0.2, 1.0, 0.95, 1.0]))
    assert alert.stops
    assert alert.message == "health rule (stop): zero_spread_share > 0.9 for 3 steps (steps 2-4: 1, 0.95, 1)"


def test_several_rules_are_judged_each_on_its_own():
    records = [{"step": s, "zero_spread_share": 1.0, "entropy": 0.01} for s in (1, 2, 3)]
    assert [a.rule for a in alerts([STOP, WARN], records)] == [STOP]  # WARN fired at step 2
    assert [a.rule for a in alerts([STOP, WARN], records[:2])] == [WARN]
    assert history_needed([STOP, WARN]) == 4 and history_needed([]) == 1
