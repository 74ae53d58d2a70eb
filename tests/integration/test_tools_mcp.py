"""MCP tools against a real MCP server (`mcp_test_server.py`): a child over stdio, and a
separate process over streamable HTTP on a free loopback port."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import wait_for

from rollout.tools.base import ToolError
from rollout.tools.mcp import McpConnection, open_tools
from services.config import McpServerSpec, McpToolSpec
from tandem.redis_embed import free_port

SERVER = Path(__file__).with_name("mcp_test_server.py")
STDIO = McpServerSpec(command=[sys.executable, str(SERVER)])


def mcp_spec(name: str, server: McpServerSpec = STDIO, **fields) -> McpToolSpec:
    return McpToolSpec(name=name, kind="mcp", server=server, **fields)


def server_children() -> list[psutil.Process]:
    """Our live child processes running the test server."""
    return [
        child
        for child in psutil.Process().children(recursive=True)
        if child.is_running() and str(SERVER) in " ".join(child.cmdline())
    ]


@pytest.fixture
def http_server():
    """The test server speaking streamable HTTP as its own process; its endpoint's URL."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port)])

    def accepting() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    try:
        wait_for(accepting, timeout_s=20, what="the MCP test server's HTTP port")
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.kill()
        process.wait()


async def test_a_stdio_server_s_tools_are_listed_with_their_parameters_and_answer_calls():
    add, echo = await open_tools([mcp_spec("add"), mcp_spec("echo", description="Say it back.")])

    assert add.schema()["type"] == "function"
    assert add.schema()["function"]["name"] == "add"
    assert add.schema()["function"]["description"] == "Add two integers."
    parameters = add.schema()["function"]["parameters"]
    assert parameters["type"] == "object"
    assert {name: p["type"] for name, p in parameters["properties"].items()} == {"a": "integer", "b": "integer"}
    assert sorted(parameters["required"]) == ["a", "b"]
    assert echo.schema()["function"]["description"] == "Say it back."
    assert await add.call({"a": 2, "b": 3}) == "5"
    assert await echo.call({"text": "über 100%"}) == "über 100%"
    await add.close()
    await echo.close()


async def test_an_error_result_raises_tool_error_carrying_the_server_s_text():
    [fail] = await open_tools([mcp_spec("fail")])
    try:
        with pytest.raises(ToolError, match="this tool always fails"):
            await fail.call({})
    finally:
        await fail.close()


async def test_a_tool_the_server_does_not_serve_is_a_value_error_naming_it_and_what_is_served():
    with pytest.raises(ValueError, match=r"serves no tool 'multiply'; it serves: add, echo, fail, slow, tick"):
        await open_tools([mcp_spec("add"), mcp_spec("multiply")])

    assert server_children() == []


async def test_tools_of_one_server_share_one_child_which_stops_when_the_last_tool_closes():
    add, echo = await open_tools([mcp_spec("add"), mcp_spec("echo")])
    [child] = server_children()
    assert add.connection is echo.connection

    await add.close()
    assert await echo.call({"text": "still here"}) == "still here"
    await echo.close()

    assert not child.is_running()


async def test_calls_run_concurrently_and_a_cancelled_call_leaves_the_session_usable():
    slow, add = await open_tools([mcp_spec("slow"), mcp_spec("add")])
    try:
        started = time.monotonic()
        replies = await asyncio.gather(*(slow.call({"seconds": 0.5}) for _ in range(4)))
        assert replies == ["slept 0.5s"] * 4
        assert time.monotonic() - started < 1.5

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(slow.call({"seconds": 5}), timeout=0.2)
        assert await add.call({"a": -1, "b": 1}) == "0"
    finally:
        await slow.close()
        await add.close()


async def test_a_server_that_cannot_start_is_named_in_the_error():
    with pytest.raises(RuntimeError, match="MCP server no-such-mcp-server did not start: FileNotFoundError"):
        await open_tools([mcp_spec("add", McpServerSpec(command=["no-such-mcp-server"]))])


async def test_a_server_that_never_answers_the_handshake_times_out_and_its_child_is_stopped():
    silent = McpConnection(
        McpServerSpec(command=[sys.executable, "-c", "import time; time.sleep(60)"]), start_timeout_s=0.5
    )
    with pytest.raises(RuntimeError, match="did not start: TimeoutError: no completed handshake within 0.5s"):
        await silent.start()

    assert [c for c in psutil.Process().children(recursive=True) if "time.sleep(60)" in " ".join(c.cmdline())] == []


async def test_a_streamable_http_server_s_tools_are_listed_and_answer_calls(http_server):
    server = McpServerSpec(url=http_server)
    add, fail = await open_tools([mcp_spec("add", server), mcp_spec("fail", server)])
    try:
        assert set(add.schema()["function"]["parameters"]["properties"]) == {"a", "b"}
        assert await add.call({"a": 2, "b": 3}) == "5"
        with pytest.raises(ToolError, match="this tool always fails"):
            await fail.call({})
    finally:
        await add.close()
        await fail.close()
