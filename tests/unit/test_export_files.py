"""Exports are written beside their folder and renamed into place: a reader finds the old
policy or the new one whole, and an export cut short (disk full, a kill) leaves none half
written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner import checkpoint
from learner.policy import save_hf_folder
from services.config import ModelSpec, RLJob
from tandem import models


def no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_an_export_cut_short_leaves_the_previous_policy_whole_and_the_next_replaces_it(
    tiny_model, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    out = tmp_path / "policy"
    save_hf_folder(model, model.state_dict(), str(tiny_model), out)
    first = contents(out)
    changed = {name: tensor + 1.0 for name, tensor in model.state_dict().items()}

    with monkeypatch.context() as patch:
        patch.setattr(AutoTokenizer, "from_pretrained", no_space)  # after the weights are written
        with pytest.raises(OSError, match="No space"):
            save_hf_folder(model, changed, str(tiny_model), out)

    assert contents(out) == first
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]

    save_hf_folder(model, changed, str(tiny_model), out)

    assert contents(out).keys() == first.keys()
    assert contents(out)["model.safetensors"] != first["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]


def test_tandem_export_cut_short_leaves_no_folder_behind(tiny_model, tmp_path, monkeypatch):
    runs, job_id = tmp_path / "runs", "job-0123abcd"
    (runs / job_id / "policy").mkdir(parents=True)
    (runs / job_id / "policy" / "model.safetensors").write_bytes(b"weights")
    (runs / job_id / checkpoint.SPEC).write_text(RLJob(model=ModelSpec(path=str(tiny_model))).model_dump_json())
    monkeypatch.setattr(models, "provenance", no_space)  # the last file it writes
    out = tmp_path / "exported"

    with pytest.raises(OSError, match="No space"):
        models.export_job(runs, job_id, None, out)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
