"""Each process's settings, read from `TANDEM_*` environment variables."""

from __future__ import annotations

import re
from typing import ClassVar

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.config.sections import BudgetSpec

JUDGE_OUTAGE_S = 1800.0
"""How long a job waits out a judge upstream outage by default (`TANDEM_JUDGE_OUTAGE_S`)."""


class _ProcessSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    log_level: str = "INFO"
    redis_outage_s: float = Field(
        30.0, gt=0, description="How long a Redis call waits out an outage (a restart, a network blip) before it fails."
    )
    job_retention_s: float = Field(
        7 * 86400.0, gt=0, description="How long an ended job's records, streams and history stay in Redis."
    )
    pending_ttl_s: float = Field(
        86400.0,
        gt=0,
        description="A job still PENDING this long after it was submitted ends FAILED, expired in the queue "
        "(the API and the learner both expire them; set both alike).",
    )

    SECRETS: ClassVar[frozenset[str]] = frozenset({"tokens", "client_tokens", "judge_token"})

    def loggable(self) -> dict:
        """The settings with secrets masked: bearer tokens, and a password in the Redis URL."""
        shown = self.model_dump()
        for name in self.SECRETS & shown.keys():
            shown[name] = "***" if shown[name] else ""
        shown["redis_url"] = re.sub(r"//([^@/]*)@", "//***@", self.redis_url)
        return shown


def _require_tokens_off_loopback(host: str, tokens: str, variable: str) -> None:
    """Auth fails closed: a server without tokens may listen on loopback only."""
    from services.auth import is_loopback

    if not tokens.strip() and not is_loopback(host):
        raise ValueError(
            f"{variable} is empty, so this server has no auth and may listen only on loopback "
            f"(127.0.0.1, ::1), not {host!r}: set {variable} or a loopback host"
        )


class _ToolSettings(_ProcessSettings):
    """Who may name which tool servers: read by the job API (to refuse a spec) and by rollout
    servers (which start the servers)."""

    tool_catalog: str = Field(
        "",
        description="YAML file of the operator's tool catalogue: `mcp_servers: {name: {command | url, env}}`; "
        "a job's mcp tools name its entries.",
    )
    allow_inline_mcp: bool = Field(
        False,
        description="Let job specs give an MCP server's command or URL themselves (the tenant then runs "
        "programs on rollout servers); URLs must still reach a public address.",
    )


