"""Task datasets: one folder per task holding all of that task, found by the job spec's task
name in `TASKS`, which names the module of the folder that exports `load(spec, seed, judge)
-> TaskSet`. What
several tasks share is in `common` (reading fixtures, finding the final answer), `base` (the
`TaskSet` class every task subclasses), `contexts` (a task seen through other system prompts
or contexts) and `extraction` (an LLM reading out a final document).

Adding a task: its spec model in `services/config/tasks.py`, its folder here, and its line
in `TASKS`.
"""

from __future__ import annotations

import importlib

from rollout.tasks.base import Judge, TaskSet
from services.config.tasks import ChatTaskBase, TaskBase

TASKS = {
    "clarify": "rollout.tasks.clarify.task",
    "multiply": "rollout.tasks.multiply",
    "math_chat": "rollout.tasks.math_chat",
    "doc_edit_chat": "rollout.tasks.doc_edit_chat",
    "code_chat": "rollout.tasks.code_chat",
    "tau2": "rollout.tasks.tau2",
}
"""Task name (`task.name`) -> the module of its folder that exports `load` (imported when a job
names it)."""


def load_task(spec: TaskBase, seed: int = 0, judge: Judge | None = None) -> TaskSet:
    """The task set a job names, seen through its `system_prompt` and `contexts` when it
    sets them (`rollout.tasks.contexts`). `judge` (a `rollout.tasks.base.Judge`)
    is for tasks whose metric asks the judge proxy (MATH-Chat accuracy with metric=judge)."""
    if not isinstance(spec, ChatTaskBase) or (spec.contexts is None and spec.system_prompt is None):
        return _base_task(spec, seed, judge)
    from rollout.tasks.contexts import ContextView, turn_contexts

    if spec.contexts is None:
        return ContextView(_base_task(spec, seed, judge), spec.system_prompt)
    turns = turn_contexts(spec.contexts, spec.num_examples)
    if len(turns) < spec.num_examples:
        raise ValueError(
            f"task.contexts holds {len(turns)} contexts, fewer than task.num_examples "
            f"({spec.num_examples}); set num_examples to at most {len(turns)}"
        )
    # The base task's examples as far as the contexts reach (generated tasks draw the same
    # first examples whatever their number).
    needed = max(t.example for t in turns) + 1
    base = _base_task(spec.model_copy(update={"num_examples": needed}), seed, judge)
    if len(base) < needed:
        raise ValueError(f"task.contexts names example {needed - 1}, but task {spec.name!r} has {len(base)}")
    return ContextView(base, spec.system_prompt, turns)


def demonstrations(name: str, num: int, share: float, seed: int) -> list[dict]:
    """`num` warm-start rows (`messages`, and `tools` where the task calls them) of a task
    that writes its own (`TaskBase.demonstrated`); `share` is the share of rows that show
    the task's skill (clarify: asking first; multiply: calling the calculator)."""
    return importlib.import_module(TASKS[name]).demonstrations(num, share, seed)


def _base_task(spec: TaskBase, seed: int, judge: Judge | None) -> TaskSet:
    if spec.name not in TASKS:
        raise ValueError(f"task {spec.name!r} is not available in this rollout server")
    return importlib.import_module(TASKS[spec.name]).load(spec, seed, judge)
