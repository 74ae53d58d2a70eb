"""One log format for every process: time, process name, level, logger, message.

A line logged while serving an HTTP request that set `REQUEST_ID` (the judge proxy does, from
`x-request-id`) carries `[request <id>]` after the logger's name, so a client's request id
finds its lines.
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REQUEST_ID.get()
        record.request = f" [request {request_id}]" if request_id else ""
        return True


def setup_logging(level: str, process: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {process} %(levelname)s %(name)s%(request)s: %(message)s",
        force=True,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
