"""Which examples a job evaluates on: held out from what it trains on, the same on every process.

The learner dispatches held-out example numbers; each rollout server loads the task set they
index (`rollout.tasks.load_task(held_out.task, held_out.seed)`). Both read it from the job
spec alone, so they agree without talking. The task's model says which
(`services.config.tasks`, `held_out` of each):

- a generated task (clarify, multiply): `eval.examples` examples generated from `eval.seed`,
  which the spec requires to differ from `train.seed`;
- a task read from a file (math_chat, doc_edit_chat, code_chat): the rows of `eval.data`, or,
  without it, the rows of the training file after the first `task.num_examples` (those train);
- a benchmark's split (tau2): the tasks of `eval.split`, a split the job does not train on.

Every task is evaluated from its own openings: a job's `task.contexts` (turns of other
conversations) and simulator-written openings are for training; its system prompt stays,
since the policy is trained under it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from math import comb

from services import protocol
from services.config import HeldOutTask, JobSpec
from services.stats import mean_by_key


def held_out(spec: JobSpec) -> HeldOutTask:
    """The held-out examples of a job with an `eval` section (the task's model says which:
    `TaskBase.held_out`)."""
    evaluation = spec.evaluation()
    if evaluation is None:
        raise ValueError("the job has no eval section")
    return spec.task.held_out(evaluation, spec.train.seed)


def check_loaded(held: HeldOutTask, size: int) -> None:
    """ValueError naming what to change when the loaded held-out task set lacks an example
    (a data file shorter than the training rows plus the held-out ones)."""
    if not held.examples or held.examples[-1] < size:
        return
    first = held.examples[0]
    if first == 0:
        raise ValueError(f"eval: the held-out data has {size} rows, fewer than eval.examples ({len(held.examples)})")
    raise ValueError(
        f"eval: the task's data has {size} rows and the first {first} train, leaving {max(0, size - first)} of "
        f"the {len(held.examples)} held-out rows asked for: set eval.data to a held-out file, or lower "
        "eval.examples or task.num_examples"
    )


@dataclass
class Round:
    step: int
    expected: int
    asked_at: float
    results: dict[tuple[int, int], protocol.EvalResult] = field(default_factory=dict)
    """(example, trial) -> its result; a conversation played twice (a server lost after
    publishing, before its ack) counts once."""
    lost: set[tuple[int, int]] = field(default_factory=set)
    """(example, trial) of the entries that went to the dead stream."""

    def done(self) -> bool:
        return len(self.results) + len(self.lost - self.results.keys()) >= self.expected


def pass_hat_k(successes: list[int], trials: int, k: int) -> float:
    """τ²-bench's pass^k: over examples, the chance that k trials drawn from an example's
    `trials` all succeed (C(c, k) / C(trials, k) for c successes)."""
    return sum(comb(c, k) for c in successes) / (len(successes) * comb(trials, k))


def round_record(round_: Round, trials: int, complete: bool) -> dict:
    """A round's history record: the means of its conversations' metrics, pass^k, which
    versions played it, what it cost and took."""
    results = list(round_.results.values())
    record = {
        "phase": "eval",
        "step": round_.step,
        "version": round_.step,
        "episodes": len(results),
        "lost": len(round_.lost - round_.results.keys()),
        "complete": complete,
        "seconds": time.time() - round_.asked_at,
        **mean_by_key([r.metrics for r in results]),
        "rollout_seconds": sum(r.elapsed_s for r in results),
        "llm_tokens": sum(r.metrics.get("judge_tokens", 0.0) + r.metrics.get("simulator_tokens", 0.0) for r in results),
    }
    versions = [v for r in results for v in r.versions]
    if versions:
        record["versions_min"], record["versions_max"] = min(versions), max(versions)
    if trials > 1 and results:
        by_example: dict[int, list[int]] = {}
        for r in results:
            by_example.setdefault(r.example, []).append(int(r.metrics.get("success", 0.0) >= 1.0))
        full = [sum(s) for s in by_example.values() if len(s) == trials]
        for k in range(1, trials + 1):
            if full:
                record[f"pass^{k}"] = pass_hat_k(full, trials, k)
    return record
