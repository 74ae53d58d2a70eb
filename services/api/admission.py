"""What a submitted job spec must pass before the job API stores it, each refusal a 4xx
naming the field: files only under the operator's path roots (symlinks and '..' resolved),
tools the operator's catalogue allows, a judge weight, online tracking and a size within the
operator's caps, a pairs file that parses, and a tenant's month not spent. `docs/security.md`
says why each is there."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError

from services import bills, preference
from services.config import ApiSettings, JobSpec, ToolCatalog, ToolsSpec, file_fields
from services.tool_catalog import CatalogError, bind_servers, with_file_tools


def confine_paths(spec: JobSpec, roots: list[Path]) -> JobSpec:
    """`spec` with each field naming a file (`file_fields`: the model's, the task's, the
    tools' and their data files, ...) resolved, symlinks and '..' followed, as this process
    sees the files; a 422 naming every field that resolves outside `roots`. The resolved
    paths are what the job keeps, so the learner and rollout servers open what was checked,
    whatever their working directory."""
    confined, errors = spec.model_copy(deep=True), []
    for loc, owner, name in list(file_fields(confined)):
        inside = confine(getattr(owner, name), roots)
        if inside is not None:
            setattr(owner, name, inside)
        else:
            errors.append(outside_error(getattr(owner, name), roots, ("body", *loc)))
    if errors:
        raise RequestValidationError(errors)
    return confined


def check_tools(spec: JobSpec, settings: ApiSettings, catalog: ToolCatalog, roots: list[Path] | None) -> JobSpec:
    """`spec`, or a 422 naming the field: a tools file that is here and does not hold valid
    tools, an MCP server the operator's catalogue does not allow, a data file of the tools
    file's outside `roots` (None: not confined; the spec's own files are confined before,
    `confine_paths`). A tools file this process cannot see is left to the rollout servers,
    which fail the job with the same messages (the API may run on another machine)."""
    if spec.tools is None:
        return spec
    num_inline = len(spec.tools.tools)
    tools = spec.tools
    if tools.file is not None and Path(tools.file).is_file():
        tools = _resolved_tools(tools, tools.file, settings.max_tools_file_bytes)
        for loc, owner, name in file_fields(tools):
            match loc:
                case ("tools", int(index), *_) if roots is not None and index >= num_inline:
                    confined_path(
                        getattr(owner, name),
                        roots,
                        ("body", "tools", "file"),
                        f"tool {index - num_inline} of the file: {name} ",
                    )
    try:
        bind_servers(tools, catalog, settings.allow_inline_mcp)
    except CatalogError as exc:
        loc = ("body", "tools", "tools", exc.index, "server") if exc.index < num_inline else ("body", "tools", "file")
        raise RequestValidationError([{"type": "value_error", "loc": loc, "msg": str(exc)}]) from None
    return spec


def _resolved_tools(tools: ToolsSpec, file: str, max_bytes: int) -> ToolsSpec:
    """`tools` with those of its tools file (`file`, its `tools.file`) added, or a 422 naming
    `tools.file`: a file over `max_bytes` is not read (a large file is no tools file, and
    parsing it is slow)."""
    try:
        size_bytes = Path(file).stat().st_size
        if size_bytes > max_bytes:
            raise ValueError(
                f"tools.file is {size_bytes} bytes; a tools file is at most {max_bytes} (TANDEM_MAX_TOOLS_FILE_BYTES)"
            )
        return with_file_tools(tools)
    except (OSError, ValueError) as exc:
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("body", "tools", "file"), "input": file, "msg": str(exc)}]
        ) from None


def confined_path(path: str, roots: list[Path], loc: tuple, what: str = "") -> str:
    """`path` resolved under `roots`, or a 422 at `loc`."""
    inside = confine(path, roots)
    if inside is None:
        raise RequestValidationError([outside_error(path, roots, loc, what)])
    return inside


def confine(path: str, roots: list[Path]) -> str | None:
    """`path` with symlinks and '..' resolved, if that lies under one of `roots`; else None."""
    resolved = resolve(path)
    if resolved is None or not any(resolved.is_relative_to(root) for root in roots):
        return None
    return str(resolved)


def outside_error(path: str, roots: list[Path], loc: tuple, what: str = "") -> dict:
    return {
        "type": "value_error",
        "loc": loc,
        "input": path,
        "msg": f"{what}must lie under {', '.join(map(str, roots))} (symlinks and '..' resolved)",
    }


def check_judge_weight(spec: JobSpec, settings: ApiSettings) -> None:
    """A 422 naming `judge_weight` above the operator's cap: a tenant does not choose a larger
    share of the shared judge budget than the operator allows."""
    if spec.judge_weight > settings.max_judge_weight:
        raise RequestValidationError(
            [
                {
                    "type": "less_than_equal",
                    "loc": ("body", "judge_weight"),
                    "input": spec.judge_weight,
                    "msg": f"must be at most {settings.max_judge_weight:g} on this server",
                }
            ]
        )


def check_tracking(spec: JobSpec, settings: ApiSettings) -> None:
    """A 422 naming `tracking.wandb.mode` for an online run the operator does not allow: the
    learner would send a tenant's numbers out under the operator's key."""
    wandb = spec.tracking.wandb if spec.tracking is not None else None
    if wandb is not None and wandb.mode == "online" and not settings.allow_online_tracking:
        raise RequestValidationError(
            [
                {
                    "type": "value_error",
                    "loc": ("body", "tracking", "wandb", "mode"),
                    "input": "online",
                    "msg": "online tracking is off on this server (TANDEM_ALLOW_ONLINE_TRACKING): use offline",
                }
            ]
        )


def check_spec_size(spec: JobSpec, settings: ApiSettings) -> None:
    """A 413 for a spec whose stored form (its JSON) is over `max_spec_bytes`."""
    size_bytes = len(spec.model_dump_json().encode())
    if size_bytes > settings.max_spec_bytes:
        raise HTTPException(
            413, f"the job spec is {size_bytes} bytes; at most {settings.max_spec_bytes} (TANDEM_MAX_SPEC_BYTES)"
        )


def check_pairs_file(spec: JobSpec) -> None:
    """A 422 naming `train.data` when an offline job's pairs file is here and a row of it is
    not a pair (the message names the line). As for tools, a file this process cannot see
    is checked by the learner, which fails the job with the same message."""
    if not spec.train.data or not Path(spec.train.data).is_file():  # only an offline job sets it
        return
    try:
        for _ in preference.read_pairs(spec.train.data, max_pair_tokens=spec.train.max_tokens_per_rank):
            pass  # every row checked; none kept
    except ValueError as exc:
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("body", "train", "data"), "input": spec.train.data, "msg": str(exc)}]
        ) from None


def resolve(path: str) -> Path | None:
    """The absolute path with symlinks followed; None for a name no file can have (a NUL
    byte, an unencodable character) or a symlink loop."""
    try:
        return Path(path).resolve()
    except (OSError, ValueError, RuntimeError):
        return None


async def admitted(spec: JobSpec, request: Request) -> JobSpec:
    """`spec` as the API stores it, once every check of a submission passed (4xx naming the
    field otherwise): paths confined, judge weight, size, tools and pairs files."""
    settings = request.app.state.settings
    # Without tokens the API listens on loopback only: it is the operator's own (local use).
    roots = request.app.state.path_roots if request.app.state.tokens else None
    if roots is not None:
        spec = confine_paths(spec, roots)
    check_judge_weight(spec, settings)
    check_tracking(spec, settings)
    check_spec_size(spec, settings)
    # Files are read on a thread: a slow read or parse does not stall other requests.
    spec = await asyncio.to_thread(check_tools, spec, settings, request.app.state.tool_catalog, roots)
    await asyncio.to_thread(check_pairs_file, spec)
    return spec


async def month_not_spent(request: Request, who: str) -> None:
    """402 while the tenant's month has reached the operator's cap (`services.bills`): no
    call of a new job could be made before the month ends."""
    month = await bills.month(request.app.state.redis, who, request.app.state.settings.tenant_budget)
    if month.exhausted:
        raise HTTPException(
            402,
            f"tenant {who!r} has spent its cap for {month.period} (${month.spent['usd']:.4f} and "
            f"{month.spent['tokens']} tokens of {month.cap.limits}): no call of a new job could be made "
            "before the month ends (TANDEM_TENANT_BUDGET_USD, TANDEM_TENANT_BUDGET_TOKENS)",
        )
