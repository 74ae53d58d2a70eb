"""Redis scripts kept as Lua files, `<package>/lua/<name>.lua`: a script Redis runs is its
own file after the library files whose functions it calls, put together here as one text."""

from __future__ import annotations

from functools import cache
from importlib.resources import files


@cache
def lua(package: str, *names: str) -> str:
    """The files `<package>/lua/<name>.lua`, in order, as one script."""
    return "".join((files(package) / "lua" / f"{name}.lua").read_text(encoding="utf-8") for name in names)
