"""One log format for every process: time, process name, level, logger, message."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, process: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
