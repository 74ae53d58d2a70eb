"""`tandem prepare-demo`: the demo job for a stack that sees the files elsewhere (compose)."""

from __future__ import annotations

import os
import stat

import yaml

from services.config import parse_job_spec
from tandem.demo import write_demo_files


def test_the_spec_names_the_files_where_the_containers_see_them_and_validates(tmp_path):
    path = write_demo_files(tmp_path / "demo", seen_as="/models/demo/", steps=7)
    spec = yaml.safe_load(path.read_text())
    assert spec["model"]["path"] == "/models/demo/tiny-model"
    assert spec["warm_start"]["data"] == "/models/demo/warm_start.jsonl"
    assert spec["train"]["num_steps"] == 7
    assert (tmp_path / "demo" / "tiny-model" / "model.safetensors").is_file()
    assert (tmp_path / "demo" / "warm_start.jsonl").read_text().count("\n") == 2000
    parse_job_spec(spec)


def test_without_seen_as_the_spec_names_the_files_themselves(tmp_path):
    spec = yaml.safe_load(write_demo_files(tmp_path).read_text())
    assert spec["model"]["path"] == str((tmp_path / "tiny-model").resolve())


def test_every_model_file_is_readable_by_other_users_as_the_umask_allows(tmp_path):
    # compose runs Tandem as uid 1000; transformers writes the weights with mode 0600.
    old = os.umask(0o022)
    try:
        write_demo_files(tmp_path)
    finally:
        os.umask(old)
    for path in (tmp_path / "tiny-model").iterdir():
        assert path.stat().st_mode & stat.S_IROTH, f"{path.name}: {stat.filemode(path.stat().st_mode)}"
