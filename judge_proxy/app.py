"""The judge proxy: every LLM call of the system goes through here."""

from __future__ import annotations

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from services.config import JudgeProxySettings
from services.metrics import metrics_router


def create_app(settings: JudgeProxySettings) -> FastAPI:
    app = FastAPI(title="Tandem judge proxy", version="0.1.0")
    app.state.settings = settings
    app.include_router(metrics_router())

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        raise HTTPException(404, "no upstream configured")

    return app
