"""A job's page, served by the API: `/jobs/{id}` in a browser.

The page is three static files (`static/`: HTML, script, style) with no job data in them and
nothing fetched from elsewhere; its script reads the job's record, history and held-out
conversations from the `/v1` routes with the caller's token, so the data stays behind the
same tokens as the API. The token comes in the address's fragment (`/jobs/ID#token=...`,
which a browser never sends to a server), is kept in the tab's session storage and taken out
of the address. Everything the page shows is put in as text, never as markup: conversations
are model-written, and the Content-Security-Policy lets only the page's own script run.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC = Path(__file__).parent / "static"
FILES = {"job.js": "text/javascript", "job.css": "text/css"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def page_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/jobs/{job_id}")
    async def page(job_id: str) -> FileResponse:
        """The page; which job it shows, its script reads from the address."""
        return FileResponse(STATIC / "job.html", media_type="text/html", headers=HEADERS)

    @router.get("/jobs/static/{name}")
    async def asset(name: str) -> FileResponse:
        if name not in FILES:
            raise HTTPException(404, f"no file {name!r}")
        return FileResponse(STATIC / name, media_type=FILES[name], headers=HEADERS)

    return router
