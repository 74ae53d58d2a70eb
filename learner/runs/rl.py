"""An RL job (`kind: rl`), the loop on rank 0:

    warm start (SFT) -> publish version 0 -> repeat num_steps times:
        admit tasks -> collect a batch of fresh groups -> RL step (all ranks)
        -> version += 1 -> publish weights -> acknowledge the trained groups

Its parts: the batch intake (trajectory stream -> batches), the weight publisher (rollout
servers and versions), the step log (records, metrics, health) and the checkpoints it
writes and resumes from.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from learner import checkpoint, policy
from learner import pairs as pair_picking
from learner.control import Command, CommandFailed, GroupBroken, rank_errors_dir
from learner.group_log import GroupLog
from learner.intake import Acks, BatchIntake
from learner.runs.base import checkpoint_due
from learner.runs.rollout_fed import RolloutFedRun
from learner.step_log import rl_record
from services import jobs, protocol, retention
from services.queues import FIELD, Delivery, Keys

log = logging.getLogger(__name__)


class RLRun(RolloutFedRun):
    def health_rules(self) -> list:
        return self.spec.health

    async def run(self, resuming: bool = False) -> None:
        self.make_run_dir()
        trajectories = await self.trajectories()
        train = self.spec.train
        self.checkpointed_s = time.monotonic()
        self.intake = BatchIntake(
            self.job_id,
            self.spec.train,
            trajectories,
            self.dispatcher,
            Acks(trajectories, deferred=self.periodic_checkpoints()),
            policy.vocab_size(self.spec.model.local_folder()),
            GroupLog(self.run_dir),
            self.spec.train.stragglers,
        )
        if not (resuming and await self.resume()):
            await self.start()
        await self.publisher.wait_for_servers(self.check_waiting)
        await self.publisher.publish(self.version)
        await self.intake.read_backlog()
        self.steps.start_rl()
        self.intake.log.start()
        while self.step < self.spec.train.num_steps:
            await self.check_cancel()
            waited = time.monotonic()
            batch = await self.intake.collect(self.version, self.while_waiting)
            await self.train(batch, time.monotonic() - waited)
            since_s = time.monotonic() - self.checkpointed_s
            if checkpoint_due(self.step, since_s, train.checkpoint_every, train.checkpoint_every_s):
                await self.checkpoint()
            if self.spec.train.export_every and self.step % self.spec.train.export_every == 0:
                self.worker.run(Command(kind="export", path=str(self.run_dir / "policies" / f"step-{self.step:06d}")))
            if self.step < self.spec.train.num_steps:
                await self.check_stop()
        await self.checkpoint()  # the final one, unless the last step's is written already
        self.export_policy()

    async def start(self) -> None:
        """A fresh start: the warm start, then the step-0 checkpoint RL begins from."""
        await self.warm_start()
        self.worker.run(Command(kind="start_rl"))
        await self.checkpoint()

    async def train(self, batch: list[Delivery], wait_s: float) -> None:
        """One RL step on `batch` (collected in `wait_s` seconds), the weight publish after
        it, and the step's record."""
        groups = [d.message for d in batch]
        started = time.perf_counter()
        train = self.spec.train
        if train.algorithm == "dpo":  # online DPO: each group's best and worst response
            pairs, too_long = pair_picking.pairs_from_groups(groups, train.pair_margin, train.max_tokens_per_rank)
            metrics = self.worker.run(Command(kind="dpo", samples=pairs)) | {
                "pairs_too_long": float(too_long),
                "trained_tokens": sum(sum(s.mask) for s in pairs),
            }
        else:
            metrics = self.worker.run(Command(kind="rl", samples=[s for g in groups for s in g.samples]))
        step_seconds = time.perf_counter() - started
        self.version += 1
        self.step += 1
        sync = await self.publisher.publish(self.version)
        await self.intake.trained_on(batch)
        record = rl_record(
            self.step,
            self.version,
            groups,
            metrics,
            step_seconds,
            sync["seconds"],
            self.steps.waited(wait_s),
            self.counts(),
        )
        self.steps.observe_step(record)
        fired = await self.steps.judge_health(record)
        await self.steps.write(record, self.step, self.version)
        for stream in (Keys.tasks(self.job_id), Keys.trajectories(self.job_id)):
            await retention.trim_acked(self.redis, stream)
        await self.steps.act_on(fired)

    def counts(self) -> dict[str, int]:
        return self.intake.counts | self.publisher.counts

    def periodic_checkpoints(self) -> bool:
        """Whether checkpoints are written by steps or by time (`train.checkpoint_every`,
        `train.checkpoint_every_s`)."""
        return bool(self.spec.train.checkpoint_every or self.spec.train.checkpoint_every_s)

    async def checkpoint(self, stopping: bool = False) -> None:
        """Write a checkpoint (all ranks), then acknowledge what it covers. With periodic
        checkpoints off, trained groups are acknowledged right after their step instead, and
        only a stop (SIGTERM, `stopping`) writes one: the job resumes from it."""
        path = checkpoint.checkpoint_dir(self.settings.runs_dir, self.job_id, self.step)
        if (not self.periodic_checkpoints() and not stopping) or (
            path == checkpoint.latest(self.settings.runs_dir, self.job_id) and not self.intake.acks.unacked
        ):
            return
        meta = {
            "step": self.step,
            "version": self.version,
            "trained": sorted(self.intake.ledger.trained),
            "counts": self.counts(),
            "dispatcher": self.dispatcher.state(),
            "history_length": await self.steps.length(),
        }
        self.worker.run(Command(kind="save", path=str(path), meta_json=json.dumps(meta)))
        self.checkpointed_s = time.monotonic()
        await self.intake.acks.flush()
        await self.record_checkpoint(path)

    async def on_cancel(self) -> None:
        """A checkpoint to resume from, and the policy trained so far as the job's model."""
        await super().on_cancel()
        self.export_policy()

    async def resume(self) -> bool:
        """Continue from the newest complete checkpoint: restore every rank's state and the
        parts' bookkeeping, drop history written after it, and move the dispatcher past
        every task already in the stream. False: nothing to resume, start over."""
        path = checkpoint.latest(self.settings.runs_dir, self.job_id)
        if path is None:
            if await self.redis.xlen(Keys.tasks(self.job_id)):
                raise RuntimeError(
                    f"cannot resume: tasks were dispatched but there is no complete checkpoint in "
                    f"{self.run_dir / 'checkpoints'} (train.checkpoint_every and checkpoint_every_s 0, no SIGTERM?)"
                )
            log.info("no checkpoint yet and nothing dispatched: starting job %s over", self.job_id)
            await self.steps.trim(0)
            return False
        self.worker.run(Command(kind="start_rl"))
        meta, exact = await self.load_newest()
        self.step, self.version = meta["step"], meta["version"]
        self.intake.ledger.trained = set(meta["trained"])
        for part in (self.intake, self.publisher):
            part.counts.update({name: meta["counts"].get(name, 0) for name in part.counts})
        self.dispatcher.load_state(meta["dispatcher"])
        last = await self.redis.xrevrange(Keys.tasks(self.job_id), count=1)
        if last:
            last_task = protocol.decode(last[0][1][FIELD], protocol.Task).task_id
            self.dispatcher.skip_past(last_task, self.version)
        if not exact:  # groups of the tasks out then may be gone: admit new tasks in their place
            for task_id in self.intake.ledger.untrained_tasks():
                self.dispatcher.replace(task_id)
        await self.steps.trim(meta["history_length"])
        log.info("resumed job %s from step %d", self.job_id, self.step)
        return True

    async def load_newest(self) -> tuple[dict, bool]:
        """Restore (all ranks) the newest complete checkpoint that loads; its meta, and
        whether it was the newest (an exact resume). One that does not (a torn shard, a bad
        meta) is set aside as `corrupt-step-N-<time>`, so that no later save at its step
        keeps its shards, and the one before it is tried.
        That fallback is not exact, and the job's alerts say so: the groups trained after the
        older checkpoint were acknowledged when the newer one was written and are gone, so
        those steps, and the tasks that were out then, are trained again on new groups."""
        failed = []
        for step in reversed(checkpoint.steps(self.settings.runs_dir, self.job_id)):
            path = checkpoint.checkpoint_dir(self.settings.runs_dir, self.job_id, step)
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
                    f"(set aside as corrupt-step-*). Not an exact resume: the groups trained after step {step} were "
                    "acknowledged when the newer checkpoint was written, so those steps train on new groups",
                )
            return meta, not failed
        raise RuntimeError(f"cannot resume: no checkpoint of the job loads: {'; '.join(failed)}")
