"""An RL job (`kind: rl`), the loop on rank 0:

    warm start (SFT) -> publish version 0 -> repeat num_steps times:
        admit tasks -> collect a batch of fresh groups -> RL step (all ranks)
        -> version += 1 -> publish weights -> acknowledge the trained groups
    -> final checkpoint and policy -> wait for the held-out evaluations still out

Its parts: the batch intake (trajectory stream -> batches), the weight publisher (rollout
servers and versions), the step log (records, metrics, health), the checkpoints it
writes and resumes from, and the held-out evaluation when the job has `eval`.
"""

from __future__ import annotations

import contextlib
import logging
import time

from learner import pairs as pair_picking
from learner import policy
from learner.control import Command
from learner.cost import SpendCapReached
from learner.group_log import GroupLog
from learner.intake import Acks, BatchIntake
from learner.mix import Mix
from learner.runs.rollout_fed import RolloutFedRun
from learner.step_log import rl_record
from services import protocol, retention
from services.config import RLJob, TrainSpec
from services.queues import Delivery, Keys

log = logging.getLogger(__name__)


def training_command(groups: list[protocol.TrajectoryGroup], train: TrainSpec) -> tuple[Command, dict]:
    """What every rank runs for a step on `groups`: RL on their samples, or online DPO on
    each group's best and worst response (with what picking the pairs counted)."""
    if train.algorithm != "dpo":
        return Command(kind="rl", samples=[s for g in groups for s in g.samples]), {}
    pairs, too_long = pair_picking.pairs_from_groups(groups, train.pair_margin, train.max_tokens_per_rank)
    return Command(kind="dpo", samples=pairs), {
        "pairs_too_long": float(too_long),
        "trained_tokens": sum(sum(s.mask) for s in pairs),
    }


class RLRun(RolloutFedRun):
    def health_rules(self) -> list:
        return self.spec.health if isinstance(self.spec, RLJob) else []

    async def run(self, resuming: bool = False) -> None:
        self.make_run_dir()
        trajectories = await self.trajectories()
        self.group_log = GroupLog(self.run_dir)
        self.intake = BatchIntake(
            self.job_id,
            self.spec.train,
            trajectories,
            self.dispatcher,
            Acks(trajectories, deferred=self.checkpoints.periodic),
            policy.vocab_size(self.spec.model.local_folder()),
            self.group_log,
            self.spec.train.stragglers,
        )
        if not (resuming and await self.resume()):
            await self.start()
        await self.publisher.wait_for_servers(self.check_waiting)
        await self.publisher.publish(self.version)
        await self.evaluation.ask(self.step)  # the warm start's policy, or the resumed step's
        await self.intake.read_backlog()
        await self.cost.begin(self.step)
        self.steps.start_rl()
        self.group_log.start()
        with contextlib.suppress(SpendCapReached):  # the proxy refuses its calls: what is out will not come
            await self.train_steps()
        if self.step < self.spec.train.num_steps:  # a spend cap ended it
            self.ended_early = await self.cost.reason(self.step, self.spec.train.num_steps)
        await self.checkpoint()  # the final one, unless the last step's is written already
        self.export_policy()
        await self.evaluation.finish(self.while_waiting, wait=not self.ended_early)

    async def train_steps(self) -> None:
        """Steps until `num_steps`, or fewer once a spend cap binds (`plan_within_budget`)."""
        while self.step < self.dispatcher.total_steps:
            await self.check_cancel()
            waited = time.monotonic()
            batch = await self.intake.collect(self.version, self.waiting_for_groups)
            await self.train(batch, time.monotonic() - waited)
            if self.checkpoints.due(self.step):
                await self.checkpoint()
            if self.spec.train.export_every and self.step % self.spec.train.export_every == 0:
                self.worker.run(Command(kind="export", path=str(self.run_dir / "policies" / f"step-{self.step:06d}")))
            await self.plan_within_budget(self.step)
            if self.step < self.dispatcher.total_steps:
                await self.check_stop()

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
        command, picked = training_command(groups, train)
        metrics = self.worker.run(command) | picked
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
            self.counts() | self.intake.mix.record() | await self.cost.after_step(self.step, groups, train.num_steps),
        )
        self.steps.observe_step(record)
        fired = await self.steps.judge_health(record)
        await self.steps.write(record, self.step, self.version)
        for stream in (Keys.tasks(self.job_id), Keys.trajectories(self.job_id)):
            await retention.trim_acked(self.redis, stream)
        await self.steps.act_on(fired)
        await self.evaluation.after_step(self.step, groups)  # the new version's round, if due

    async def checkpoint(self, stopping: bool = False) -> None:
        """Write a checkpoint (all ranks), then acknowledge what it covers. With periodic
        checkpoints off, trained groups are acknowledged right after their step instead, and
        only a stop (SIGTERM, `stopping`) writes one: the job resumes from it."""
        if (not self.checkpoints.periodic and not stopping) or (
            self.checkpoints.path(self.step) == self.checkpoints.latest() and not self.intake.acks.unacked
        ):
            return
        meta = {
            "step": self.step,
            "version": self.version,
            "trained": sorted(self.intake.ledger.trained),
            "counts": self.counts(),
            "mix": self.intake.mix.state(),
            "dispatcher": self.dispatcher.state(),
            "history_length": await self.steps.length(),
            "groups_bytes": self.group_log.written_bytes(),
            "evaluation": self.evaluation.spend,
        }
        await self.checkpoints.save(self.step, self.version, meta)
        await self.intake.acks.flush()

    async def on_cancel(self) -> None:
        """A checkpoint to resume from, and the policy trained so far as the job's model."""
        await super().on_cancel()
        self.export_policy()

    async def resume(self) -> bool:
        """Continue from the newest complete checkpoint: restore every rank's state and the
        parts' bookkeeping, drop history written after it, and move the dispatcher past
        every task already in the stream. False: nothing to resume, start over."""
        if self.checkpoints.latest() is None:
            if await self.redis.xlen(Keys.tasks(self.job_id)):
                raise RuntimeError(
                    f"cannot resume: tasks were dispatched but there is no complete checkpoint in "
                    f"{self.run_dir / 'checkpoints'} (train.checkpoint_every and checkpoint_every_s 0, no SIGTERM?)"
                )
            log.info("no checkpoint yet and nothing dispatched: starting job %s over", self.job_id)
            await self.steps.trim(0)
            self.group_log.trim(0)
            return False
        self.worker.run(Command(kind="start_rl"))
        meta, exact = await self.checkpoints.load_newest(
            "Not an exact resume: the groups trained after it were acknowledged when the newer checkpoint "
            "was written, so those steps train on new groups"
        )
        self.step, self.version = meta["step"], meta["version"]
        self.intake.ledger.trained = set(meta["trained"])
        for part in (self.intake, self.publisher):
            part.counts.update({name: meta["counts"].get(name, 0) for name in part.counts})
        self.intake.mix = Mix.from_state(meta.get("mix"))
        self.dispatcher.load_state(meta["dispatcher"])
        await self.dispatcher.skip_dispatched(self.version)
        if not exact:  # groups of the tasks out then may be gone: admit new tasks in their place
            for task_id in self.intake.ledger.untrained_tasks():
                self.dispatcher.replace(task_id)
        await self.steps.trim(meta["history_length"])
        if "groups_bytes" in meta:  # a checkpoint without it leaves the file as it is
            self.group_log.trim(meta["groups_bytes"])
        await self.evaluation.resume(meta.get("evaluation"))
        log.info("resumed job %s from step %d", self.job_id, self.step)
        return True
