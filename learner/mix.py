"""What the learner trained against what the rollout servers finished.

Every group the intake decides on, trained or refused (over-stale, a duplicate), was paid
for: its samples' judge and user-simulator tokens are spent whatever the decision. If the
refused groups differ from the trained ones (longer conversations, more first turns that
ask), the learner trains on a skewed sample of the policy's behaviour. `Mix` keeps running
sums over both sets, so each step's record can say how far the trained share drifts from the
finished one and how many provider tokens were thrown away. Groups refused as invalid are
left out: their fields are not to be trusted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from services import protocol

ASKED = "asked"
"""The sample metric of the collaborative tasks that says a first turn asked a question."""


@dataclass
class Totals:
    """Running sums over a set of groups."""

    groups: int = 0
    samples: int = 0
    tokens: int = 0
    """Sequence tokens (context and response), before any stale token is masked."""
    asked: float = 0.0
    asked_samples: int = 0
    """Samples that carry the `asked` metric (first turns of the collaborative tasks)."""
    llm_tokens: float = 0.0
    """Judge and user-simulator tokens the provider charged for these groups."""

    def add(self, group: protocol.TrajectoryGroup) -> None:
        self.groups += 1
        for sample in group.samples:
            self.samples += 1
            self.tokens += len(sample.tokens)
            self.llm_tokens += sample.metrics.get("judge_tokens", 0.0) + sample.metrics.get("simulator_tokens", 0.0)
            if ASKED in sample.metrics:
                self.asked += sample.metrics[ASKED]
                self.asked_samples += 1

    def mean_length(self) -> float | None:
        return self.tokens / self.samples if self.samples else None

    def asked_share(self) -> float | None:
        return self.asked / self.asked_samples if self.asked_samples else None


@dataclass
class Mix:
    finished: Totals = field(default_factory=Totals)
    """Every group decided on (trained or refused), invalid ones aside."""
    trained: Totals = field(default_factory=Totals)

    def decided(self, group: protocol.TrajectoryGroup, decision: str) -> None:
        """Count `group`, decided as `decision` (a `group_log.DECISIONS` value)."""
        if decision == "invalid":
            return
        self.finished.add(group)
        if decision == "trained":
            self.trained.add(group)

    def record(self) -> dict[str, float]:
        """The step record's figures, over the job so far: the trained samples' mean length
        over the finished ones', the asked shares of both (tasks that measure it), provider
        tokens thrown away with refused groups and spent per trained sample."""
        figures: dict[str, float] = {"wasted_llm_tokens": self.finished.llm_tokens - self.trained.llm_tokens}
        trained, finished = self.trained.mean_length(), self.finished.mean_length()
        if trained is not None and finished:
            figures["trained_vs_generated_length_ratio"] = trained / finished
        if self.trained.samples:
            figures["llm_tokens_per_trained_sample"] = self.finished.llm_tokens / self.trained.samples
        for name, totals in (("trained", self.trained), ("generated", self.finished)):
            share = totals.asked_share()
            if share is not None:
                figures[f"asked_share_{name}"] = share
        return figures

    def state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict | None) -> Mix:
        """A `state()` from a checkpoint's meta (None, from an older checkpoint: start at 0)."""
        if not state:
            return cls()
        return cls(finished=Totals(**state["finished"]), trained=Totals(**state["trained"]))
