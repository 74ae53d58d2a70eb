"""A python-tool call cancelled with its episode (the job stopped, the tool box's timeout)
stops its sandbox then and there: no program keeps running on the host and no thread keeps
waiting for it, so a cancelled call frees its share of the tool's concurrency for real."""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
import traceback

import pytest
from test_code_sandbox import processes_with

from rollout.tools import sandbox
from rollout.tools.python_tool import PythonTool

SANDBOX_TIMEOUT_S = 30.0
"""The call's own limit: what a cancelled call's thread and program would live on for."""
STOP_BOUND_S = 5.0
"""SIGTERM to the reaper, which SIGKILLs init; the kernel then ends the PID namespace. That
takes milliseconds; the bound is generous and still far below SANDBOX_TIMEOUT_S."""


def threads_in_the_sandbox() -> list[int]:
    """Ids of the threads now inside the sandbox's caller (waiting for its reaper)."""
    waiting = sandbox._run_reaper.__code__
    return [
        thread_id
        for thread_id, frame in sys._current_frames().items()
        if any(f.f_code is waiting for f, _ in traceback.walk_stack(frame))
    ]


async def poll(condition, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_cancelled_call_ends_its_program_and_its_thread_within_the_bound():
    token = secrets.token_hex(8)
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])"
    tool = PythonTool(timeout_s=SANDBOX_TIMEOUT_S)
    call = asyncio.create_task(tool.call({"code": code}))
    assert await poll(lambda: processes_with(token), within_s=20.0), "the program never started"
    assert threads_in_the_sandbox()

    started = time.monotonic()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    stopped_s = time.monotonic() - started

    assert await poll(lambda: not processes_with(token) and not threads_in_the_sandbox(), within_s=STOP_BOUND_S)
    assert stopped_s < STOP_BOUND_S
