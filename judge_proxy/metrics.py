"""The judge proxy's Prometheus metrics (DESIGN.md, Metrics). Labels are bounded: upstream
names come from the config, priorities and kinds from fixed sets."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Summary

BUDGET_TPM = Gauge("tandem_judge_budget_tokens_per_minute", "Configured token budget", ["upstream"])
BUDGET_RPM = Gauge("tandem_judge_budget_requests_per_minute", "Configured request budget", ["upstream"])
BUDGET_UTILIZATION = Gauge(
    "tandem_judge_budget_utilization",
    "Tokens all replicas used over the last minute, as a share of the upstream's tokens per minute",
    ["upstream"],
)
TOKENS = Counter(
    "tandem_judge_tokens_total",
    "Tokens per upstream: reserved at admission, actual (usage.total_tokens), refunded "
    "(reserved - actual when positive), charged (actual - reserved when positive)",
    ["upstream", "kind"],
)
REQUESTS = Counter(
    "tandem_judge_upstream_requests_total",
    "Calls made upstream by outcome (ok, rate_limited, client_error, auth_error, server_error, timeout, connect_error)",
    ["upstream", "outcome"],
)
UPSTREAM_429 = Counter("tandem_judge_upstream_429_total", "429 answers received from an upstream", ["upstream"])
REJECTED = Counter("tandem_judge_rejected_total", "429 answers returned to clients", ["priority"])
QUEUE_WAIT = Histogram(
    "tandem_judge_queue_wait_seconds",
    "Time from arrival to admission (0 when budget was free)",
    ["priority"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
UPSTREAM_LATENCY = Histogram(
    "tandem_judge_upstream_latency_seconds",
    "Duration of one upstream call",
    ["upstream"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
# Negative buckets: prometheus_client then exports _bucket and _count but no _sum, so the
# mean error comes from the summary beside it.
RECONCILIATION_ERROR = Histogram(
    "tandem_judge_reconciliation_error_tokens",
    "Reserved estimate minus usage.total_tokens",
    ["upstream"],
    buckets=(-4096, -1024, -256, -64, -16, 0, 16, 64, 256, 1024, 4096, 16384),
)
RECONCILIATION_MEAN = Summary(
    "tandem_judge_reconciliation_tokens", "Reserved estimate minus usage.total_tokens, for its mean", ["upstream"]
)
VERDICTS = Counter(
    "tandem_judge_verdicts_total",
    "Judge verdicts by outcome (parsed, parsed_on_retry, unparseable)",
    ["rubric", "outcome"],
)
STREAMS = Counter(
    "tandem_judge_streams_total",
    "Streamed replies by how they ended: complete ([DONE] with usage), cut (the upstream's stream broke off), "
    "client_closed (the client left); a stream not complete settles all it reserved",
    ["upstream", "outcome"],
)
PROMPT_RATIO = Gauge(
    "tandem_judge_prompt_token_ratio",
    "Learned prompt tokens the upstream counts per locally estimated one (reservations scale by it)",
    ["upstream"],
)
PROMPT_OUTLIERS = Gauge(
    "tandem_judge_prompt_outliers",
    "Calls whose counted/estimated prompt ratio lay outside the upstream's band, so taught the learned ratio "
    "nothing (all replicas)",
    ["upstream"],
)
USAGE_OUTLIERS = Gauge(
    "tandem_judge_usage_outliers",
    "Replies whose usage.total_tokens was more than their request could cost (its prompt at the ratio band's top "
    "and every completion at max_tokens), so were charged that instead (all replicas)",
    ["upstream"],
)
MEMORY = Counter(
    "tandem_judge_memory_total",
    "Requests the proxy could answer from memory, by kind (cache: identical temperature-0 request; replay: same "
    "idempotency key) and result (hit, miss)",
    ["job", "kind", "result"],
)
GROUP_CANDIDATES = Counter(
    "tandem_judge_group_candidates_total",
    "Candidates of group verdict requests by how each was answered: cached, duplicate (of another in the group), "
    "group (in the group call), alone (the only one left to judge), fallback (judged alone after an unusable "
    "group verdict)",
    ["rubric", "outcome"],
)
GROUP_FALLBACKS = Counter(
    "tandem_judge_group_fallbacks_total",
    "Group verdicts that could not be used, by reason (no_list, missing, duplicate, out_of_range, "
    "unknown_candidate, unparseable): their candidates were judged one by one",
    ["rubric", "reason"],
)
JOB_TOKENS = Counter(
    "tandem_judge_job_tokens_total",
    "Tokens upstreams charged (usage.total_tokens), per job and priority",
    ["job", "priority"],
)
JOB_SHARE = Gauge(
    "tandem_judge_job_share",
    "The job's target share of a model group's budget, its judge_weight over the active jobs' (updated when "
    "this replica reserves for the job)",
    ["model", "job"],
)
SHARE_WAITS = Counter(
    "tandem_judge_share_waits_total",
    "Requests held back by their job's share of a model group's budget (counted once per request)",
    ["model", "job"],
)
UPSTREAM_STATE = Gauge(
    "tandem_judge_upstream_state",
    "The upstream's circuit as this replica last saw it: 0 closed, 1 half_open (a probe is out), 2 open (no call "
    "is sent)",
    ["upstream"],
)
MODEL_AVAILABLE = Gauge(
    "tandem_judge_model_available",
    "1 while some upstream of the model has its circuit closed, 0 when every one is open or half-open",
    ["model"],
)
