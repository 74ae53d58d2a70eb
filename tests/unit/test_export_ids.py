"""`tandem export` takes a job id, never a path: an id that climbs out of the runs folder
(`../`) or names a folder inside another would export a policy that is not a job's."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main


@pytest.mark.parametrize("job_id", ["../other-0123abcd", "other-0123abcd/../../other-0123abcd", "/tmp/x-0123abcd"])
def test_export_refuses_a_job_id_that_is_a_path(tmp_path, job_id):
    runs, elsewhere = tmp_path / "runs", tmp_path / "other-0123abcd"
    runs.mkdir()
    (elsewhere / "policy").mkdir(parents=True)  # a policy folder outside the runs folder
    (elsewhere / "job.json").write_text(json.dumps({"name": "other", "model": {"path": str(tmp_path / "base")}}))
    out = tmp_path / "out"

    with pytest.raises(SystemExit) as exited:
        main(["export", job_id, str(out), "--runs-dir", str(runs)])

    assert "is not a job id" in str(exited.value.code)
    assert not out.exists()
