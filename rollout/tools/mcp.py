"""Tools an MCP server serves, called through the official `mcp` SDK.

An `McpConnection` is one client session with one server: a child process spoken to over
stdio, or a streamable-HTTP endpoint. The SDK's transports and session are anyio context
managers whose task groups must be entered and exited by the same task, while the session
outlives any one episode; so a dedicated runner task opens the session, holds it open until
`close()` and closes it, and calls from any other task go through the open `Client`.

`open_tools` turns a job's mcp tool specs into `McpTool`s, one connection per distinct
server, each connection closed when the last of its tools is.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shlex

import anyio
from mcp import Client, StdioServerParameters, types

from rollout.tools.base import ToolError
from services.config import McpServerSpec, McpToolSpec

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
"""How long a server has to start and answer the handshake (an npx server may fetch first)."""


class McpConnection:
    """One session with one MCP server: `start()` opens it, `close()` ends it.

    Tools sharing the connection `hold()` it and `release()` it; the last release closes it.
    """

    def __init__(self, server: McpServerSpec, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.server = server
        self.start_timeout_s = start_timeout_s
        self._client: Client | None = None
        self._runner: asyncio.Task | None = None
        self._closing = asyncio.Event()
        self._num_holders = 0

    @property
    def label(self) -> str:
        """How messages name the server: its command line, or its URL."""
        return self.server.url if self.server.url is not None else shlex.join(_command(self.server))

    async def start(self) -> None:
        """Open the session. RuntimeError naming the server when it cannot be started, does
        not complete the handshake within `start_timeout_s`, or fails it."""
        opened = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(self._run(opened), name=f"mcp session {self.label}")
        try:
            await asyncio.shield(opened)
        except BaseException as exc:
            await self.close()
            if isinstance(exc, Exception):
                raise RuntimeError(f"MCP server {self.label} did not start: {_reason(exc)}") from exc
            raise

    async def _run(self, opened: asyncio.Future) -> None:
        """The runner task: open the session within the start timeout, resolve `opened`, hold
        the session until `close()`, then close it (and stop a stdio child) in this task."""
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + self.start_timeout_s) as start_scope:
                async with Client(self._target()) as client:
                    start_scope.deadline = math.inf
                    self._client = client
                    opened.set_result(None)
                    await self._closing.wait()
        except Exception as exc:
            if opened.done():
                raise
            opened.set_exception(exc)
        if not opened.done():
            opened.set_exception(TimeoutError(f"no completed handshake within {self.start_timeout_s}s"))

    def _target(self) -> StdioServerParameters | str:
        """What `Client` connects to. The SDK starts a stdio child with `env` over a minimal
        inherited environment (PATH, HOME, USER, ...), in a process group of its own."""
        if self.server.url is not None:
            return self.server.url
        program, *args = _command(self.server)
        return StdioServerParameters(command=program, args=args, env=self.server.env)

    @property
    def client(self) -> Client:
        """The open session's client; RuntimeError before `start()` opened it."""
        if self._client is None:
            raise RuntimeError(f"the MCP session with {self.label} is not open")
        return self._client

    async def list_tools(self) -> list[types.Tool]:
        """Every tool the server serves, across all pages of its listing."""
        tools: list[types.Tool] = []
        cursor = None
        while True:
            page = await self.client.list_tools(cursor=cursor)
            tools += page.tools
            if (cursor := page.next_cursor) is None:
                return tools

    async def call(self, name: str, arguments: dict) -> str:
        """Call tool `name`; the result's content as text. ToolError with that text when the
        server marks the result as an error (isError)."""
        result = await self.client.call_tool(name, arguments)
        text = "\n".join(map(_content_text, result.content))
        if result.is_error:
            raise ToolError(text)
        return text

    def hold(self) -> None:
        """Count one more user (a tool) that must `release()` the connection."""
        self._num_holders += 1

    async def release(self) -> None:
        """One user is done; the last one closes the connection."""
        self._num_holders -= 1
        if self._num_holders == 0:
            await self.close()

    async def close(self) -> None:
        """End the session; a stdio child has exited (or been killed) when this returns.
        Idempotent. A session that broke after it opened is logged, not raised: the episodes
        that used it have already seen their calls fail."""
        self._closing.set()
        if self._runner is None:
            return
        try:
            await self._runner
        except Exception:
            logger.warning("MCP session with %s ended with an error", self.label, exc_info=True)


class McpTool:
    """One tool an MCP server serves, as an episode's `Tool`, over a shared connection."""

    def __init__(self, connection: McpConnection, tool: types.Tool, description: str | None = None) -> None:
        self.name = tool.name
        self.connection = connection
        self._schema = {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": description or tool.description or "",
                "parameters": tool.input_schema,
            },
        }
        connection.hold()

    def schema(self) -> dict:
        return self._schema

    async def call(self, arguments: dict) -> str:
        return await self.connection.call(self.name, arguments)

    async def close(self) -> None:
        await self.connection.release()


async def open_tools(specs: list[McpToolSpec]) -> list[McpTool]:
    """The tools of `specs` (all of kind mcp), in their order, with one connection per distinct
    server. ValueError naming a tool its server does not serve (and what it serves);
    RuntimeError naming a server that does not start. Either way nothing is left open."""
    connections: dict[str, McpConnection] = {}
    served: dict[str, dict[str, types.Tool]] = {}
    tools: list[McpTool] = []
    try:
        for spec in specs:
            server = spec.server
            if isinstance(server, str):
                raise ValueError(
                    f"MCP tool {spec.name!r}: server {server!r} is a catalogue name, unbound (`bind_servers`)"
                )
            key = server.model_dump_json()
            if key not in connections:
                connections[key] = connection = McpConnection(server)
                await connection.start()
                served[key] = {tool.name: tool for tool in await connection.list_tools()}
            if spec.name not in served[key]:
                raise ValueError(
                    f"MCP server {connections[key].label} serves no tool {spec.name!r}; "
                    f"it serves: {', '.join(sorted(served[key])) or 'nothing'}"
                )
            tools.append(McpTool(connections[key], served[key][spec.name], spec.description))
    except BaseException:
        for connection in connections.values():
            await connection.close()
        raise
    return tools


def _content_text(block: types.ContentBlock) -> str:
    """One content block as the model reads it: text as is, anything else a short mention."""
    if isinstance(block, types.TextContent):
        return block.text
    if isinstance(block, types.ImageContent | types.AudioContent):
        return f"[{block.type}: {block.mime_type}]"
    if isinstance(block, types.ResourceLink):
        return f"[resource link: {block.uri}]"
    if isinstance(block.resource, types.TextResourceContents):
        return block.resource.text
    return f"[resource: {block.resource.uri}]"


def _command(server: McpServerSpec) -> list[str]:
    """A stdio server's command line (a server sets it exactly when it sets no URL)."""
    if server.command is None:
        raise ValueError("an MCP server sets one of command (stdio) and url (streamable HTTP)")
    return server.command


def _reason(exc: BaseException) -> str:
    """A start failure in one line; anyio task groups wrap the cause in exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
