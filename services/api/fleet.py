"""The rollout-server routes: the shared fleet listed, and a server drained or let back in
(operators only)."""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, HTTPException, Request

from services import protocol
from services.api.access import operator
from services.api.models import ERRORS, RolloutServerView
from services.queues import Keys
from services.redis_values import text

FORGET_SERVER_S = 3600.0
"""A server record this old is a dead server's (a live one rewrites it every few seconds):
the fleet listing deletes it."""


def servers_router() -> APIRouter:
    """The fleet routes: list rollout servers, drain one, lift a drain."""
    router = APIRouter(dependencies=[Depends(operator)])

    async def server_views(client: aioredis.Redis) -> dict[str, RolloutServerView]:
        drained = {text(member) for member in await client.smembers(Keys.rollout_drain)}
        now, views = time.time(), {}
        infos, _ = protocol.decode_fleet(await client.hgetall(Keys.rollout_servers))
        for info in infos:
            if now - info.heartbeat > FORGET_SERVER_S:  # a live server rewrites it every few seconds
                await client.hdel(Keys.rollout_servers, info.server_id)
                continue
            views[info.server_id] = RolloutServerView(
                server_id=info.server_id,
                job_id=info.job_id,
                version=info.version,
                capacity=info.capacity,
                inflight=info.inflight,
                engine=info.engine,
                heartbeat_age_s=round(now - info.heartbeat, 1),
                draining=info.draining,
                drain_requested=info.server_id in drained,
            )
        return views

    @router.get("/v1/rollout-servers", response_model=list[RolloutServerView], responses=ERRORS)
    async def list_servers(request: Request) -> list[RolloutServerView]:
        """Every rollout server that has reported (a stopped one leaves; a killed one stays,
        its heartbeat ageing, for FORGET_SERVER_S)."""
        views = await server_views(request.app.state.redis)
        return [views[server] for server in sorted(views)]

    @router.post("/v1/rollout-servers/{server_id}/drain", response_model=RolloutServerView, responses=ERRORS)
    async def drain(request: Request, server_id: str) -> RolloutServerView:
        """The server finishes its tasks (handing back what is left after its drain timeout),
        leaves its job and takes no job until the drain is lifted."""
        return await set_drain(request.app.state.redis, server_id, True)

    @router.delete("/v1/rollout-servers/{server_id}/drain", response_model=RolloutServerView, responses=ERRORS)
    async def lift_drain(request: Request, server_id: str) -> RolloutServerView:
        """The server takes jobs again."""
        return await set_drain(request.app.state.redis, server_id, False)

    async def set_drain(client: aioredis.Redis, server_id: str, drained: bool) -> RolloutServerView:
        if server_id not in await server_views(client):
            raise HTTPException(404, f"no rollout server {server_id!r}")
        await (client.sadd if drained else client.srem)(Keys.rollout_drain, server_id)
        return (await server_views(client))[server_id]

    return router
