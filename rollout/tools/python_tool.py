"""A Python interpreter tool on the code sandbox (`rollout.tools.sandbox`): the policy's
code runs in namespaces of its own (no network, no host files, an empty environment, limits
on processes, memory, output and CPU), and what it printed (or the error that stopped it) is
the result. Each call is a fresh sandbox: no state, file or process carries between calls.
Where the sandbox is unavailable the call fails with "sandbox unavailable: <why>"."""

from __future__ import annotations

import asyncio

from rollout.tools.base import ToolError, function_schema
from rollout.tools.sandbox import SandboxLimits, run_code

MAX_OUTPUT_CHARS = 2000
"""What the model reads back of a run's output; the rest is cut with a note."""


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
        # The sandbox blocks on its child: a thread keeps the episode loop free.
        result = await asyncio.to_thread(run_code, arguments["code"], self.limits)
        output = result.output
        if len(output) > MAX_OUTPUT_CHARS:
            output = output[:MAX_OUTPUT_CHARS] + f"\n[output cut at {MAX_OUTPUT_CHARS} characters]"
        if result.error is not None:
            raise ToolError(f"{output}\n{result.error}".strip())
        return output if output.strip() else "(no output)"

    async def close(self) -> None:
        pass
