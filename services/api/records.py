"""What a job wrote, read back for its owner: its history, checkpoints, datasets, the
servers that took part, its held-out conversations and its training groups."""

from __future__ import annotations

import json
from typing import Literal

import msgspec
from fastapi import APIRouter, Depends, Query, Request, Response

from services import jobs, protocol
from services.api.access import owned
from services.api.models import ERRORS, Checkpoint, Dataset, HeldOutConversation, Membership
from services.queues import FIELD, GROUPS_KEPT, Keys
from services.redis_values import text


def job_records_router() -> APIRouter:
    """What a job recorded: history, checkpoints, datasets, rollout-server membership."""
    router = APIRouter()

    @router.get("/v1/jobs/{job_id}/history", response_model=list[dict], responses=ERRORS)
    async def history(
        request: Request, response: Response, start: int = Query(0, ge=0), record: dict = Depends(owned)
    ) -> list[dict]:
        """The step records from index `start` of the whole history on. Redis keeps a job's
        newest `TANDEM_HISTORY_KEEP` records (the learner's run folder keeps all), so the
        first one returned may come later: `X-Tandem-History-Start` gives its index."""
        first, raw = await jobs.read_history(request.app.state.redis, record["id"], start)
        response.headers["x-tandem-history-start"] = str(first)
        return [json.loads(r) for r in raw]

    @router.get("/v1/jobs/{job_id}/checkpoints", response_model=list[Checkpoint], responses=ERRORS)
    async def checkpoints(request: Request, record: dict = Depends(owned)) -> list[Checkpoint]:
        raw = await request.app.state.redis.lrange(Keys.checkpoints(record["id"]), 0, -1)
        return [Checkpoint(**json.loads(r)) for r in raw]

    @router.get("/v1/jobs/{job_id}/datasets", response_model=list[Dataset], responses=ERRORS)
    async def datasets(request: Request, record: dict = Depends(owned)) -> list[Dataset]:
        """The files a generate job wrote: `sft` (a warm start's data) and `pairs` (an
        offline job's train.data); none for other kinds."""
        raw = await request.app.state.redis.hgetall(Keys.datasets(record["id"]))
        return [Dataset(name=text(name), **json.loads(value)) for name, value in sorted(raw.items())]

    @router.get("/v1/jobs/{job_id}/servers", response_model=list[Membership], responses=ERRORS)
    async def servers(request: Request, record: dict = Depends(owned)) -> list[Membership]:
        """Every change in the rollout servers on the job: who joined, who left and why."""
        raw = await request.app.state.redis.lrange(Keys.servers(record["id"]), 0, -1)
        return [Membership(**json.loads(r)) for r in raw]

    return router


def conversations_router() -> APIRouter:
    """What a job's conversations were: its held-out rounds and its recent training groups."""
    router = APIRouter()

    @router.get("/v1/jobs/{job_id}/conversations", response_model=list[HeldOutConversation], responses=ERRORS)
    async def conversations(
        request: Request,
        step: int | None = Query(None, ge=0, description="The round (its step); the newest when left out."),
        order: Literal["example", "lowest", "highest"] = Query("example", description="By example, or by success."),
        only: Literal["all", "malformed", "asked", "not_asked"] = Query("all"),
        limit: int = Query(100, ge=1, le=1000),
        record: dict = Depends(owned),
    ) -> list[HeldOutConversation]:
        """The conversations of one held-out round (`eval` in the spec): what the policy said,
        what the user answered, and how each was scored."""
        found = await held_out_conversations(request.app.state.redis, record["id"], step)
        found = [c for c in found if METRIC_FILTERS[only](c.metrics)]
        if order != "example":
            found.sort(key=lambda c: (c.metrics.get("success", 0.0), c.example, c.trial), reverse=order == "highest")
        return found[:limit]

    @router.get("/v1/jobs/{job_id}/groups", response_model=list[dict], responses=ERRORS)
    async def groups(
        request: Request,
        response: Response,
        version: int | None = Query(None, ge=0, description="Only groups whose newest tokens are of this version."),
        order: Literal["recent", "lowest", "highest"] = Query(
            "recent", description="Newest first, or by the group's lowest (highest) response reward."
        ),
        only: Literal["all", "malformed", "asked", "not_asked"] = Query("all"),
        limit: int = Query(50, ge=1, le=GROUPS_KEPT),
        record: dict = Depends(owned),
    ) -> list[dict]:
        """Recent training groups as text (`protocol.GroupView`, about the newest
        `GROUPS_KEPT`): the context, each response with its reward, advantage and the parts
        of R*, and each response's futures with the judge's verdict. `X-Tandem-Group-Versions`
        lists the versions the recorded groups came from, newest first (what `version` takes)."""
        found = await training_groups(request.app.state.redis, record["id"])
        versions = sorted({g.versions[-1] for g in found if g.versions}, reverse=True)
        response.headers["x-tandem-group-versions"] = ",".join(map(str, versions))
        if version is not None:
            found = [g for g in found if g.versions and g.versions[-1] == version]
        found = [g for g in found if GROUP_FILTERS[only](g)]
        if order != "recent":
            found.sort(key=lambda g: min(r.reward for r in g.responses), reverse=order == "highest")
        return [msgspec.to_builtins(g) for g in found[:limit]]

    return router


