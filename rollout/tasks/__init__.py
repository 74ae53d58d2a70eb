"""Task datasets: one module or folder per task holding all of that task; `load_task` picks
the implementation by the job spec's task name. What several tasks share is in `common`
(reading fixtures, finding the final answer), `base` (the `TaskSet` contract), `contexts`
(a task seen through other system prompts or contexts) and `extraction` (an LLM reading
out a final document)."""

from __future__ import annotations

from services.config import TaskSpec


def load_task(spec: TaskSpec, seed: int = 0, judge=None):
    """The task set a job names, seen through its `system_prompt` and `contexts` when it
    sets them (`rollout.tasks.contexts`). `judge` (a `rollout.tasks.base.Judge`)
    is for tasks whose metric asks the judge proxy (MATH-Chat accuracy with metric=judge)."""
    if spec.contexts is None:
        base = _base_task(spec, seed, judge)
        if spec.system_prompt is None:
            return base
        from rollout.tasks.contexts import ContextView

        return ContextView(base, spec.system_prompt)
    from rollout.tasks.contexts import ContextView, turn_contexts

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


def _base_task(spec: TaskSpec, seed: int, judge):
    if spec.name == "clarify":
        from rollout.tasks.clarify.task import ClarifyTask

        return ClarifyTask(spec, seed)
    if spec.name == "math_chat":
        from rollout.tasks.math_chat import MathChatTask

        return MathChatTask(spec, judge)
    if spec.name == "doc_edit_chat":
        from rollout.tasks.doc_edit_chat import DocEditChatTask

        return DocEditChatTask(spec, judge)
    if spec.name == "multiply":
        from rollout.tasks.multiply import MultiplyTask

        return MultiplyTask(spec, seed)
    if spec.name == "tau2":
        from rollout.tasks.tau2 import Tau2Task

        return Tau2Task(spec)
    if spec.name == "code_chat":
        from rollout.tasks.code_chat import CodeChatTask

        return CodeChatTask(spec, judge)
    raise ValueError(f"task {spec.name!r} is not available in this rollout server")
