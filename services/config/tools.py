"""The job spec's `tools` section: one model per tool kind, picked by `kind`, and the
operator's catalogue of MCP servers."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, get_args

from pydantic import Field, Tag, model_validator

from services.config.common import PATH_CHARS, TEXT_CHARS, Strict, discriminator, file_field

TOOL_NAME = r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$"
CATALOG_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"


class McpServerSpec(Strict):
    """Where an MCP server is: a command started as a child speaking MCP over stdio, or the
    URL of a streamable-HTTP endpoint. Tools naming the same server share one session."""

    command: list[Annotated[str, Field(max_length=PATH_CHARS)]] | None = Field(
        None, min_length=1, max_length=256, description="stdio: the program and its arguments."
    )
    env: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=PATH_CHARS)]] = Field(
        default_factory=dict, max_length=64, description="stdio: extra environment for the program."
    )
    url: str | None = Field(
        None, pattern=r"^https?://", max_length=PATH_CHARS, description="Streamable HTTP: the endpoint's URL."
    )

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSpec:
        if (self.command is None) == (self.url is None):
            raise ValueError("an MCP server sets exactly one of command (stdio) and url (streamable HTTP)")
        return self


class ToolCatalog(Strict):
    """The operator's tool catalogue (`TANDEM_TOOL_CATALOG`, `services.tool_catalog`)."""

    mcp_servers: dict[str, McpServerSpec] = Field(default_factory=dict, description="Name -> server.")


class ToolBase(Strict):
    """What every tool the policy may call declares: its name, its description and its limits."""

    name: str = Field(pattern=TOOL_NAME, description="What the model calls it.")
    kind: str
    description: str | None = Field(
        None, max_length=TEXT_CHARS, description="Replaces the built-in description shown to the model."
    )
    timeout_s: float = Field(10.0, gt=0, le=3600, description="A call running longer is cut and reported.")
    max_concurrency: int = Field(
        8,
        ge=1,
        le=4096,
        description="Calls of this tool running at once on one rollout server, all episodes "
        "together; a call waits for a free slot.",
    )
    max_calls: int = Field(4, ge=1, le=1024, description="Calls of this tool one episode may make.")

    needs_sandbox: ClassVar[bool] = False
    """Whether its calls run model-written code (the rollout server checks its sandbox first)."""


class CalculatorToolSpec(ToolBase):
    """Arithmetic on an expression (`rollout.tools.calculator`)."""

    kind: Literal["calculator"]


class PythonToolSpec(ToolBase):
    """Model-written Python run in the sandbox (`rollout.tools.python_tool`)."""

    kind: Literal["python"]
    needs_sandbox: ClassVar[bool] = True


class SearchToolSpec(ToolBase):
    """Keyword search over a document collection (`rollout.tools.search`)."""

    kind: Literal["search"]
    data: str | None = file_field(
        None,
        description="JSONL of {id, title, text} documents; the built-in fixture when unset.",
    )
    top_k: int = Field(3, ge=1, le=50, description="Documents returned per query.")


class McpToolSpec(ToolBase):
    """A tool an MCP server serves (`rollout.tools.mcp`)."""

    kind: Literal["mcp"]
    name: str = Field(pattern=TOOL_NAME, description="What the model calls it: the server's name for the tool.")
    server: Annotated[str, Field(pattern=CATALOG_NAME)] | McpServerSpec = Field(
        description="The server that serves this tool, by its name in the operator's tool catalogue "
        "(TANDEM_TOOL_CATALOG); a command or URL written here only where the operator allows "
        "inline servers (TANDEM_ALLOW_INLINE_MCP).",
    )


_TOOL_MODELS = (CalculatorToolSpec, PythonToolSpec, SearchToolSpec, McpToolSpec)
TOOL_KINDS = tuple(get_args(model.model_fields["kind"].annotation)[0] for model in _TOOL_MODELS)
"""Every tool kind, which pydantic puts after the tool's index in an error's location."""

ToolSpec = Annotated[
    Annotated[CalculatorToolSpec, Tag("calculator")]
    | Annotated[PythonToolSpec, Tag("python")]
    | Annotated[SearchToolSpec, Tag("search")]
    | Annotated[McpToolSpec, Tag("mcp")],
    discriminator("kind", "", TOOL_KINDS, "invalid_tool_kind", "kind"),
]
"""One tool the policy may call: the model of the kind `kind` picks ('' when a mapping
leaves `kind` out: an error naming it)."""


class ToolsSpec(Strict):
    """The tools of a job's episodes and how calls are read from the policy's replies."""

    parser: Literal["hermes", "llama3"] = Field(
        "hermes",
        description="hermes: <tool_call>{json}</tool_call> blocks (Qwen, Hermes); llama3: a reply that "
        "is a JSON call object or list (Llama 3.x).",
    )
    tools: list[ToolSpec] = Field(default_factory=list, max_length=64, description="Inline tools.")
    file: str | None = file_field(None, "YAML or JSON file with a `tools:` list, added to the inline ones.")
    max_calls_per_episode: int = Field(8, ge=1, le=4096, description="All tools together, per episode.")
    max_rounds_per_turn: int = Field(
        4, ge=1, le=256, description="Replies with calls in one assistant turn before it must answer."
    )

    @model_validator(mode="after")
    def _some_unique_tools(self) -> ToolsSpec:
        names = [t.name for t in self.tools]
        if len(names) != len(set(names)):
            raise ValueError(f"tool names repeat: {sorted({n for n in names if names.count(n) > 1})}")
        return self
