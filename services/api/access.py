"""Who is calling the job API and what it may touch: bearer tokens to tenants, a tenant's
own jobs (403 for another's), and the operators, who alone reach the fleet routes."""

from __future__ import annotations

from fastapi import Depends, HTTPException, Request

from services import jobs
from services.auth import match_bearer
from services.queues import Keys


def parse_tokens(spec: str) -> dict[str, str]:
    """'token:tenant,token2:tenant2' -> {token: tenant}."""
    pairs = [item.strip().split(":", 1) for item in spec.split(",") if item.strip()]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise ValueError("TANDEM_TOKENS must look like 'token:tenant,token2:tenant2'")
    return {token: tenant for token, tenant in pairs}


def tenant(request: Request) -> str:
    """The caller's tenant, from its bearer token ("" when the API has no tokens)."""
    tokens: dict[str, str] = request.app.state.tokens
    if not tokens:
        return ""
    token = match_bearer(request.headers.get("authorization", ""), tokens)
    if token is None:
        raise HTTPException(401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})
    return tokens[token]


async def expire_own(request: Request, who: str) -> None:
    """End the caller's jobs that have waited in the queue past `pending_ttl_s`, so that
    what it reads and its quota say so even while no learner looks at the queue."""
    settings = request.app.state.settings
    await jobs.expire_pending(request.app.state.redis, [who], settings.pending_ttl_s, settings.job_retention_s)


async def owned(request: Request, job_id: str, who: str = Depends(tenant)) -> dict:
    """The job's record, if it exists (404) and belongs to the caller (403)."""
    await expire_own(request, who)
    client = request.app.state.redis
    record = await jobs.get_job(client, job_id) if jobs.is_job_id(job_id) else None
    if record is None and jobs.is_job_id(job_id) and await client.zscore(Keys.jobs_index, job_id) is not None:
        raise HTTPException(
            404, f"job {job_id!r} ended and its record was deleted after its retention (TANDEM_JOB_RETENTION_S)"
        )
    if record is None:
        raise HTTPException(404, f"no job {job_id!r}")
    if record.get("tenant", "") != who:
        raise HTTPException(403, f"job {job_id!r} belongs to another tenant")
    return record


async def operator(request: Request, who: str = Depends(tenant)) -> str:
    """The caller, if it may act on the fleet: anyone without tokens, else `operators` (403)."""
    if request.app.state.tokens and who not in request.app.state.operators:
        raise HTTPException(403, f"tenant {who!r} is not an operator (TANDEM_OPERATORS)")
    return who
