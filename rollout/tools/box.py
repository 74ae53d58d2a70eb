"""The tools of one job on one rollout server, and everything around a call that is not the
tool itself: reading calls from a reply, checking arguments against the schema, the per-tool
limit on calls running at once (shared by every episode on the server: a call waits for a
free slot), per-episode call limits, timeouts, and turning every failure into a message the
model reads plus a counted reason. Nothing a tool or the policy does ends an episode.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import jsonschema
from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram

from rollout.tools.base import Tool, ToolCall, ToolError, World, WorldTool, acts_on_world
from rollout.tools.parsers import PARSERS, Parsed
from services.config import ToolBase, ToolCatalog, ToolsSpec
from services.tool_catalog import CatalogError, bind_servers, check_public_url, inline_urls, with_file_tools

TOOL_MODULES = {
    "calculator": "rollout.tools.calculator",
    "python": "rollout.tools.python_tool",
    "search": "rollout.tools.search",
    "mcp": "rollout.tools.mcp",
}
"""Tool kind (`kind`) -> the module whose `open_tools(specs)` opens tools of that kind, one per
spec in order. Kinds open in this order, so the ones holding servers (mcp) open last, when
nothing after them can fail and leave them running."""

FAILURES = ("malformed", "unknown_tool", "bad_arguments", "call_limit", "timeout", "tool_error", "exception")
"""Why a call failed: unreadable, a tool the job does not have, arguments the schema
rejects, over the episode's limits, cut at its timeout, a failure the tool explained, or
an exception it did not."""

CALLS = PromCounter(
    "tandem_rollout_tool_calls_total", "Tool calls the policy made, by tool and outcome", ["job", "tool", "outcome"]
)
LATENCY = Histogram(
    "tandem_rollout_tool_seconds",
    "Tool call time, waiting for a slot included",
    ["job", "tool"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 1, 2, 5, 10, 30, 60),
)
PER_EPISODE = Histogram(
    "tandem_rollout_tool_calls_per_episode",
    "Tool calls per finished episode",
    ["job"],
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
)


class ToolLimits(Protocol):
    """What the tool box enforces for one tool (a `ToolSpec` from the job, or a task's
    own limits for the tools it brings)."""

    @property
    def max_calls(self) -> int: ...

    @property
    def max_concurrency(self) -> int: ...

    @property
    def timeout_s(self) -> float: ...


@dataclass(frozen=True)
class TaskToolLimits:
    """The limits of a tool a task brings: in-memory calls, many at once, quick."""

    max_calls: int
    max_concurrency: int = 64
    timeout_s: float = 30.0


@dataclass
class ToolResult:
    call: ToolCall | None
    """None for a call that could not be read."""
    content: str
    """What the model reads back."""
    failure: str = ""
    """One of FAILURES; "" for a call that succeeded."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failure


@dataclass
class ToolUsage:
    """One episode's calls: what the limits count and what rewards and metrics read."""

    calls: Counter = field(default_factory=Counter)
    """Calls run, by tool name (what the per-tool limit counts)."""
    results: list[ToolResult] = field(default_factory=list)
    world: World | None = None
    """The episode's own state its world tools act on (`rollout.tools.base.World`); None
    for a job without such tools."""

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def succeeded(self) -> int:
        return sum(r.ok for r in self.results)

    def failures(self) -> Counter:
        return Counter(r.failure for r in self.results if r.failure)

    def copy(self) -> ToolUsage:
        return ToolUsage(Counter(self.calls), list(self.results), self.world and self.world.fork())