RESULTS_PAGE = 1000
"""Held-out results read per round trip."""


async def held_out_conversations(client, job_id: str, step: int | None) -> list[HeldOutConversation]:
    """The held-out round `step`'s conversations (the newest round's when None), by example
    and trial; a result played twice counts once, one that does not decode is skipped."""
    by_round: dict[int, dict[tuple[int, int], HeldOutConversation]] = {}
    cursor = "-"
    while entries := await client.xrange(Keys.eval_results(job_id), min=cursor, count=RESULTS_PAGE):
        for _, fields in entries:
            try:
                result = protocol.decode(fields.get(FIELD, b""), protocol.EvalResult)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                continue
            if step is None or result.round == step:
                by_round.setdefault(result.round, {})[(result.example, result.trial)] = HeldOutConversation(
                    round=result.round,
                    example=result.example,
                    trial=result.trial,
                    server_id=result.server_id,
                    metrics=result.metrics,
                    versions=result.versions,
                    seconds=result.elapsed_s,
                    conversation=result.conversation,
                )
        cursor = "(" + text(entries[-1][0])
    if not by_round:
        return []
    chosen = by_round[step if step is not None else max(by_round)]
    return [chosen[key] for key in sorted(chosen)]


METRIC_FILTERS = {
    "all": lambda metrics: True,
    "malformed": lambda metrics: metrics.get("well_formed", 1.0) < 1.0,
    "asked": lambda metrics: metrics.get("asked", 0.0) > 0.0,
    "not_asked": lambda metrics: metrics.get("asked", 0.0) == 0.0,
}
"""Which held-out conversations `GET /v1/jobs/{id}/conversations?only=` keeps, by their metrics."""


def asked(view: protocol.GroupView) -> bool:
    return any(r.metrics.get("asked", 0.0) > 0.0 for r in view.responses)


GROUP_FILTERS = {
    "all": lambda view: True,
    "malformed": lambda view: any(r.malformed or any(f.malformed for f in r.futures) for r in view.responses),
    "asked": asked,
    "not_asked": lambda view: not asked(view),
}
"""Which groups `GET /v1/jobs/{id}/groups?only=` keeps: `malformed` has a malformed response
or future; `asked` has a response whose conversations asked the user (clarify's `asked`),
`not_asked` none."""


async def training_groups(client, job_id: str) -> list[protocol.GroupView]:
    """The job's recorded training groups, newest first; an entry that does not decode as a
    view is skipped (the stream is capped, so this reads at most about `GROUPS_KEPT`)."""
    views = []
    for _, fields in await client.xrevrange(Keys.groups(job_id), count=GROUPS_KEPT + 100):
        try:
            views.append(protocol.decode(fields.get(FIELD, b""), protocol.GroupView))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            continue
    return views
