"""The operator's tool catalogue: which MCP servers a job may use; and a job's own tools
file (`tools.file`), read into its spec (`with_file_tools`).

A tenant must not choose what a rollout server starts or where it connects: an MCP server
given in a job spec as a command runs with the rollout server's user (its files, its
secrets), and one given as a URL reaches whatever the rollout server can (internal ports,
cloud metadata). So a job's mcp tool names a server from this catalogue, a YAML file the
operator mounts (`TANDEM_TOOL_CATALOG`):

    mcp_servers:
      fetch: {command: [uvx, mcp-server-fetch]}
      docs: {url: "https://docs.example.com/mcp"}

Servers written into the spec itself are refused unless the operator sets
`TANDEM_ALLOW_INLINE_MCP`, and even then a URL must resolve to public addresses only.
The job API checks a spec against its catalogue (422 naming the field); each rollout
server binds the names against its own when it opens a job's tools, so a spec that reached
Redis some other way gets no further.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import ValidationError

from services.config import McpToolSpec, ToolCatalog, ToolsSpec


class CatalogError(ValueError):
    """A tool the catalogue does not allow; `index` is its place in the tools list."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


def load_catalog(path: str) -> ToolCatalog:
    """The catalogue in the YAML file at `path`; an empty one for "". ValueError naming the
    file when it cannot be read or is not a catalogue (a process refuses to start on it)."""
    if not path:
        return ToolCatalog()
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        return ToolCatalog.model_validate(loaded)
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise ValueError(f"tool catalogue {path!r}: {exc}") from exc


def bind_servers(tools: ToolsSpec, catalog: ToolCatalog, allow_inline: bool) -> ToolsSpec:
    """`tools` with each mcp tool's catalogue name replaced by the server it names.
    CatalogError for a name the catalogue lacks or an inline server the operator did not allow."""
    bound = tools.model_copy(deep=True)
    for index, tool in enumerate(bound.tools):
        if not isinstance(tool, McpToolSpec):
            continue
        if isinstance(tool.server, str):
            if tool.server not in catalog.mcp_servers:
                known = ", ".join(sorted(catalog.mcp_servers)) or "none"
                raise CatalogError(
                    index, f"no MCP server {tool.server!r} in the operator's tool catalogue (it has: {known})"
                )
            tool.server = catalog.mcp_servers[tool.server]
        elif not allow_inline:
            raise CatalogError(
                index,
                "MCP servers are named from the operator's tool catalogue; a command or "
                "URL in a job spec needs TANDEM_ALLOW_INLINE_MCP on the server",
            )
    return bound


def inline_urls(tools: ToolsSpec) -> list[str]:
    """The URLs of MCP servers written into the spec itself (not catalogue names)."""
    return [
        t.server.url
        for t in tools.tools
        if isinstance(t, McpToolSpec) and not isinstance(t.server, str) and t.server.url
    ]


def check_public_url(url: str) -> None:
    """ValueError unless every address `url`'s host resolves to is a public one (not
    loopback, private, link-local such as cloud metadata, or reserved). For inline servers
    only: a catalogue entry is the operator's and may point anywhere."""
    host = urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"MCP server {url}: cannot resolve {host!r}: {exc}") from None
    for *_, sockaddr in infos:
        if not isinstance(sockaddr[0], str):  # an IPv6 address from a Python built without IPv6
            raise ValueError(f"MCP server {url}: {host!r} resolves to an address this Python cannot read")
        address = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        if not address.is_global:
            raise ValueError(f"MCP server {url}: {host!r} resolves to {address}, which is not a public address")


def with_file_tools(spec: ToolsSpec) -> ToolsSpec:
    """`spec` with the tools of its `tools.file` added and checked, as a rollout server uses
    it; ValueError naming `tools.file` for a file that is missing or invalid."""
    if spec.file is None:
        return spec
    import yaml

    try:
        with open(spec.file, encoding="utf-8") as text:
            loaded = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"tools.file {spec.file!r}: {exc}") from exc
    if not isinstance(loaded, dict) or not isinstance(loaded.get("tools"), list):
        raise ValueError(f"tools.file {spec.file!r}: expected a mapping with a `tools:` list")
    try:
        return ToolsSpec.model_validate(
            spec.model_dump() | {"file": None, "tools": [*spec.model_dump()["tools"], *loaded["tools"]]}
        )
    except ValueError as exc:
        raise ValueError(f"tools.file {spec.file!r}: {exc}") from exc
