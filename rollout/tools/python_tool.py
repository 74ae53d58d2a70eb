"""A Python interpreter tool on the code sandbox (`rollout.tools.sandbox`): the policy's
code runs in namespaces of its own (no network, no host files, an empty environment, limits
on processes, memory, output and CPU), and what it printed (or the error that stopped it) is
the result. Each call is a fresh sandbox: no state, file or process carries between calls.
Where the sandbox is unavailable the call fails with "sandbox unavailable: <why>".

A call cancelled with its episode (the job stopped, the tool box's timeout) stops its
sandbox at once and returns only once the thread that waited for it has: nothing of a
cancelled call outlives it, so the tool's concurrency limit holds for running sandboxes."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

from rollout.tools.base import ToolError, function_schema
from rollout.tools.sandbox import CodeResult, SandboxLimits, refusal, run_code
from services.config import PythonToolSpec

MAX_OUTPUT_CHARS = 2000
"""What the model reads back of a run's output; the rest is cut with a note."""
STOP_POLL_S = 0.05
"""How often a cancelled call looks for its sandbox's reaper while the sandbox starts."""


class PythonTool:
    def __init__(self, name: str = "python", description: str | None = None, timeout_s: float = 10.0) -> None:
        self.name = name
        self.description = description or "Run a Python program and read what it prints."
        self.limits = SandboxLimits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)))

    def schema(self) -> dict:
        return function_schema(
            self.name,
            self.description,
            {"code": {"type": "string", "description": "A complete program; print what you want to see."}},
            ["code"],
        )

    async def call(self, arguments: dict) -> str:
        result = await run_stoppable(arguments["code"], self.limits)
        output = result.output
        if len(output) > MAX_OUTPUT_CHARS:
            output = output[:MAX_OUTPUT_CHARS] + f"\n[output cut at {MAX_OUTPUT_CHARS} characters]"
        if result.error is not None:
            raise ToolError(f"{output}\n{result.error}".strip())
        return output if output.strip() else "(no output)"

    async def close(self) -> None:
        pass


async def run_stoppable(code: str, limits: SandboxLimits) -> CodeResult:
    """`run_code` on a thread (it blocks on its child), stopped if the caller is cancelled."""
    # The process's first call runs the sandbox's trial, whose verdict is kept for good:
    # never stopped half way, or a stopped trial would read as "sandbox unavailable".
    await asyncio.shield(asyncio.to_thread(refusal))
    worker: list[int] = []

    def work() -> CodeResult:
        worker.append(threading.get_native_id())
        return run_code(code, limits)

    running = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        # Shielded: a second cancel does not leave the sandbox running either.
        await asyncio.shield(asyncio.ensure_future(_stop(running, worker)))
        raise


async def _stop(running: asyncio.Future, worker: list[int]) -> None:
    """SIGTERM the worker thread's children (the sandbox's reaper, which then kills all in
    the sandbox: the caller's timeout path) until the thread has returned."""
    signalled: set[int] = set()
    while not running.done():
        if worker:
            _terminate_children(worker[0], signalled)
        await asyncio.wait({running}, timeout=STOP_POLL_S)


def _terminate_children(thread_id: int, signalled: set[int]) -> None:
    for pid in _children(thread_id) - signalled:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # ended and reaped meanwhile
        try:
            if pid in _children(thread_id):  # the pidfd is the child's, not a reused pid's
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)
                signalled.add(pid)
        finally:
            os.close(pidfd)


def _children(thread_id: int) -> set[int]:
    """The processes a thread of this process started and has not reaped."""
    try:
        with open(f"/proc/self/task/{thread_id}/children") as children:
            return {int(pid) for pid in children.read().split()}
    except FileNotFoundError:
        return set()  # the thread has ended


async def open_tools(specs: list[PythonToolSpec]) -> list[PythonTool]:
    """The tools of `specs` (all of this kind), in their order (`rollout.tools.box.TOOL_MODULES`)."""
    return [PythonTool(spec.name, spec.description, spec.timeout_s) for spec in specs]
