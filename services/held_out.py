"""Which examples a job evaluates on: held out from what it trains on, the same on every process.

The learner dispatches held-out example numbers; each rollout server loads the task set they
index (`rollout.tasks.load_task(held_out.task, held_out.seed)`). Both read it from the job
spec alone, so they agree without talking:

- clarify, multiply (generated): `eval.examples` examples generated from `eval.seed`, which
  the spec requires to differ from `train.seed`. Two seeds can still draw the same request
  by chance, as two draws of a benchmark's split can; the examples are never the trained
  list itself.
- math_chat, doc_edit_chat, code_chat (a data file): the rows of `eval.data`, or, without it,
  the rows of the training file after the first `task.num_examples` (those train).
- tau2: the tasks of `eval.split`, a split the job does not train on.

Every task is evaluated from its own openings: a job's `task.contexts` (turns of other
conversations) and simulator-written openings are for training; its system prompt stays,
since the policy is trained under it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from math import comb

from services import protocol
from services.config import GENERATED_TASKS, RLJob, TaskSpec
from services.stats import mean_by_key


@dataclass(frozen=True)
class HeldOut:
    task: TaskSpec
    """What the held-out task set is loaded from."""
    seed: int
    """The seed it is loaded with (generated tasks draw their examples from it)."""
    examples: tuple[int, ...]
    """The held-out examples' numbers in that task set."""


def held_out(spec: RLJob) -> HeldOut:
    """The held-out examples of a job with an `eval` section."""
    evaluation, task = spec.eval, spec.task
    if evaluation is None:
        raise ValueError("the job has no eval section")
    bare = {"contexts": None, "opening": "task", "followup_share": 0.0}
    if task.name in GENERATED_TASKS:
        held = task.model_copy(update=bare | {"num_examples": evaluation.examples})
        return HeldOut(held, evaluation.seed, tuple(range(evaluation.examples)))
    if task.name == "tau2":
        held = TaskSpec.model_validate({"name": "tau2", "domain": task.domain, "split": evaluation.split})
        count = min(evaluation.examples, held.num_examples)
        return HeldOut(held.model_copy(update={"num_examples": count}), spec.train.seed, tuple(range(count)))
    if evaluation.data is not None:
        held = task.model_copy(update=bare | {"data": evaluation.data, "num_examples": evaluation.examples})
        return HeldOut(held, spec.train.seed, tuple(range(evaluation.examples)))
    first = task.num_examples
    held = task.model_copy(update=bare | {"num_examples": first + evaluation.examples})
    return HeldOut(held, spec.train.seed, tuple(range(first, first + evaluation.examples)))


def check_loaded(held: HeldOut, size: int) -> None:
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