class ApiSettings(_ToolSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1 << 20
    max_spec_bytes: int = Field(
        64 << 10, ge=1024, description="The largest job spec, as stored (JSON bytes), a tenant may submit (413 above)."
    )
    max_pending_jobs: int = Field(
        16, ge=1, description="PENDING jobs one tenant may have queued at once (429 for the next)."
    )
    max_event_streams: int = Field(
        8, ge=1, description="Event streams (`/v1/jobs/{id}/events`) one tenant may hold open at once (429 above)."
    )
    max_tools_file_bytes: int = Field(
        256 << 10, ge=1024, description="The largest `tools.file` the API reads to check a spec (422 above)."
    )
    tokens: str = Field(
        "", description="'token:tenant,...'; empty: no auth, and then the API listens on loopback only (local use)."
    )
    allow_online_tracking: bool = Field(
        False,
        description="Accept jobs whose tracking.wandb.mode is online: the learner then sends their numbers "
        "to W&B with the learner's own key (WANDB_API_KEY).",
    )
    max_judge_weight: float = Field(
        10.0, gt=0, le=1000.0, description="The largest judge_weight a job may ask for (422 above it)."
    )
    tenant_budget_usd: float | None = Field(
        None,
        gt=0,
        description="The most each tenant's jobs' LLM calls may cost in a calendar month (UTC), at the upstreams' "
        "prices; the judge proxy makes no call past it. Set it alike on every API replica. None: no cap.",
    )
    tenant_budget_tokens: int | None = Field(
        None, gt=0, description="The most provider tokens each tenant's jobs may use in a calendar month. None: no cap."
    )
    operators: str = Field(
        "",
        description="Comma-separated tenants allowed the rollout-server routes (list, drain); "
        "without tokens everyone is.",
    )
    path_roots: str = Field(
        "/models",
        description="Comma-separated folders a tenant's job spec may name files under (`file_fields`), "
        "symlinks and '..' resolved; enforced when `tokens` is set. Keep the runs folder "
        "(every job's checkpoints) out of it.",
    )

    @model_validator(mode="after")
    def _auth_or_loopback(self) -> ApiSettings:
        _require_tokens_off_loopback(self.host, self.tokens, "TANDEM_TOKENS")
        return self

    @property
    def tenant_budget(self) -> BudgetSpec:
        """The cap on every tenant's month (`services.bills`)."""
        return BudgetSpec(usd=self.tenant_budget_usd, tokens=self.tenant_budget_tokens)


class _ReplaySettings(_ProcessSettings):
    """How long a taken-over episode can be replayed: read by the judge proxy (its replay
    memory) and by rollout servers (their task journals), so that a journal never outlives
    the simulator and judge replies its turns followed."""

    idempotency_ttl_s: float = Field(
        3600.0,
        ge=0,
        description="How long the judge proxy keeps a reply for a retry with the same Idempotency-Key, and a "
        "rollout server a task's journal (its policy replies and tool results) after the last write; set the "
        "proxy and the rollout servers alike. 0 = off: a taken-over task plays afresh.",
    )


class JudgeProxySettings(_ReplaySettings):
    host: str = "127.0.0.1"
    port: int = 8001
    upstreams: str = Field("", description="YAML/JSON file listing upstreams; empty = none.")
    client_tokens: str = Field(
        "",
        description="Comma-separated tokens; a caller presents one, or a job's credential made with one "
        "(services.auth.job_credential). Empty: no auth, loopback only, and X-Tandem-Job is "
        "believed as sent.",
    )
    queue_deadline_s: float = Field(30.0, gt=0, description="Longest wait for budget before a 429.")
    judge_model: str = Field("judge", min_length=1, description="Model /v1/judge asks when a request names none.")
    default_max_tokens: int = Field(
        1024, ge=1, description="Reserved and sent upstream when a chat request sets no max_tokens."
    )
    max_attempts: int = Field(4, ge=1, le=16, description="Upstream calls per request (failover, 429 retries).")
    max_backoff_s: float = Field(30.0, gt=0, description="Cap on the pause after an upstream 429.")
    failure_cooldown_s: float = Field(
        5.0, ge=0, description="How long a replica avoids an upstream after a 5xx, timeout or refused connection."
    )
    circuit_failures: int = Field(
        5,
        ge=1,
        description="Consecutive failed calls (connection error, timeout, 5xx, 401/403, a reply that is not "
        "JSON), across replicas, that open an upstream's circuit: no call is sent to it until a probe succeeds.",
    )
    rate_limit_outage_s: float = Field(
        60.0,
        gt=0,
        description="An upstream that has answered nothing but 429 for this long is down (an exhausted "
        "quota), and its circuit opens; shorter runs of 429 are pacing. A minute: twice the longest pause "
        "a 429 buys (max_backoff_s), and a job waiting on it shows PAUSED within the minute it is down.",
    )
    circuit_open_s: float = Field(
        10.0, gt=0, description="How long an open circuit sends nothing before one call probes the upstream."
    )
    judge_priority_weight: int = Field(
        3, ge=1, le=100, description="Judge requests admitted per simulator request while both wait."
    )
    cache_ttl_s: float = Field(
        3600.0,
        ge=0,
        description="How long a job's verdicts (and temperature-0 chat replies) are remembered for "
        "identical requests; 0 = no cache.",
    )
    max_reply_bytes: int = Field(
        8 << 20,
        ge=1 << 16,
        description="The most of an upstream's reply (of a stream: of one line or event) the proxy reads; a "
        "reply over it is the upstream's failure, a 502 naming the cap. 8 MiB: a reply of 1,024 tokens with 20 "
        "top logprobs each is about 1.3 MB.",
    )
    max_request_bytes: int = Field(
        8 << 20,
        ge=1 << 10,
        description="The largest request body the proxy reads; a larger one is refused with 413 before the rest "
        "of it is read.",
    )
    job_models: str = Field(
        "",
        description="Comma-separated model groups a call charged to a job (a job's credential, or X-Tandem-Job "
        "without client_tokens) may use; others get 403. Empty: every group this proxy serves. Calls with a "
        "plain client token (the operator's own) may use every group.",
    )

    @model_validator(mode="after")
    def _auth_or_loopback(self) -> JudgeProxySettings:
        _require_tokens_off_loopback(self.host, self.client_tokens, "TANDEM_CLIENT_TOKENS")
        return self


class RolloutSettings(_ToolSettings, _ReplaySettings):
    server_id: str = ""
    metrics_port: int = 8002
    judge_url: str = "http://127.0.0.1:8001"
    judge_token: str = Field("", description="Bearer token for the judge proxy, if it requires one.")
    max_concurrent_tasks: int = Field(16, ge=1)
    max_concurrent_rewards: int = Field(
        128,
        ge=1,
        description="Samples scoring at once (their futures and judge calls). Below max_concurrent_tasks x "
        "group_size it throttles a judge-bound job: at 32, with 32 tasks of 4 in flight, groups "
        "queued here doubled their latency (bench/async_speedup.py).",
    )
    judge_max_connections: int = Field(
        256, ge=1, description="Calls to the judge proxy in flight at once (user simulator and judge together)."
    )
    judge_timeout_s: float = Field(
        120.0, gt=0, description="One call to the judge proxy, its wait for budget and the upstream included."
    )
    judge_max_retries: int = Field(
        2, ge=0, le=100, description="Retries of a call the proxy could not answer (unreachable, 429, 502-504)."
    )
    judge_max_retry_wait_s: float = Field(60.0, gt=0, description="The longest wait before one such retry.")
    judge_outage_s: float = Field(
        JUDGE_OUTAGE_S,
        gt=0,
        description="The learner's judge_outage_s (set both alike): a call waits a minute longer than this "
        "while the proxy says every upstream of its model is down, so the learner names the outage as "
        "the job's reason before any task fails.",
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE).")
    memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM's gpu_memory_utilization (on CPU: share of RAM); default 0.85 on GPU, 0.3 on CPU. "
        "Lower it to share one GPU with the learner.",
    )
    heartbeat_s: float = Field(2.0, gt=0)
    task_reclaim_idle_s: float = Field(15.0, gt=0, description="Take over tasks another server left idle this long.")
    drain_timeout_s: float = Field(
        120.0,
        ge=0,
        description="A draining server (SIGTERM, `tandem drain`) finishes its tasks for at most this long, "
        "then hands the rest back to the other servers (their journals keep the turns played).",
    )
    engine_stall_s: float = Field(
        300.0,
        gt=0,
        description="A vLLM engine that produces nothing this long with requests in flight is wedged: the "
        "server exits with status 1 (its supervisor starts a new one) and its tasks are reclaimed. Long, "
        "because a big model's prefill on a busy GPU is not a wedge; `/healthz` says degraded at half.",
    )


