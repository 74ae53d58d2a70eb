"""The benchmarks' shared harness: its flags, its spread and its reports, and a row in
bench/README.md for every benchmark."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from bench import harness
from bench.__main__ import benchmarks


def parse(*argv: str, seeds: str | None = "0") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    harness.common_args(parser, "example", seeds=seeds)
    return parser.parse_args(argv)


def test_seeds_are_always_a_list_and_out_always_a_folder():
    args = parse("--seeds", "3,1,2")
    assert args.seeds == [3, 1, 2] and args.out.name == "example" and not args.publish
    assert parse().seeds == [0]
    assert not hasattr(parse(seeds=None), "seeds")
    with pytest.raises(SystemExit):
        parse("--seeds", "three")


def test_spread_counts_the_runs_without_a_value():
    assert harness.spread([2.0, None, 4.0, 3.0]) == {"min": 2.0, "mean": 3.0, "max": 4.0, "missing": 1}
    assert harness.spread([None]) == {"min": None, "mean": None, "max": None, "missing": 1}


def test_moving_average_takes_what_there_is_at_the_start():
    assert harness.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_a_report_goes_to_out_and_with_publish_to_the_docs_too(tmp_path, monkeypatch):
    published, figures = tmp_path / "docs-results", tmp_path / "docs-img"
    published.mkdir()
    figures.mkdir()
    monkeypatch.setattr(harness, "PUBLISHED", published)
    monkeypatch.setattr(harness, "PUBLISHED_FIGURES", figures)
    args = parse("--out", str(tmp_path / "out"), "--publish")
    drawn = []
    harness.write_report("example", {"a": 1}, args, lambda report, path: drawn.append(path) or path.write_text("png"))
    assert json.loads((tmp_path / "out" / "example.json").read_text()) == {"a": 1}
    assert drawn == [tmp_path / "out" / "example.png"]
    assert [p.name for p in published.iterdir()] == ["example.json"]
    assert [p.name for p in figures.iterdir()] == ["example.png"]


def test_every_benchmark_has_its_row_in_the_readme_and_every_row_a_benchmark():
    text = (harness.REPO / "bench" / "README.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.MULTILINE))
    assert rows - {"async_groups"} == set(benchmarks())
