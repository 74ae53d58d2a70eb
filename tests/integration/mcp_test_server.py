"""A small MCP server for the MCP tool tests, built on the SDK's `MCPServer`.

    python mcp_test_server.py              # MCP over stdin/stdout
    python mcp_test_server.py --http PORT  # streamable HTTP at http://127.0.0.1:PORT/mcp

Tools: `add(a, b)` answers the sum as text, `echo(text)` answers its text, `slow(seconds)`
sleeps first, `fail()` always answers an error result (isError) the client must surface,
`tick()` answers how many calls of it this server has had (a tool whose answer changes).
"""

from __future__ import annotations

import argparse

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("tandem-test-tools", log_level="WARNING")


@server.tool(description="Add two integers.")
def add(a: int, b: int) -> str:
    return str(a + b)


@server.tool(description="Answer the given text unchanged.")
def echo(text: str) -> str:
    return text


@server.tool(description="Sleep for the given number of seconds, then say so.")
async def slow(seconds: float) -> str:
    await anyio.sleep(seconds)
    return f"slept {seconds}s"


@server.tool(description="Always fail with an error the caller should read.")
def fail() -> str:
    raise ToolError("this tool always fails")


ticks = 0


@server.tool(description="Count this call: answers how many calls of tick this server has had.")
def tick() -> str:
    global ticks
    ticks += 1
    return f"tick {ticks}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=int, metavar="PORT", help="Serve streamable HTTP on this loopback port.")
    args = parser.parse_args()
    if args.http is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
