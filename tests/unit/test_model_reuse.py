"""`tandem model get` reuses a folder it made only while the folder's files are the ones its
provenance.json records: a changed, missing or added file is refused by name, and nothing is
fetched or overwritten. The folders here are written by hand; tests/integration/
test_model_import.py makes a real one."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from tandem.models import KNOWN, PROVENANCE, file_digests, get, provenance

NAME = "smollm2-135m-instruct"
PINNED = KNOWN[NAME]
NO_PIP = ["false"]
"""A pip that fails: a test that reaches the registry fails with ModelFetchError."""


@pytest.fixture
def made(tmp_path) -> Path:
    """A folder as `get` leaves it: weights, config, tokenizer and the provenance naming them."""
    folder = tmp_path / NAME
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "tokenizer.json").write_text("{}")
    record = {
        "source_sha256": PINNED.file_sha256,
        "model": NAME,
        "package": asdict(PINNED),
        "files": file_digests(folder),
    }
    (folder / PROVENANCE).write_text(json.dumps(record))
    return folder


def test_a_folder_whose_files_match_its_provenance_is_reused_without_the_registry(made):
    assert get(NAME, made, pip=NO_PIP) == made
    assert set(provenance(made)["files"]) == {"model.safetensors", "config.json", "tokenizer.json"}


def test_changed_weights_are_refused_by_name_and_left_as_they_are(made):
    weights = made / "model.safetensors"
    tampered = bytes([255]) + weights.read_bytes()[1:]
    weights.write_bytes(tampered)

    with pytest.raises(FileExistsError, match=r"model\.safetensors.*run `tandem model get` again"):
        get(NAME, made, pip=NO_PIP)
    assert weights.read_bytes() == tampered


@pytest.mark.parametrize("change", ["missing", "added"])
def test_a_missing_or_added_file_is_refused_by_name(made, change):
    if change == "missing":
        (made / "tokenizer.json").unlink()
        named = "tokenizer.json"
    else:
        (made / "chat_template.jinja").write_text("{{ messages }}")
        named = "chat_template.jinja"

    with pytest.raises(FileExistsError, match=named):
        get(NAME, made, pip=NO_PIP)


def test_a_folder_whose_provenance_records_no_file_digests_is_refused(made):
    record = provenance(made)
    del record["files"]
    (made / PROVENANCE).write_text(json.dumps(record))

    with pytest.raises(FileExistsError, match="records no file digests"):
        get(NAME, made, pip=NO_PIP)


def test_the_cli_says_why_it_refuses_changed_weights(made):
    (made / "model.safetensors").write_bytes(b"not the weights")

    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "model", "get", NAME, str(made)], capture_output=True, text=True
    )

    assert done.returncode == 1 and "model.safetensors" in done.stderr and "Traceback" not in done.stderr
