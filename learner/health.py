"""Health rules: conditions on per-step metrics that warn about or stop a job.

Pure functions of the job's recent RL history, so a resumed learner (whose history was
trimmed back to its checkpoint) judges exactly as the uninterrupted one would, with no
state of its own to save.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.config import HealthRule


@dataclass(frozen=True)
class Alert:
    rule: HealthRule
    message: str
    """What held and for how long, with the values: for the job's status, events and logs."""

    @property
    def stops(self) -> bool:
        return self.rule.action == "stop"


def holds(rule: HealthRule, record: dict) -> bool:
    """Whether `record` meets the rule's condition; a step without the metric does not."""
    value = record.get(rule.metric)
    if value is None:
        return False
    return value > rule.above if rule.above is not None else value < rule.below


def history_needed(rules: list[HealthRule]) -> int:
    """RL records `alerts` needs to see: the longest rule's stretch and the step before it."""
    return max((rule.steps for rule in rules), default=0) + 1


def alerts(rules: list[HealthRule], recent: list[dict]) -> list[Alert]:
    """The rules that fire at the newest of `recent` (RL records, oldest first): those whose
    condition held on each of the last `steps` records and not on the record before them,
    so a long stretch warns once, when it reaches `steps`."""
    fired = []
    for rule in rules:
        stretch = recent[-rule.steps :]
        if len(stretch) < rule.steps or not all(holds(rule, r) for r in stretch):
            continue
        before = recent[-rule.steps - 1] if len(recent) > rule.steps else None
        if before is not None and holds(rule, before):
            continue
        fired.append(Alert(rule, describe(rule, stretch)))
    return fired


def describe(rule: HealthRule, stretch: list[dict]) -> str:
    bound = f"> {rule.above:g}" if rule.above is not None else f"< {rule.below:g}"
    values = ", ".join(f"{r[rule.metric]:.3g}" for r in stretch[-8:])
    span = f"steps {stretch[0]['step']}-{stretch[-1]['step']}" if len(stretch) > 1 else f"step {stretch[0]['step']}"
    return f"health rule ({rule.action}): {rule.metric} {bound} for {rule.steps} steps ({span}: {values})"
