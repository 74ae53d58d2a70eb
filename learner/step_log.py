"""What each learner step leaves behind: its record and the job's Prometheus metrics.

A step's record is one JSON object, appended to the run's `metrics.jsonl` (all of them) and
to the job's `history` list in Redis (the newest `history_keep`; the API's history endpoint
and the health rules read it); its
numbers also set the learner's gauges. The health rules are judged on the records here,
since they need the last few of them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram

from learner import health
from learner.group_log import reward_sources
from learner.tracking import Trackers
from services import jobs, protocol
from services.config import HealthRule
from services.queues import Keys
from services.stats import TrailingRate, mean_by_key

log = logging.getLogger(__name__)

STEP = Gauge("tandem_learner_step", "Learner steps done", ["job"])
VERSION = Gauge("tandem_learner_version", "Policy version", ["job"])
REWARD = Gauge("tandem_learner_reward_mean", "Mean reward of the last batch", ["job"])
STEP_GAUGES = {  # record key -> gauge of the last step's value
    "loss": Gauge("tandem_learner_loss", "Policy loss of the last step", ["job"]),
    "sft_loss": Gauge("tandem_learner_sft_loss", "Warm-start (SFT) loss of the last step", ["job"]),
    "grad_norm": Gauge("tandem_learner_grad_norm", "Gradient norm before clipping", ["job"]),
    "entropy": Gauge("tandem_learner_entropy", "Mean policy entropy on trained tokens", ["job"]),
    "mismatch_kl": Gauge("tandem_learner_mismatch_kl", "KL(behaviour || proximal), k3, per token", ["job"]),
    "kl_ref": Gauge(
        "tandem_learner_kl_ref", "KL to the reference policy per token (behaviour-weighted estimate)", ["job"]
    ),
    "clip_fraction": Gauge("tandem_learner_clip_fraction", "Share of tokens where the PPO clip bites", ["job"]),
    "is_weight_mean": Gauge("tandem_learner_importance_weight_mean", "Mean behaviour importance weight", ["job"]),
    "is_weight_max": Gauge("tandem_learner_importance_weight_max", "Largest behaviour importance weight", ["job"]),
    "is_masked_fraction": Gauge("tandem_learner_importance_masked_fraction", "Share of tokens masked by MIS", ["job"]),
    "success": Gauge("tandem_learner_task_success", "Task success in the last batch", ["job"]),
    "zero_spread_share": Gauge(
        "tandem_learner_zero_spread_group_share",
        "Share of the last batch's groups whose advantages are all 0 (trained on nothing)",
        ["job"],
    ),
    "is_capped_tokens": Gauge(
        "tandem_learner_importance_capped_tokens",
        "Trained tokens of the last step whose importance weight the cap C set",
        ["job"],
    ),
    "futures_malformed": Gauge(
        "tandem_learner_futures_malformed_share",
        "Share of MR futures a later policy turn left malformed, last batch",
        ["job"],
    ),
    "judge_tokens_per_trained_token": Gauge(
        "tandem_learner_judge_tokens_per_trained_token",
        "Judge (verdict) tokens the provider charged for the last batch, per token it trained",
        ["job"],
    ),
    "llm_tokens_per_trained_token": Gauge(
        "tandem_learner_llm_tokens_per_trained_token",
        "Judge and user-simulator tokens the provider charged for the last batch, per token it trained",
        ["job"],
    ),
    "trained_vs_generated_length_ratio": Gauge(
        "tandem_learner_trained_vs_generated_length_ratio",
        "Mean sequence length of the trained samples over that of every finished one, job so far",
        ["job"],
    ),
    "asked_share_trained": Gauge(
        "tandem_learner_asked_share_trained", "Share of trained first turns that ask, job so far", ["job"]
    ),
    "asked_share_generated": Gauge(
        "tandem_learner_asked_share_generated",
        "Share of finished first turns (trained or refused) that ask, job so far",
        ["job"],
    ),
    "wasted_llm_tokens": Gauge(
        "tandem_learner_wasted_llm_tokens",
        "Judge and user-simulator tokens paid for groups the learner refused (over-stale, duplicate), job so far",
        ["job"],
    ),
    "llm_tokens_per_trained_sample": Gauge(
        "tandem_learner_llm_tokens_per_trained_sample",
        "Judge and user-simulator tokens of every finished group per sample trained, job so far",
        ["job"],
    ),
    "futures": Gauge(
        "tandem_learner_futures_per_turn", "Mean futures sampled per scored response, last batch", ["job"]
    ),
    "futures_max": Gauge(
        "tandem_learner_futures_per_turn_max", "Most futures one response of the last batch got", ["job"]
    ),
    "preference_accuracy": Gauge(
        "tandem_learner_preference_accuracy",
        "DPO: share of the last step's pairs the policy prefers as labelled",
        ["job"],
    ),
    "reward_margin": Gauge(
        "tandem_learner_dpo_reward_margin", "DPO: mean implicit reward of chosen minus rejected, last step", ["job"]
    ),
    "pairs": Gauge("tandem_learner_dpo_pairs", "DPO: preference pairs the last step trained", ["job"]),
    "judge_budget_left": Gauge(
        "tandem_learner_judge_budget_left", "Share of the judge budget left as the last batch's calls saw it", ["job"]
    ),
    "skipped_updates": Gauge(
        "tandem_learner_skipped_updates",
        "Optimizer updates of the last step skipped for an exactly zero gradient",
        ["job"],
    ),
    "nonfinite_updates": Gauge(
        "tandem_learner_nonfinite_updates",
        "Optimizer updates of the last step skipped for a NaN or infinite loss or gradient",
        ["job"],
    ),
}
MALFORMED = Gauge(
    "tandem_learner_malformed_share",
    "Share of the last batch's trained responses the format filter rejected, by reason",
    ["job", "reason"],
)
TRAINED_TOKENS = Counter("tandem_learner_trained_tokens_total", "Tokens trained on", ["job"])
STALENESS = Histogram(
    "tandem_learner_staleness", "Staleness of trained groups (versions)", ["job"], buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32)
)
STEP_SECONDS = Histogram(
    "tandem_learner_step_seconds",
    "Wall time of a training step",
    ["job"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
IDLE_RATIO = Gauge(
    "tandem_learner_idle_ratio", "Share of the last minute the learner spent waiting for a batch of groups", ["job"]
)
WAIT_SECONDS = Histogram(
    "tandem_learner_batch_wait_seconds",
    "Time waiting for a batch of groups",
    ["job"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
QUEUE_DEPTH = Gauge("tandem_queue_depth", "Entries in a job stream not yet read", ["job", "stream"])
PENDING = Gauge("tandem_queue_pending", "Entries read but not acknowledged", ["job", "stream"])
DEAD = Gauge("tandem_queue_dead_letters", "Entries in the job's dead stream", ["job"])
HEALTH_ALERTS = Counter(
    "tandem_learner_health_alerts_total", "Health rules that fired, by metric and action", ["job", "metric", "action"]
)


class JobUnhealthy(Exception):
    """A health rule with action `stop` fired; the message says which and why."""


def rl_record(
    step: int,
    version: int,
    groups: list[protocol.TrajectoryGroup],
    step_metrics: dict,
    step_seconds: float,
    sync_seconds: float,
    waited: dict,
    counts: dict,
) -> dict:
    """The record of RL step `step`, which trained `groups` and published `version`: what
    the batch was (rewards, staleness, sizes, tasks), what the step measured, the wait for
    the batch, the job's running counts and what it trained against what was finished
    (`learner.mix`)."""
    samples = [s for g in groups for s in g.samples]
    oldest = [v for v in (g.min_version() for g in groups) if v is not None]
    staleness = [version - 1 - v for v in oldest]
    return {
        "phase": "rl",
        "step": step,
        "version": version,
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "staleness_mean": sum(staleness) / max(len(staleness), 1),
        "staleness_max": max(staleness, default=0),
        "groups": len(groups),
        "samples": len(samples),
        "trained_tokens": sum(sum(s.mask) for s in samples),
        "zero_spread_share": sum(not g.has_spread() for g in groups) / len(groups),
        "untrained_groups": sum(not any(1 in s.mask for s in g.samples) for g in groups),
        "task_ids": sorted(g.task_id for g in groups),
        "unversioned_tokens": sum(1 for s in samples for v, m in zip(s.versions, s.mask) if m and v < 0),
        "step_seconds": step_seconds,
        "sync_seconds": sync_seconds,
        "rollout_seconds_mean": sum(g.elapsed_s for g in groups) / len(groups),
        "staleness_counts": {str(v): staleness.count(v) for v in sorted(set(staleness))},
        **waited,
        **mean_by_key([s.metrics for s in samples]),
        **llm_spend(samples),
        **step_metrics,
        **counts,
        **reward_sources(samples),
    }


def llm_spend(samples: list[protocol.Sample]) -> dict[str, float]:
    """What the batch's judge and user-simulator calls cost: tokens the provider charged in
    all and per trained token, and the most futures one response took (their mean is the
    samples' `futures`)."""
    if not any("llm_calls" in s.metrics for s in samples):
        return {}
    judge = sum(s.metrics.get("judge_tokens", 0.0) for s in samples)
    simulator = sum(s.metrics.get("simulator_tokens", 0.0) for s in samples)
    trained = max(sum(sum(s.mask) for s in samples), 1)
    spend = {
        "judge_tokens_step": judge,
        "llm_tokens_step": judge + simulator,
        "judge_tokens_per_trained_token": judge / trained,
        "llm_tokens_per_trained_token": (judge + simulator) / trained,
    }
    futures = [s.metrics["futures"] for s in samples if "futures" in s.metrics]
    if futures:
        spend["futures_max"] = max(futures)
    return spend


def keep_lines(path: Path, count: int) -> None:
    """Cut the file at `path`, if there is one, after its first `count` lines."""
    if not path.exists():
        return
    with open(path, "r+b") as f:
        for _ in range(count):
            if not f.readline():
                return
        f.truncate()


class StepLog:
    """One job's step records (file, Redis history, gauges), its idle-time accounting and
    its health rules."""

    def __init__(
        self,
        client: aioredis.Redis,
        job_id: str,
        run_dir: Path,
        rules: list[HealthRule],
        keep: int = 10_000,
        trackers: Trackers | None = None,
    ) -> None:
        self.redis = client
        self.trackers = trackers or Trackers(None, run_dir, job_id, {})
        """The experiment trackers every record also goes to (`learner.tracking`)."""
        self.job_id = job_id
        self.path = run_dir / "metrics.jsonl"
        self.rules = rules
        self.keep = max(keep, 2 * health.history_needed(rules))
        """Records Redis keeps (the health rules read the last few); the file keeps all."""
        self.rl_started = time.monotonic()
        """When this run of the job began RL steps (after the first weight publish)."""
        self.waited_s = 0.0
        """Seconds since `rl_started` spent waiting for batches: the learner's idle time."""
        self.idle_rate = TrailingRate(window_s=60.0)

    # ---- the history ---------------------------------------------------------------

    async def length(self) -> int:
        """Records in the job's whole history (Redis keeps only the newest)."""
        return await jobs.history_length(self.redis, self.job_id)

    async def trim(self, length: int) -> None:
        """Keep the first `length` history records, in Redis and in `metrics.jsonl`: those a
        checkpoint covers, so that the steps a resumed run trains again are recorded once.
        The file's lines are the same records in the same order (`write` appends to both,
        the file first), and all of them are whole before a checkpoint is written."""
        await jobs.trim_history(self.redis, self.job_id, length)
        await asyncio.to_thread(keep_lines, self.path, length)

    async def append(self, record: dict) -> None:
        """The record, stamped, at the end of `metrics.jsonl` and of the job's history."""
        record["time"] = time.time()
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        await jobs.append_history(self.redis, self.job_id, json.dumps(record), self.keep)

    async def write(self, record: dict, step: int, version: int) -> None:
        await self.append(record)
        await jobs.record_progress(self.redis, self.job_id, step, version, record)
        self.export_gauges(record, step, version)
        await self.export_queue_gauges()
        await self.track(record)

    async def write_eval(self, record: dict, conversations: list[dict] | None = None) -> None:
        """A held-out evaluation's record, into the file and the history beside the steps
        (the job's step and latest step metrics stay the training step's); some of its
        conversations go to the trackers' table."""
        await self.append(record)
        await self.track(record, (record["step"], conversations) if conversations else None)

    async def track(self, record: dict, conversations: tuple[int, list[dict]] | None = None) -> None:
        """The record (and a held-out round's conversations) to the trackers; a tracker that
        failed is named in the job's alerts."""
        self.trackers.log(record)
        if conversations is not None:
            self.trackers.conversations(*conversations)
        for message in self.trackers.take_failures():
            await jobs.add_alert(self.redis, self.job_id, message)

    # ---- idle time -----------------------------------------------------------------

    def start_rl(self) -> None:
        self.rl_started = time.monotonic()

    def waited(self, wait_s: float) -> dict[str, float]:
        """Count a wait of `wait_s` for a batch; the step's wait and the learner's idle
        share since RL began (for the record) and over the last minute (the gauge)."""
        WAIT_SECONDS.labels(self.job_id).observe(wait_s)
        self.waited_s += wait_s
        now = time.monotonic()
        IDLE_RATIO.labels(self.job_id).set(self.idle_rate.add(now, self.waited_s))
        rl_seconds = now - self.rl_started
        return {
            "batch_wait_seconds": wait_s,
            "rl_seconds": rl_seconds,
            "idle_ratio": self.waited_s / rl_seconds if rl_seconds > 0 else 0.0,
        }

    def observe_step(self, record: dict) -> None:
        """The step's histograms and counters, from its record (gauges follow from the
        record when it is written)."""
        for staleness, count in record["staleness_counts"].items():
            for _ in range(count):
                STALENESS.labels(self.job_id).observe(int(staleness))
        TRAINED_TOKENS.labels(self.job_id).inc(record["trained_tokens"])
        STEP_SECONDS.labels(self.job_id).observe(record["step_seconds"])

    # ---- health --------------------------------------------------------------------

    async def judge_health(self, record: dict) -> list[health.Alert]:
        """The job's health rules that fire at this step, also listed in its record."""
        if not self.rules:
            return []
        # Held-out records sit between the steps, at most one after each: twice the RL records read.
        raw = await self.redis.lrange(Keys.history(self.job_id), 1 - 2 * health.history_needed(self.rules), -1)
        recent = [r for r in map(json.loads, raw) if r.get("phase") == "rl"] + [record]
        fired = health.alerts(self.rules, recent)
        if fired:
            record["health"] = [alert.message for alert in fired]
        return fired

    async def act_on(self, fired: list[health.Alert]) -> None:
        """Warnings go to the log, the job's alerts and a counter; a `stop` ends the job."""
        for alert in fired:
            log.warning("job %s: %s", self.job_id, alert.message)
            HEALTH_ALERTS.labels(self.job_id, alert.rule.metric, alert.rule.action).inc()
            await jobs.add_alert(self.redis, self.job_id, alert.message)
        stops = [alert.message for alert in fired if alert.stops]
        if stops:
            raise JobUnhealthy("; ".join(stops))

    # ---- Prometheus ----------------------------------------------------------------

    def export_gauges(self, record: dict, step: int, version: int) -> None:
        STEP.labels(self.job_id).set(step)
        VERSION.labels(self.job_id).set(version)
        if "reward_mean" in record:
            REWARD.labels(self.job_id).set(record["reward_mean"])
        for name, gauge in STEP_GAUGES.items():
            if name in record:
                gauge.labels(self.job_id).set(record[name])
        for name, value in record.items():
            if name.startswith("malformed_"):
                MALFORMED.labels(self.job_id, name.removeprefix("malformed_")).set(value)

    async def export_queue_gauges(self) -> None:
        for name, stream, group in (
            ("tasks", Keys.tasks(self.job_id), "rollout"),
            ("trajectories", Keys.trajectories(self.job_id), "learner"),
        ):
            if not await self.redis.exists(stream):
                continue
            for info in await self.redis.xinfo_groups(stream):
                if info["name"].decode() == group:
                    QUEUE_DEPTH.labels(self.job_id, name).set(info.get("lag") or 0)
                    PENDING.labels(self.job_id, name).set(info["pending"])
        DEAD.labels(self.job_id).set(await self.redis.xlen(Keys.dead(self.job_id)))