class LearnerSettings(_ProcessSettings):
    metrics_port: int = 8003
    runs_dir: str = "runs"
    history_keep: int = Field(
        10_000,
        ge=100,
        description="Step records a job keeps in Redis (its history endpoint), newest first; the "
        "run folder's metrics.jsonl keeps them all.",
    )
    keep_checkpoints: int = Field(
        3,
        ge=1,
        description="Complete checkpoints kept per job, newest first; older ones are deleted once a "
        "newer one is complete (a job resumes from the newest).",
    )
    weight_bucket_mib: int = Field(512, ge=1)
    weight_timeout_s: float = Field(120.0, gt=0)
    min_rollout_servers: int = Field(1, ge=0, description="0: train on whatever arrives (tests, replays).")
    rollout_wait_s: float = Field(600.0, gt=0)
    collective_timeout_s: float = Field(1800.0, gt=0)
    advertise_host: str = Field("127.0.0.1", description="Address rollout servers reach us at.")
    weight_store_port: int = Field(0, ge=0, description="Rendezvous port; 0 picks a free one.")
    server_timeout_s: float = Field(10.0, gt=0, description="Heartbeat age that drops a server.")
    judge_outage_s: float = Field(
        JUDGE_OUTAGE_S,
        gt=0,
        description="How long a job stays PAUSED waiting on a judge or simulator model whose every "
        "upstream is down before it fails with the proxy's reason.",
    )
    resume: bool = Field(False, description="Continue RUNNING jobs from their last checkpoint.")
    lease_ttl_s: float = Field(
        30.0,
        ge=1.0,
        description="How long a learner's hold on its job lasts unless renewed (every third of it, at most "
        "every 5 s): another learner takes a job over this long after its learner died or froze.",
    )
    max_crashes_per_step: int = Field(
        3,
        ge=1,
        description="A job whose learner died this many times at the same step (no step completed between) "
        "ends FAILED with the last exit reason instead of resuming again; a SIGTERM stop is no crash.",
    )
