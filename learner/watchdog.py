"""A job's progress, watched while rank 0 waits for groups: the job goes on, is PAUSED with
a reason, or fails with one; it never waits in silence.

Progress is a trained step or an admitted group. At the idle turns of the wait (at most
once a second) the watchdog looks at what the job depends on:
- A live rollout server says its episodes wait on a judge outage (the proxy answered that
  every upstream of a model is down: `ServerInfo.waiting_on`) and nothing progressed for
  `PAUSE_AFTER_S`; or no rollout server is on the job at all. The job is PAUSED with that
  reason, and goes back to RUNNING once nothing is waited on. A pause longer than its bound
  (`judge_outage_s`, `rollout_wait_s`) fails the job with the reason.
- Of the last `dead_window` tasks to end, more than `train.max_dead_share` went to the dead
  stream: a systematic failure no retry fixes (every verdict unparseable, NaN weights). The
  job fails with the newest reasons, long before the stall bound.
- No progress for `train.stall_timeout_s`, paused time aside: the job fails, naming what
  the system saw meanwhile (task failures, dead letters, servers).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import Gauge

from learner.dispatcher import Dispatcher
from learner.publisher import WeightPublisher
from learner.step_log import JobUnhealthy
from services import jobs
from services.config import JobSpec, LearnerSettings
from services.queues import Keys
from services.redis_values import raw

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0
"""The watchdog looks at most this often (each look reads the fleet and the job's record)."""
PAUSE_AFTER_S = 5.0
"""How long a wait must hold the job without progress before it pauses it: a call waiting
out an outage while other groups still arrive is no pause."""
SINCE_PROGRESS = Gauge(
    "tandem_learner_seconds_since_progress",
    "Seconds since the job's last step or admitted group (paused time included)",
    ["job"],
)
PAUSED = Gauge("tandem_learner_job_paused", "1 while the job is PAUSED waiting on something outside it", ["job"])


class JobStalled(JobUnhealthy):
    """The job cannot go on; the message, the job's reason, says what the learner saw."""


def dead_window(batch_size: int) -> int:
    """How many of the latest tasks to end the dead-letter budget is judged on: two
    batches, and at least 8, so that a few bad examples in a small job are not a verdict."""
    return max(8, 2 * batch_size)


@dataclass
class Pause:
    reason: str
    since: float
    """The watchdog's clock (monotonic) when the pause began."""
    bound_s: float
    bound: str
    """The setting that bounds it, named in the failure."""


class Watchdog:
    def __init__(
        self,
        redis: aioredis.Redis,
        job_id: str,
        spec: JobSpec,
        settings: LearnerSettings,
        publisher: WeightPublisher,
        dispatcher: Dispatcher,
        progress: Callable[[], tuple[int, ...]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.job_id = job_id
        self.train = spec.train
        self.settings = settings
        self.publisher = publisher
        self.dispatcher = dispatcher
        self.progress = progress
        """(steps trained, groups admitted, any other count): moves whenever the job progresses."""
        self.clock = clock
        self.marker: tuple[int, ...] = (0, 0)
        self.progress_at = clock()
        self.checked: float | None = None
        """When the watchdog last looked (None: not yet)."""
        self.pause: Pause | None = None
        self.outcomes: deque[bool] = deque(maxlen=dead_window(self.train.batch_size))
        """Whether each of the latest tasks to end went to the dead stream, oldest first."""
        self.counted = (0, 0)
        """(groups admitted, tasks dead-lettered) already in `outcomes`."""

    def condition(self) -> dict:
        """For `/healthz`: ok, or degraded with why (paused, or half the stall bound gone)."""
        if self.pause is not None:
            return {"status": "degraded", "reason": f"paused: {self.pause.reason}"}
        if self.checked is None:  # not waiting for groups yet (warm start, first publish)
            return {"status": "ok"}
        idle_s = self.clock() - self.progress_at
        if idle_s > self.train.stall_timeout_s / 2:
            return {"status": "degraded", "reason": f"no progress for {idle_s:.0f}s"}
        return {"status": "ok"}

    async def check(self) -> None:
        """One look (a no-op within `CHECK_EVERY_S` of the last): pause, resume, or raise
        `JobStalled`."""
        now = self.clock()
        if self.checked is None:  # the first look: the clock starts with the first wait for groups
            self.progress_at = now
        elif now - self.checked < CHECK_EVERY_S:
            return
        self.checked = now
        self.note_progress(now)
        await self.judge_dead_share()
        waiting = await self.waiting_on()
        if waiting is not None:
            await self.hold(*waiting)
        elif self.pause is not None:
            await self.release(self.pause)
        elif now - self.progress_at > self.train.stall_timeout_s:
            raise JobStalled(await self.explain(now - self.progress_at))
        SINCE_PROGRESS.labels(self.job_id).set(now - self.progress_at)
        PAUSED.labels(self.job_id).set(self.pause is not None)

    def note_progress(self, now: float) -> None:
        marker = self.progress()
        if marker != self.marker:
            self.marker, self.progress_at = marker, now
        admitted, dead = marker[1], self.dispatcher.dead_lettered
        self.outcomes.extend([False] * (admitted - self.counted[0]) + [True] * (dead - self.counted[1]))
        self.counted = (admitted, dead)

    async def judge_dead_share(self) -> None:
        """Fail when more than `max_dead_share` of the latest tasks to end were dead-lettered."""
        window = self.outcomes.maxlen
        dead = sum(self.outcomes)
        if len(self.outcomes) == window and dead > self.train.max_dead_share * window:
            raise JobStalled(
                f"{dead} of the last {window} tasks to end went to the dead stream "
                f"(train.max_dead_share {self.train.max_dead_share}): {await self.newest_failures()}"
            )

    async def waiting_on(self) -> tuple[str, float, str] | None:
        """What the job waits on, its bound and the bound's name; None when nothing."""
        await self.publisher.live_servers()
        servers = self.publisher.live
        waits = [info for info in servers if info.waiting_on]
        if waits and self.clock() - self.progress_at >= PAUSE_AFTER_S:
            first = min(waits, key=lambda info: info.waiting_since)
            return first.waiting_on, self.settings.judge_outage_s, "judge_outage_s"
        if not servers and self.settings.min_rollout_servers > 0:
            return "no rollout server is on the job", self.settings.rollout_wait_s, "rollout_wait_s"
        return None

    async def hold(self, reason: str, bound_s: float, bound: str) -> None:
        """PAUSED with `reason` (the newest one, if it changed); fails past the bound."""
        now = self.clock()
        if self.pause is None:
            log.warning("job %s paused: %s", self.job_id, reason)
            self.pause = Pause(reason, now, bound_s, bound)
            await jobs.pause(self.redis, self.job_id, reason)
        elif reason != self.pause.reason:
            self.pause.reason, self.pause.bound_s, self.pause.bound = reason, bound_s, bound
            await jobs.pause(self.redis, self.job_id, reason)
        if now - self.pause.since > self.pause.bound_s:
            raise JobStalled(f"paused for {now - self.pause.since:.0f}s, past {bound}={bound_s:.0f}s: {reason}")

    async def release(self, pause: Pause) -> None:
        """What the job waited on (`pause`) is back: RUNNING again, and the stall clock starts anew."""
        log.info("job %s resumed after %.0fs paused", self.job_id, self.clock() - pause.since)
        self.pause = None
        self.progress_at = self.clock()
        await jobs.set_status(self.redis, self.job_id, jobs.JobStatus.RUNNING)

    async def explain(self, idle_s: float) -> str:
        """Why the job stopped progressing, as far as the system can tell."""
        servers = len(await self.publisher.live_servers())
        return (
            f"no step and no admitted group for {idle_s:.0f}s (train.stall_timeout_s="
            f"{self.train.stall_timeout_s:.0f}); {servers} rollout server(s) on the job; "
            f"{await self.newest_failures(since_s=idle_s)}"
        )

    async def newest_failures(self, since_s: float | None = None) -> str:
        """How many tasks failed and were dead-lettered (in the last `since_s`, or ever), and
        the newest reason of each."""
        start = "-" if since_s is None else str(int((time.time() - since_s) * 1000))
        parts = []
        for key, what, field in (
            (Keys.task_errors(self.job_id), "task failures on rollout servers", b"error"),
            (Keys.dead(self.job_id), "entries dead-lettered", b"reason"),
        ):
            entries = await self.redis.xrange(key, min=start, count=10_000)
            newest = entries[-1][1] if entries else None
            if entries and newest is not None:
                where = raw(newest.get(b"server", newest.get(b"consumer", b""))).decode(errors="replace")
                reason = raw(newest[field]).decode(errors="replace")
                parts.append(f"{len(entries)} {what}, the newest ({where}): {reason}")
        rollout_error = await self.redis.hget(Keys.job(self.job_id), "rollout_error")
        if rollout_error:
            parts.append(f"a rollout server cannot serve the job: {raw(rollout_error).decode(errors='replace')}")
        return "; ".join(parts) or "no task failed and nothing was dead-lettered"
