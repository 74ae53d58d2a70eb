"""The judge proxy's Redis scripts, kept as Lua files in `judge_proxy/lua/`: a script Redis
runs is its own file after the library files whose functions it calls (`now`: the server's
clock; `common`: what both limit models share; `bucket`, `window`: each limit model's
state), put together here as one text."""

from __future__ import annotations

from functools import cache
from importlib.resources import files


@cache
def lua(*names: str) -> str:
    """The files `judge_proxy/lua/<name>.lua`, in order, as one script."""
    return "".join((files("judge_proxy") / "lua" / f"{name}.lua").read_text(encoding="utf-8") for name in names)


NOW_S_LUA = lua("now")
"""`now_s()`: seconds on the Redis server's clock, which every replica's scripts share."""
