"""What several tasks share: their built-in fixtures, a checked data file, and how a
conversation's final answer is found."""

from __future__ import annotations

import json
from pathlib import Path

from services.config.tasks import FixtureTaskBase
from services.quoting import fenced_blocks  # noqa: F401  (the tasks read it from here)


def is_question(text: str) -> bool:
    """A reply that asks (the tasks' `asked` metric, and the clarify task's rule-based user)."""
    return text.rstrip().endswith("?")


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


def read_examples(spec: FixtureTaskBase, fixture: Path) -> list[dict]:
    """The first `spec.num_examples` rows of the JSONL file `spec.data`, or of the built-in
    `fixture` (the task's built-in examples) when the spec names none (all rows if there
    are fewer)."""
    path = checked_file(spec.data, "task.data") if spec.data else fixture
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
