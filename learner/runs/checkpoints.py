"""A training job's checkpoints as its run keeps them (RL and offline jobs): when the next
periodic one is due, each one written listed on the job's record with the oldest pruned,
and on resume the newest one that loads."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import redis.asyncio as aioredis

from learner import checkpoint
from learner.control import Command, CommandFailed, GroupBroken, Worker, rank_errors_dir
from services import jobs
from services.config import LearnerSettings, TrainSpec
from services.queues import Keys

log = logging.getLogger(__name__)


def checkpoint_due(step: int, since_s: float, every_steps: int, every_s: float) -> bool:
    """Whether a run that has just trained `step`, `since_s` seconds after its last
    checkpoint, writes a periodic one: every `every_steps` steps or once `every_s` seconds
    have passed, whichever comes first (0 turns either off)."""
    return (every_steps > 0 and step % every_steps == 0) or (every_s > 0 and since_s >= every_s)


class Checkpoints:
    """One job's checkpoints under `runs/<job>/checkpoints`, written and loaded by every rank."""

    def __init__(
        self, client: aioredis.Redis, worker: Worker, settings: LearnerSettings, job_id: str, train: TrainSpec
    ) -> None:
        self.redis = client
        self.worker = worker
        self.settings = settings
        self.job_id = job_id
        self.train = train
        self.written_s = time.monotonic()
        """When the last one was written (or the run began): the clock of `train.checkpoint_every_s`."""

    @property
    def periodic(self) -> bool:
        """Whether checkpoints are written by steps or by time (`train.checkpoint_every`,
        `train.checkpoint_every_s`); if not, only a stop or a cancel writes one."""
        return bool(self.train.checkpoint_every or self.train.checkpoint_every_s)

    def due(self, step: int) -> bool:
        """Whether the run, having just trained `step`, writes a periodic checkpoint now."""
        since_s = time.monotonic() - self.written_s
        return checkpoint_due(step, since_s, self.train.checkpoint_every, self.train.checkpoint_every_s)

    def path(self, step: int) -> Path:
        return checkpoint.checkpoint_dir(self.settings.runs_dir, self.job_id, step)

    def latest(self) -> Path | None:
        """The newest complete checkpoint (None: none yet)."""
        return checkpoint.latest(self.settings.runs_dir, self.job_id)

    async def save(self, step: int, version: int, meta: dict) -> None:
        """Write the checkpoint of `step` with `meta` (all ranks); once complete, list it on
        the job's record and delete all but the newest `settings.keep_checkpoints`, on disk
        and from the list."""
        path = self.path(step)
        self.worker.run(Command(kind="save", path=str(path), meta_json=json.dumps(meta)))
        self.written_s = time.monotonic()
        await self.redis.rpush(
            Keys.checkpoints(self.job_id),
            json.dumps({"step": step, "version": version, "path": str(path), "time": time.time()}),
        )
        keep = self.settings.keep_checkpoints
        for removed in await asyncio.to_thread(checkpoint.prune, self.settings.runs_dir, self.job_id, keep):
            log.info("job %s: deleted checkpoint %s (keeping the newest %d)", self.job_id, removed, keep)
        await self.redis.ltrim(Keys.checkpoints(self.job_id), -keep, -1)

    async def load_newest(self, fallback_note: str = "") -> tuple[dict, bool]:
        """Restore (all ranks) the newest complete checkpoint that loads; its meta, and
        whether it was the newest (an exact resume). One that does not (a torn shard, a bad
        meta) is set aside as `corrupt-step-N-<time>`, so that no later save at its step
        keeps its shards, and the one before it is tried.
        The job's alerts say so, with `fallback_note`: what that fallback means for the run."""
        failed = []
        for step in reversed(checkpoint.steps(self.settings.runs_dir, self.job_id)):
            path = self.path(step)
            try:
                meta = self.worker.run(Command(kind="load", path=str(path)))
            except GroupBroken:  # the ranks cannot go on together: nothing more to try
                raise
            except CommandFailed as err:
                log.warning("job %s: checkpoint %s does not load: %s", self.job_id, path, err)
                failed.append(f"step {step} ({str(err).splitlines()[0][:300]})")
                for reported in rank_errors_dir(self.settings.runs_dir, self.job_id).glob("rank-*.txt"):
                    reported.unlink()  # every rank failed the load and waits for the next command
                await asyncio.to_thread(path.rename, path.with_name(f"corrupt-{path.name}-{int(time.time())}"))
                continue
            if failed:
                await jobs.add_alert(
                    self.redis,
                    self.job_id,
                    f"resumed from the checkpoint at step {step}, not the newest: {'; '.join(failed)} did not load "
                    f"(set aside as corrupt-step-*). {fallback_note}".rstrip(),
                )
            return meta, not failed
        raise RuntimeError(f"cannot resume: no checkpoint of the job loads: {'; '.join(failed)}")
