"""Task dispatch under the staleness bound (AReaL's admission rule).

A task may be admitted only while `outstanding < (eta + version + 1) * batch_size`, where
`outstanding` counts tasks admitted minus those replaced (their group was dropped as too
stale, or the task or its group went to the dead stream). With eta = 0 no task is admitted before the
previous batch trained: synchronous RL from the same code. The example of task t is a
deterministic function of t (a reshuffle every pass over the dataset), so the dispatch
state is two integers, cheap to checkpoint and exact to resume.
"""

from __future__ import annotations

import random

import msgspec
import redis.asyncio as aioredis

from services import protocol
from services.config import JobSpec
from services.queues import FIELD, Keys
from services.redis_values import raw, stream_entries


class TaskRef(msgspec.Struct):
    """The task a message names, whatever else it carries (unknown fields are ignored)."""

    job_id: str
    task_id: int


class Dispatcher:
    def __init__(self, client: aioredis.Redis, job_id: str, spec: JobSpec) -> None:
        self.client = client
        self.job_id = job_id
        self.spec = spec
        self.next_task_id = 0
        self.replaced = 0
        self.dead_cursor = "0-0"
        self.admitted_at: list[tuple[int, int]] = []
        """(version, first task id) for each version that admitted tasks, oldest first (the
        versions a waiting learner may still ask about): which version admitted which task."""
        self.lost: set[int] = set()
        """Admitted tasks that will never be trained (replaced), until the intake forgets them."""
        self.dead_lettered = 0
        """Tasks of this run replaced because they or their groups went to the dead stream."""
        self._orders: dict[int, list[int]] = {}
        self.total_steps = spec.train.num_steps
        """The steps the job will train: `num_steps`, or fewer once a spend cap binds
        (`learner.cost.CostMeter.planned_steps`); no task is admitted beyond them."""

    @property
    def outstanding(self) -> int:
        return self.next_task_id - self.replaced

    def limit(self, version: int) -> int:
        """How many tasks may have been admitted by the step after `version`: the staleness
        rule (a generate job's dispatcher admits every task at once, `runs.generate.AllAtOnce`)."""
        train = self.spec.train
        return min((train.max_staleness + version + 1) * train.batch_size, self.total_steps * train.batch_size)

    def example(self, task_id: int) -> int:
        size = self.spec.task.num_examples
        epoch, position = divmod(task_id, size)
        if epoch not in self._orders:
            order = list(range(size))
            random.Random(self.spec.train.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch][position]

    def replace(self, task_id: int) -> None:
        """Admitted task `task_id` will never be trained: admit a new one in its place."""
        self.replaced += 1
        self.lost.add(task_id)

    def admitted_version(self, task_id: int) -> int | None:
        """The version that admitted `task_id` (None: forgotten, more than eta versions
        ago, or never admitted)."""
        if not 0 <= task_id < self.next_task_id:
            return None
        return next((at for at, first in reversed(self.admitted_at) if first <= task_id), None)

    def skip_past(self, task_id: int, version: int) -> None:
        """A resumed run: tasks up to `task_id` are in the stream already (a lost run admitted
        them after its last checkpoint); count them as admitted at `version`."""
        if task_id >= self.next_task_id:
            self._record_admission(version)
            self.next_task_id = task_id + 1

    async def skip_dispatched(self, version: int) -> None:
        """A resumed run: `skip_past` the newest task in the job's tasks stream (trimming
        always leaves the newest entry there)."""
        last = await self.client.xrevrange(Keys.tasks(self.job_id), count=1)
        fields = last[0][1] if last else None
        if fields is not None:
            self.skip_past(protocol.decode(raw(fields[FIELD]), protocol.Task).task_id, version)

    def _record_admission(self, version: int) -> None:
        """Tasks from `next_task_id` on are admitted at `version`. Versions more than
        `max_staleness` behind it are forgotten: the learner asks about none of them again."""
        if not self.admitted_at or self.admitted_at[-1][0] != version:
            self.admitted_at.append((version, self.next_task_id))
        horizon = version - self.spec.train.max_staleness
        while len(self.admitted_at) > 1 and self.admitted_at[1][0] <= horizon:
            self.admitted_at.pop(0)

    async def top_up(self, version: int) -> int:
        """Publish as many tasks as the admission rule allows now; returns how many."""
        await self._replace_dead_tasks()
        count = max(0, self.limit(version) - self.outstanding)
        if count:
            self._record_admission(version)
            async with self.client.pipeline(transaction=False) as pipe:
                for task_id in range(self.next_task_id, self.next_task_id + count):
                    task = protocol.Task(
                        job_id=self.job_id,
                        task_id=task_id,
                        example=self.example(task_id),
                        group_size=self.spec.rollout.group_size,
                        dispatched_version=version,
                    )
                    pipe.xadd(Keys.tasks(self.job_id), {FIELD: protocol.encode(task)})
                await pipe.execute()
            self.next_task_id += count
        return count

    async def _replace_dead_tasks(self) -> None:
        """Replace tasks this dispatcher admitted that will never be trained because their
        entry went to the dead stream: the task (a rollout server found bad content or
        too many failed deliveries) or its trajectory group (the learner could not decode
        or validate it, or read it too often). Foreign or garbage task entries do not count."""
        entries = await self.client.xrange(Keys.dead(self.job_id), min=f"({self.dead_cursor}", count=1000)
        for entry_id, fields in stream_entries(entries):
            self.dead_cursor = entry_id
            task_id = self._lost_here(raw(fields.get(b"stream", b"")), raw(fields.get(FIELD, b"")))
            if task_id is not None:
                self.replace(task_id)
                self.dead_lettered += 1

    def _lost_here(self, stream: bytes, data: bytes) -> int | None:
        """The task a dead-stream entry names, if this dispatcher admitted it."""
        if stream == Keys.tasks(self.job_id).encode():
            return self._admitted_here(data, protocol.Task)
        if stream == Keys.trajectories(self.job_id).encode():
            # A group that does not validate (malformed samples, another schema) still
            # names its task; bytes that name none were not written for a task of ours.
            return self._admitted_here(data, TaskRef)
        return None

    def _admitted_here(self, data: bytes, kind: type[protocol.Task | TaskRef]) -> int | None:
        try:
            message = msgspec.msgpack.decode(data, type=kind)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if message.job_id == self.job_id and 0 <= message.task_id < self.next_task_id:
            return message.task_id
        return None

    def state(self) -> dict:
        return {
            "next_task_id": self.next_task_id,
            "replaced": self.replaced,
            "dead_cursor": self.dead_cursor,
            "admitted_at": self.admitted_at,
            "lost": sorted(self.lost),
        }

    def load_state(self, state: dict) -> None:
        self.next_task_id = state["next_task_id"]
        self.replaced = state["replaced"]
        self.dead_cursor = state["dead_cursor"]
        self.admitted_at = [tuple(pair) for pair in state.get("admitted_at", [])]  # older checkpoints: none
        self.lost = set(state.get("lost", []))
