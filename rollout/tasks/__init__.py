"""Task datasets. `load_task` picks the implementation by the job spec's task name; the
helpers below are shared by the tasks read from JSONL (MATH-Chat, MediumDocEdit-Chat,
BigCodeBench-Chat)."""

from __future__ import annotations

import json
from pathlib import Path

from services.config import TaskSpec
from services.quoting import fenced_blocks  # noqa: F401  (the tasks read it from here)

FIXTURES = Path(__file__).parent / "data"
"""The small built-in datasets a task uses when the spec names no `data` file."""


def load_task(spec: TaskSpec, seed: int = 0, judge=None):
    """The task set a job names, seen through its `system_prompt` and `contexts` when it
    sets them (`rollout.tasks.contexts`). `judge` (a `rollout.rewards.conversation.Judge`)
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
        from rollout.tasks.clarify_task import ClarifyTask

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


MAX_DATA_BYTES = 256 << 20
"""The largest data file a task reads (a spec's file, confined to the operator's roots
by the API, could still be a device or a huge file)."""


def checked_file(path: str | Path, field: str) -> Path:
    """`path` if it is a regular file of at most MAX_DATA_BYTES; ValueError naming `field`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{field} {str(path)!r}: not a regular file")
    if path.stat().st_size > MAX_DATA_BYTES:
        raise ValueError(f"{field} {str(path)!r}: over the {MAX_DATA_BYTES} bytes a task reads")
    return path


def read_examples(spec: TaskSpec, fixture: str) -> list[dict]:
    """The first `spec.num_examples` rows of the JSONL file `spec.data`, or of the built-in
    `FIXTURES / fixture` when the spec names none (all rows if there are fewer)."""
    path = checked_file(spec.data, "task.data") if spec.data else FIXTURES / fixture
    with path.open(encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return rows[: spec.num_examples]


def final_reply(messages: list[dict]) -> str:
    """The content of the last assistant message (a scored conversation has one)."""
    return [m["content"] for m in messages if m["role"] == "assistant"][-1]


def last_found(messages: list[dict], find):
    """What `find` returns for the latest assistant message it finds something in (not
    None), searching back from the end; None when no message has it. R_ext reads the
    conversation this way, as CollabLLM extracts the final answer from the whole of it: a
    pleasantry after the answer does not hide the answer."""
    for message in reversed(messages):
        if message["role"] == "assistant" and (found := find(message["content"])) is not None:
            return found
    return None
