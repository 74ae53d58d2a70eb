"""The job API's request and response models (its OpenAPI schema)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services import bills, jobs
from services.config import BudgetSpec, JobSpec


class JobView(BaseModel):
    id: str
    name: str
    status: jobs.JobStatus
    created: float
    started: float | None = None
    finished: float | None = None
    version: int = Field(0, description="Policy version (learner steps published).")
    step: int = 0
    error: str | None = None
    paused_reason: str | None = Field(None, description="PAUSED: what the job waits on, as the learner sees it.")
    paused_since: float | None = None
    warning: str | None = Field(
        None, description="RUNNING or PAUSED, but nothing moves it: its learner has gone silent, and why."
    )
    metrics: dict = Field(default_factory=dict, description="The latest step's metrics.")
    alerts: list[str] = Field(default_factory=list, description="Health rules that fired, oldest first.")
    held_out: dict = Field(
        default_factory=dict,
        description="The latest held-out evaluation (job spec `eval`): its step, success and the task's metrics; "
        "empty before the first.",
    )
    spend: dict = Field(
        default_factory=dict,
        description="What its LLM calls cost so far, as the judge proxy charged them: usd, tokens, cached, calls, "
        "and by_role (simulator, judge, extraction, eval); only on GET /v1/jobs/{id}.",
    )
    resumes: int = Field(0, description="Times the job was resumed after it ended (`POST /v1/jobs/{id}/resume`).")
    resumed_from: str | None = Field(None, description="The status the job had when it was last resumed.")
    resumed_error: str | None = Field(None, description="The error it had then, if any.")
    spec: JobSpec


class ResumeRequest(BaseModel):
    """What may change when an ended job is resumed."""

    model_config = ConfigDict(extra="forbid")

    budget: BudgetSpec | None = Field(
        None, description="New caps on what its LLM calls cost (a raised cap for a job a cap ended); kept when unset."
    )


class TenantSpend(bills.BillView):
    """What a tenant's jobs' LLM calls cost this calendar month (UTC), as the judge proxy
    charged them, and the operator's cap on it (`TANDEM_TENANT_BUDGET_USD`, `..._TOKENS`)."""

    period: str = Field(description="The month, `2026-11`.")
    cap: BudgetSpec


class HeldOutConversation(BaseModel):
    """One conversation of a held-out round, as a rollout server played and scored it."""

    round: int = Field(description="The step (policy version) whose round it belongs to.")
    example: int
    trial: int
    server_id: str
    metrics: dict[str, float] = Field(description="success, tokens, turns, well_formed, the task's metrics, judge.")
    versions: list[int] = Field(description="The oldest and newest weight version behind its tokens.")
    seconds: float
    conversation: list[dict[str, str]] = Field(description="role and content of each message, as played.")


class JobCreated(BaseModel):
    id: str
    status: jobs.JobStatus


class Checkpoint(BaseModel):
    step: int
    version: int
    path: str
    time: float


class Dataset(BaseModel):
    """A file a generate job wrote (it grows while the job runs)."""

    name: str
    path: str
    rows: int
    description: str


class Error(BaseModel):
    detail: str


class RolloutServerView(BaseModel):
    server_id: str
    job_id: str = Field(description='The job it serves ("" when idle).')
    version: int = Field(description="Weight version it serves; -1 before its first update.")
    capacity: int
    inflight: int
    engine: str = Field(description="The model its engine has loaded.")
    heartbeat_age_s: float
    draining: bool = Field(description="Leaving its job (SIGTERM or a drain request).")
    drain_requested: bool = Field(description="Asked to drain through this API; idles until the request is lifted.")


class Membership(BaseModel):
    """A change in the rollout servers on a job, as the learner saw it."""

    time: float
    servers: list[str]
    joined: list[str]
    left: dict[str, str] = Field(
        description="Server -> why: draining, exited (after a drain or a stop), or no heartbeat for N s."
    )


ERRORS: dict[int | str, dict[str, Any]] = {401: {"model": Error}, 403: {"model": Error}, 404: {"model": Error}}
