"""Waiting on a live system, shared by the integration and compose tests (tests/ is on
sys.path: pytest puts the folder of the root conftest.py there)."""

from __future__ import annotations

import time


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll `condition()` until it returns something truthy (returned); TimeoutError naming
    `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
