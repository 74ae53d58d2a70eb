"""The files make lint keeps in step with their sources: the configuration reference (from
the pydantic models), the code map (from the modules' docstrings) and the Kubernetes base's
copies of the dashboards and upstreams example. Each check passes on the repository and
fails on a stale copy."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_current_and_a_stale_one_fails_the_check(tmp_path, monkeypatch):
    reference = script("config_reference")
    assert (ROOT / "docs" / "configuration.md").read_text() == reference.render()
    assert "`kind: offline`" in reference.render() and "`TANDEM_REDIS_URL`" in reference.render()
    stale = tmp_path / "docs" / "configuration.md"
    stale.parent.mkdir()
    stale.write_text(reference.render().replace("| `lr` |", "| `learning_rate` |", 1))
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    monkeypatch.setattr(reference, "OUT", stale)
    monkeypatch.setattr(sys, "argv", ["config_reference.py", "--check"])
    with pytest.raises(SystemExit, match="out of date"):
        reference.main()


def test_the_code_map_is_current_names_every_module_and_a_stale_one_fails_the_check(tmp_path, monkeypatch):
    code_map = script("code_map")
    text = code_map.render()
    assert (ROOT / "docs" / "layout.md").read_text() == text
    assert "| `rollout/served_job.py` | One job on a rollout server" in text
    undocumented = [
        str(path.relative_to(ROOT))
        for top, _ in code_map.PARTS
        for path, source in code_map.modules(top).items()
        if not code_map.summary(source)
    ]
    assert undocumented == []
    stale = tmp_path / "layout.md"
    stale.write_text(text.replace("served_job.py", "server_job.py"))
    monkeypatch.setattr(code_map, "OUT", stale)
    monkeypatch.setattr(sys, "argv", ["code_map.py", "--check"])
    with pytest.raises(SystemExit, match="out of date"):
        code_map.main()


def test_the_kubernetes_copies_are_current_and_a_changed_or_extra_one_is_named(tmp_path, monkeypatch):
    sync = script("sync_k8s_files")
    assert sync.stale() == []
    deploy = tmp_path / "deploy"
    for source in sync.sources():
        target = deploy / source.relative_to(sync.DEPLOY)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
    monkeypatch.setattr(sync, "ROOT", tmp_path)
    monkeypatch.setattr(sync, "DEPLOY", deploy)
    monkeypatch.setattr(sync, "FILES", deploy / "k8s" / "base" / "files")
    monkeypatch.setattr(sys, "argv", ["sync_k8s_files.py"])
    sync.main()
    assert sync.stale() == []
    (deploy / "grafana" / "dashboards" / "judge.json").write_text("{}")
    (sync.FILES / "left-over.yaml").write_text("x: 1\n")
    assert sync.stale() == [
        "deploy/k8s/base/files/dashboards/judge.json",
        "deploy/k8s/base/files/left-over.yaml (no source)",
    ]
