"""A generate job's files as a resumed run finds them: what the ledger commits stays, a
batch cut short and a torn line go."""

from __future__ import annotations

import json

from learner.runs.generate import LEDGER, DatasetFiles

DISPATCHER = {"next_task_id": 4, "replaced": 0, "dead_cursor": "0-0", "admitted_at": [[0, 0]], "lost": []}


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_run_keeps_the_committed_rows_and_cuts_an_uncommitted_batch_and_a_torn_line(tmp_path):
    files = DatasetFiles(tmp_path)
    files.start()
    files.append({"sft": [{"task_id": 0}, {"task_id": 1}], "pairs": [{"task_id": 1, "turn": 0}]}, [0, 1], DISPATCHER)
    files.append({"sft": [{"task_id": 3}], "pairs": []}, [2, 3], DISPATCHER | {"replaced": 1})
    # A kill mid-batch: its rows written, one of them torn, its ledger line torn.
    with open(files.paths["sft"], "a") as f:
        f.write(json.dumps({"task_id": 4}) + "\n" + '{"task_id": ')
    with open(files.paths["pairs"], "a") as f:
        f.write(json.dumps({"task_id": 4, "turn": 0}) + "\n")
    with open(tmp_path / LEDGER, "a") as f:
        f.write('{"task_ids": [4, 5], "by')

    resumed = DatasetFiles(tmp_path)
    resumed.recover()

    assert lines(resumed.paths["sft"]) == [{"task_id": 0}, {"task_id": 1}, {"task_id": 3}]
    assert lines(resumed.paths["pairs"]) == [{"task_id": 1, "turn": 0}]
    assert len(lines(tmp_path / LEDGER)) == 2
    assert (resumed.task_ids, resumed.rows, resumed.dispatcher) == (
        {0, 1, 2, 3},
        {"sft": 3, "pairs": 1},
        DISPATCHER | {"replaced": 1},
    )

    resumed.append({"sft": [{"task_id": 5}], "pairs": []}, [5], DISPATCHER)
    assert [r["task_id"] for r in lines(resumed.paths["sft"])] == [0, 1, 3, 5]


def test_a_run_stopped_before_its_first_commit_resumes_from_empty_files(tmp_path):
    files = DatasetFiles(tmp_path)
    files.start()
    files.paths["sft"].write_text(json.dumps({"task_id": 0}) + "\n")

    resumed = DatasetFiles(tmp_path)
    resumed.recover()

    assert resumed.paths["sft"].read_text() == resumed.paths["pairs"].read_text() == ""
    assert (resumed.task_ids, resumed.rows, resumed.dispatcher) == (set(), {"sft": 0, "pairs": 0}, None)