class ToolBox:
    def __init__(
        self, spec: ToolsSpec, tools: Sequence[Tool | WorldTool], limits: dict[str, ToolLimits], job: str = ""
    ) -> None:
        self.spec = spec
        self.tools = {tool.name: tool for tool in tools}
        self.limits = limits
        self.job = job
        self.parse = PARSERS[spec.parser]
        self.slots = {name: asyncio.Semaphore(limits[name].max_concurrency) for name in self.tools}
        self.validators = {
            name: jsonschema.Draft202012Validator(tool.schema()["function"]["parameters"])
            for name, tool in self.tools.items()
        }
        self.in_flight = Counter[str]()
        """Calls running now, by tool (tests check the concurrency limit with it)."""
        self.most_in_flight = Counter[str]()

    @classmethod
    async def open(
        cls, spec: ToolsSpec, job: str = "", catalog: ToolCatalog = ToolCatalog(), allow_inline_mcp: bool = False
    ) -> ToolBox:
        """Build every tool the spec names (the file's included), starting MCP servers: those
        the operator's `catalog` names, or inline ones where allowed and (URLs) public.
        ValueError naming the tool for a server the catalogue does not allow."""
        spec = with_file_tools(spec)
        try:
            bound = bind_servers(spec, catalog, allow_inline_mcp)
        except CatalogError as exc:
            raise ValueError(f"tools.tools[{exc.index}].server: {exc}") from None
        for url in inline_urls(spec):
            await asyncio.to_thread(check_public_url, url)
        spec = bound
        return cls(spec, await open_kinds(spec.tools), {t.name: t for t in spec.tools}, job)

    @classmethod
    def of_task(cls, spec: ToolsSpec, tools: Sequence[Tool | WorldTool], job: str = "") -> ToolBox:
        """A box for the tools a task brings (τ²-bench's domain tools): the job's `tools`
        section sets only the parser and the per-episode limits, which bound each tool too."""
        limits = TaskToolLimits(max_calls=spec.max_calls_per_episode)
        return cls(spec, tools, {tool.name: limits for tool in tools}, job)

    def schemas(self) -> list[dict]:
        """The OpenAI function schemas, for the chat template's `tools` argument."""
        return [tool.schema() for tool in self.tools.values()]

    async def run(self, parsed: Parsed, usage: ToolUsage, recorded: list[ToolResult] | None = None) -> list[ToolResult]:
        """Every call of one reply, concurrently; recorded in `usage`. The results of the
        readable calls come in the reply's order (refused ones in their place), then one
        per unreadable call. `recorded` is what an earlier run of this very reply returned
        (a task's journal): its results stand in for calls to tools that do not act on the
        episode's world, which are not made again. World tools run again, since the world
        they change is rebuilt by replaying them (they are functions of it)."""
        refusals: list[ToolResult | None] = []
        admitted: list[tuple[int, ToolCall]] = []
        for call in parsed.calls:
            refused = self._refusal(call, usage)
            if refused is None:
                admitted.append((len(refusals), call))
                usage.calls[call.name] += 1
            refusals.append(refused)
        ran = iter(
            await asyncio.gather(*(self._answer(index, call, usage.world, recorded) for index, call in admitted))
        )
        results = [refused if refused is not None else next(ran) for refused in refusals]  # ran is in index order
        results += [
            ToolResult(None, f"error: could not read the tool call ({m.reason})", "malformed") for m in parsed.malformed
        ]
        for result in results:
            name = result.call.name if result.call is not None and result.call.name in self.tools else "-"
            CALLS.labels(self.job, name, result.failure or "ok").inc()
        usage.results += results
        return results

    def _refusal(self, call: ToolCall, usage: ToolUsage) -> ToolResult | None:
        """Why a readable call is not run, as its result; None to run it."""
        if call.name not in self.tools:
            known = ", ".join(sorted(self.tools))
            return ToolResult(call, f"error: there is no tool named {call.name!r} (tools: {known})", "unknown_tool")
        errors = sorted(self.validators[call.name].iter_errors(call.arguments), key=lambda e: list(e.path))
        if errors:
            where = "/".join(map(str, errors[0].path)) or "arguments"
            return ToolResult(
                call, f"error: bad arguments for {call.name}: {where}: {errors[0].message}", "bad_arguments"
            )
        if usage.calls[call.name] >= self.limits[call.name].max_calls:
            return ToolResult(
                call,
                f"error: {call.name} may be called at most {self.limits[call.name].max_calls} times per conversation",
                "call_limit",
            )
        if sum(usage.calls.values()) >= self.spec.max_calls_per_episode:
            return ToolResult(
                call, f"error: at most {self.spec.max_calls_per_episode} tool calls per conversation", "call_limit"
            )
        return None

    async def _answer(
        self, index: int, call: ToolCall, world: World | None, recorded: list[ToolResult] | None
    ) -> ToolResult:
        """The result of the reply's call at `index`: the recorded one, or the tool's."""
        if recorded is not None and not acts_on_world(self.tools[call.name]):
            return recorded[index]
        return await self._call(call, world)

    async def _call(self, call: ToolCall, world: World | None) -> ToolResult:
        """Wait for a slot of the tool, run it under its timeout; the wait counts in the time."""
        timeout = self.limits[call.name].timeout_s
        started = time.monotonic()
        async with self.slots[call.name]:
            self.in_flight[call.name] += 1
            self.most_in_flight[call.name] = max(self.most_in_flight[call.name], self.in_flight[call.name])
            try:  # asyncio.timeout: Python 3.11's wait_for can swallow the episode's cancel
                async with asyncio.timeout(timeout):
                    content, failure = await self._invoke(self.tools[call.name], call.arguments, world), ""
            except TimeoutError:
                content, failure = f"error: {call.name} did not answer within {timeout:g} s", "timeout"
            except ToolError as exc:
                content, failure = f"error: {exc}", "tool_error"
            except Exception as exc:  # noqa: BLE001 - a broken tool is reported, never ends the episode
                content, failure = f"error: {call.name} failed ({type(exc).__name__}: {exc})", "exception"
            finally:
                self.in_flight[call.name] -= 1
        seconds = time.monotonic() - started
        LATENCY.labels(self.job, call.name).observe(seconds)
        return ToolResult(call, content, failure, seconds)

    @staticmethod
    async def _invoke(tool: Tool | WorldTool, arguments: dict, world: World | None) -> str:
        if not acts_on_world(tool):
            return await tool.call(arguments)
        if world is None:
            raise RuntimeError(f"{tool.name} acts on the episode's world, and this episode has none")
        return await tool.call(arguments, world)

    def observe_episode(self, usage: ToolUsage) -> None:
        PER_EPISODE.labels(self.job).observe(usage.total)

    async def close(self) -> None:
        for tool in self.tools.values():
            try:
                await tool.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                pass


