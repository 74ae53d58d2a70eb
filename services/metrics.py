"""`/metrics` and `/healthz` for every process.

HTTP services mount `metrics_router`; the learner and the rollout server, which have no
web framework of their own, call `serve_metrics` to get a small threaded HTTP server.
Names follow `tandem_<component>_<what>_<unit>` (DESIGN.md, Metrics).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

HealthFn = Callable[[], tuple[bool, dict]]


def _always_ok() -> tuple[bool, dict]:
    return True, {}


def serve_metrics(port: int, health: HealthFn = _always_ok, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve `/metrics` and `/healthz` on a daemon thread; returns the server (port 0 = any)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.startswith("/metrics"):
                self._reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
            elif self.path.startswith("/healthz"):
                ok, detail = health()
                body = json.dumps({"ok": ok, **detail}).encode()
                self._reply(200 if ok else 503, body, "application/json")
            else:
                self._reply(404, b"not found\n", "text/plain")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every few seconds: keep logs quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def metrics_router(health: HealthFn = _always_ok):
    """A FastAPI router with the same two routes, for the HTTP services."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, Response

    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    def metrics():
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @router.get("/healthz")
    def healthz():
        ok, detail = health()
        return JSONResponse({"ok": ok, **detail}, status_code=200 if ok else 503)

    return router
