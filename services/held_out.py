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

from dataclasses import dataclass

from services.config import GENERATED_TASKS, RLJob, TaskSpec


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
