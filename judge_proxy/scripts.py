"""The judge proxy's Redis scripts, kept as Lua files in `judge_proxy/lua/`
(`services.redis_scripts`): a script is its own file after the library files whose
functions it calls (`now`: the server's clock; `common`: what both limit models share;
`bucket`, `window`: each limit model's state)."""

from __future__ import annotations

from services import redis_scripts


def lua(*names: str) -> str:
    """The files `judge_proxy/lua/<name>.lua`, in order, as one script."""
    return redis_scripts.lua("judge_proxy", *names)


NOW_S_LUA = lua("now")
"""`now_s()`: seconds on the Redis server's clock, which every replica's scripts share."""
