"""`tandem`: run a process, the whole stack, the demo, or talk to the job API.

Each module here registers its own subcommands (`register`): the processes (`serve`), the
system on this machine (`local`), model folders (`models`), evaluation (`evaluate`) and the
job API's client (`jobs`). Process commands parse their settings (from `TANDEM_*`
environment variables), set up logging, and only then import the heavy code (torch, vLLM).
"""

from __future__ import annotations

import argparse

from tandem.cli import evaluate, jobs, local, models, serve

GROUPS = (serve, models, evaluate, local, jobs)
"""The modules whose subcommands `tandem` has, in the order `tandem --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)
