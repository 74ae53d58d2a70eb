"""An offline job (`kind: offline`): DPO on a pairs file, with no rollout server.

    warm start (if any) -> the reference frozen -> num_steps DPO steps on batch_size pairs

The pairs are read once on rank 0 (a malformed row fails the job with its line). Step s
takes the pairs at positions s * batch_size ... of an endless sequence of passes over the
file, each pass in its own seeded order, so the batch of every step is a function of the
step alone: a resumed job trains exactly the batches the lost one had not.
"""

from __future__ import annotations

import random
import time

from learner import policy
from learner.control import Command
from learner.runs.base import Run
from services import preference, protocol


def step_pairs(num_pairs: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The indices of the pairs step `step` (from 0) trains."""
    positions = range(step * batch_size, (step + 1) * batch_size)
    orders: dict[int, list[int]] = {}
    picked = []
    for position in positions:
        epoch, index = divmod(position, num_pairs)
        if epoch not in orders:
            orders[epoch] = list(range(num_pairs))
            random.Random(seed * 1_000_003 + epoch).shuffle(orders[epoch])
        picked.append(orders[epoch][index])
    return picked


class OfflineRun(Run):
    """DPO steps on the pairs file, checkpointed and resumed; no rollout server takes part."""

    async def run(self, resuming: bool = False) -> None:
        self.make_run_dir()
        train = self.spec.train
        if train.data is None:
            raise ValueError("an offline job trains on train.data, which its spec sets")
        vocab = policy.vocab_size(self.spec.model.local_folder())
        samples = preference.load_pairs(train.data, vocab, max_pair_tokens=train.max_tokens_per_rank)
        pairs = [samples[i : i + 2] for i in range(0, len(samples), 2)]
        if not (resuming and await self.resume()):
            await self.warm_start()
            self.worker.run(Command(kind="start_rl"))
        while self.step < train.num_steps:
            await self.check_cancel()
            batch = [pairs[i] for i in step_pairs(len(pairs), train.batch_size, self.step, train.seed)]
            await self.train_pairs([s for pair in batch for s in pair], len(pairs))
            if self.checkpoints.due(self.step):
                await self.checkpoint()
            if self.step < train.num_steps:
                await self.check_stop()
        if self.checkpoints.periodic and self.checkpoints.path(self.step) != self.checkpoints.latest():
            await self.checkpoint()  # the final one, unless the last step's is written already
        self.export_policy()

    async def train_pairs(self, samples: list[protocol.Sample], num_pairs: int) -> None:
        started = time.perf_counter()
        metrics = self.worker.run(Command(kind="dpo", samples=samples))
        self.step += 1
        self.version += 1
        record = {
            "phase": "offline",
            "step": self.step,
            "version": self.version,
            "epoch": self.step * self.spec.train.batch_size / num_pairs,
            "trained_tokens": sum(sum(s.mask) for s in samples),
            "step_seconds": time.perf_counter() - started,
            **metrics,
        }
        await self.steps.write(record, self.step, self.version)

    async def checkpoint(self, stopping: bool = False) -> None:
        """Always written when called, a stop's (`stopping`) too: nothing waits on it to be
        acknowledged, since an offline job reads its pairs from a file. Older ones are
        pruned as an RL job's are."""
        meta = {"step": self.step, "version": self.version, "history_length": await self.steps.length()}
        await self.checkpoints.save(self.step, self.version, meta)

    async def on_cancel(self) -> None:
        """A checkpoint to resume from, and the policy trained so far as the job's model."""
        await super().on_cancel()
        self.export_policy()

    async def resume(self) -> bool:
        """Continue from the newest checkpoint that loads, its step's batches next (a
        function of the step), with the history written after it dropped. False: no
        checkpoint, start over."""
        if self.checkpoints.latest() is None:
            await self.steps.trim(0)
            return False
        self.worker.run(Command(kind="start_rl"))
        meta, _ = await self.checkpoints.load_newest()
        self.step, self.version = meta["step"], meta["version"]
        await self.steps.trim(meta["history_length"])
        return True
