"""Task datasets. `load_task` picks the implementation by the job spec's task name."""

from __future__ import annotations

from services.config import TaskSpec


def load_task(spec: TaskSpec, seed: int = 0):
    if spec.name == "clarify":
        from rollout.tasks.clarify_task import ClarifyTask

        return ClarifyTask(spec, seed)
    raise ValueError(f"task {spec.name!r} is not available in this rollout server")