def usage_metrics(usage: ToolUsage) -> dict[str, float]:
    """An episode's tool use as sample metrics: calls made, whether it made at least one
    call that ran, the share that succeeded (0 without calls), and failures by reason."""
    total = usage.total
    metrics = {
        "tool_calls": float(total),
        "tool_used": float(usage.succeeded > 0),
        "tool_success_ratio": usage.succeeded / total if total else 0.0,
    }
    failures = usage.failures()
    return metrics | {f"tool_failed_{reason}": float(failures[reason]) for reason in FAILURES}


def tool_message(result: ToolResult) -> dict:
    """The chat message that carries a result back to the model."""
    message = {"role": "tool", "content": result.content}
    if result.call is not None:
        message["name"] = result.call.name
    return message


async def open_kinds(specs: Sequence[ToolBase]) -> list[Tool]:
    """One tool per spec, in the specs' order, each opened by its kind's module."""
    by_kind: dict[str, list[int]] = {}
    for index, spec in enumerate(specs):
        by_kind.setdefault(spec.kind, []).append(index)
    opened: dict[int, Tool] = {}
    for kind, module in TOOL_MODULES.items():
        if kind in by_kind:
            tools = await importlib.import_module(module).open_tools([specs[i] for i in by_kind[kind]])
            opened.update(zip(by_kind[kind], tools, strict=True))
    return [opened[index] for index in range(len(specs))]
