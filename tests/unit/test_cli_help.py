"""Every help a newcomer can ask `tandem` for renders: the top level and each subcommand,
nested ones included (argparse formats help text with %, so a stray percent sign crashes it)."""

from __future__ import annotations

import argparse

import pytest

from tandem.cli import build_parser


def every_parser(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from every_parser(child, (*path, name))


PARSERS = list(every_parser(build_parser()))


def test_the_walk_finds_the_subcommands():
    names = {path for path, _ in PARSERS}
    assert {(), ("eval",), ("follow",), ("demo",)} <= names
    assert any(len(path) == 2 for path in names)  # `tandem model get`, a nested one


@pytest.mark.parametrize("path", [path for path, _ in PARSERS], ids=lambda p: " ".join(("tandem", *p)))
def test_help_renders(path, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*path, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tandem") and " ".join(path) in out
