"""`tandem api`, `judge-proxy`, `rollout`, `learner`: run one of Tandem's processes. Each parses its
settings (`TANDEM_*` variables), sets up logging, and only then imports the heavy code."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

log = logging.getLogger("tandem")


def serve_http(name: str, settings, create_app, open_to_all: str) -> None:
    """An HTTP process: its settings logged (secrets masked), a warning naming what is open
    when it has no tokens (`open_to_all`), then uvicorn on its host and port."""
    import uvicorn

    from services.logs import setup_logging

    setup_logging(settings.log_level, name)
    log.info("settings: %s", settings.loggable())
    if open_to_all:
        log.warning("AUTH IS OFF: %s; it listens on %s only", open_to_all, settings.host)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")


def cmd_api(args: argparse.Namespace) -> None:
    from services.api.app import create_app
    from services.config import ApiSettings

    settings = ApiSettings()
    why = (
        ""
        if settings.tokens
        else "TANDEM_TOKENS is empty, so the API trusts every caller (set tokens before opening it)"
    )
    serve_http("api", settings, create_app, why)


def cmd_judge_proxy(args: argparse.Namespace) -> None:
    from judge_proxy.app import create_app
    from services.config import JudgeProxySettings

    settings = JudgeProxySettings()
    why = "" if settings.client_tokens else "TANDEM_CLIENT_TOKENS is empty, so the proxy believes every X-Tandem-Job"
    serve_http("judge-proxy", settings, create_app, why)


def cmd_rollout(args: argparse.Namespace) -> None:
    from services.config import RolloutSettings
    from services.logs import setup_logging

    settings = RolloutSettings()
    setup_logging(settings.log_level, "rollout")
    from rollout.server import RolloutServer

    asyncio.run(RolloutServer(settings).run())


def cmd_learner(args: argparse.Namespace) -> None:
    from tandem.launcher import learner_command

    try:
        command = learner_command(
            args.nproc, resume=args.resume, nodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id
        )
    except ValueError as err:
        sys.exit(f"tandem learner: {err}")
    os.execv(sys.executable, command)


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("api", help="the REST job API").set_defaults(run=cmd_api)
    sub.add_parser("judge-proxy", help="the judge proxy").set_defaults(run=cmd_judge_proxy)
    sub.add_parser("rollout", help="a rollout server").set_defaults(run=cmd_rollout)
    p = sub.add_parser("learner", help="the learner under torchrun")
    p.add_argument("--nproc", type=int, default=2, help="learner ranks on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (machines, pods) the learner spans")
    p.add_argument(
        "--rdzv-endpoint",
        default="",
        help="host:port where the nodes meet (torch c10d rendezvous); needed with --nnodes > 1",
    )
    p.add_argument("--rdzv-id", default="tandem-learner", help="the rendezvous's name, the same on every node")
    p.add_argument("--resume", action="store_true", help="continue RUNNING jobs from their checkpoints")
    p.set_defaults(run=cmd_learner)
