"""Batch intake: the job's trajectory stream -> the groups the next step trains on.

Every group read is decided once: admitted into the batch, or refused as a duplicate (its
task was trained already), as malformed or carrying values the trainer must not see (token
ids outside the vocabulary, non-finite logprobs: dead-lettered with the reason) or as over-stale
(its task is replaced). Entries are acknowledged when the checkpoint that covers their
decision is complete, so a resumed run sees exactly the entries the lost one had not
covered (or at once, with checkpoints off).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

from learner.dispatcher import Dispatcher
from learner.group_log import GroupLog
from learner.mix import Mix
from services import protocol
from services.config import TrainSpec
from services.queues import Delivery, StreamConsumer

STALE_DROPPED = Counter("tandem_learner_stale_dropped_total", "Groups dropped as over-stale", ["job"])
DUPLICATES = Counter("tandem_learner_duplicate_groups_total", "Groups for an already trained task", ["job"])
STALE_MASKED = Counter(
    "tandem_learner_stale_masked_tokens_total",
    "Trained tokens masked out of the loss as older than train.max_token_staleness",
    ["job"],
)
HELD_OVER = Counter(
    "tandem_learner_held_over_total",
    "Groups held over to a later batch, once each (stragglers: wait kept the places for older tasks)",
    ["job"],
)


LOGPROB_SLACK = 1e-4
"""How far above 0 a behaviour logprob may round (an engine's float32 log-softmax)."""


def invalid_reason(group: protocol.TrajectoryGroup, max_tokens_per_rank: int, vocab_size: int | None = None) -> str:
    """Why the trainer could not train `group` ("" if it can): no samples, or a sample that
    `shape_problem` or `content_problem` refuses."""
    if not group.samples:
        return "the group has no samples"
    for sample in group.samples:
        problem = shape_problem(sample, max_tokens_per_rank) or content_problem(sample, vocab_size)
        if problem:
            return f"sample {sample.sample_id}: {problem}"
    return ""


def shape_problem(sample: protocol.Sample, max_tokens_per_rank: int) -> str:
    """No tokens, per-token fields of different lengths, or more tokens than a rank takes."""
    lengths = {field: len(getattr(sample, field)) for field in ("tokens", "mask", "logprobs", "versions")}
    if len(set(lengths.values())) > 1:
        return f"per-token fields differ in length {lengths}"
    if not sample.tokens:
        return "no tokens"
    if len(sample.tokens) > max_tokens_per_rank:
        return f"{len(sample.tokens)} tokens exceed train.max_tokens_per_rank={max_tokens_per_rank}"
    return ""


def content_problem(sample: protocol.Sample, vocab_size: int | None) -> str:
    """Values the trainer must not see: a token id outside the model's vocabulary (the
    embedding lookup fails or reads another row), a behaviour logprob that is not a finite
    number <= 0, a mask value other than 0 and 1, or a reward or advantage that is not
    finite (any of them turns the step's loss into NaN)."""
    if vocab_size is not None and not 0 <= min(sample.tokens) <= max(sample.tokens) < vocab_size:
        outside = next(t for t in sample.tokens if not 0 <= t < vocab_size)
        return f"token id {outside} is outside the model's vocabulary [0, {vocab_size})"
    bad = next((x for x in sample.logprobs if not -math.inf < x <= LOGPROB_SLACK), None)
    if bad is not None:
        return f"behaviour logprob {bad} is not a finite number <= 0"
    if not set(sample.mask) <= {0, 1}:
        return f"mask values {sorted(set(sample.mask) - {0, 1})} are not 0 or 1"
    for field in ("reward", "advantage"):
        if not math.isfinite(getattr(sample, field)):
            return f"{field} {getattr(sample, field)} is not finite"
    return ""


class Acks:
    """Acknowledges decided trajectory entries: with the next checkpoint (`deferred`), or
    at once when checkpoints are off."""

    def __init__(self, trajectories: StreamConsumer, deferred: bool) -> None:
        self.trajectories = trajectories
        self.deferred = deferred
        self.unacked: list[bytes] = []
        """Entries decided since the last checkpoint."""

    async def settle(self, entry_id: bytes) -> None:
        if self.deferred:
            self.unacked.append(entry_id)
        else:
            await self.trajectories.ack(entry_id)

    async def flush(self) -> None:
        """The checkpoint covering every unacknowledged entry is complete."""
        await self.trajectories.ack(*self.unacked)
        self.unacked = []


def latest_fitting(owed: list[int], places: int, batch_size: int) -> int | None:
    """The latest deadline (in steps from now) a group may have to take one of the batch's
    `places` left, given `owed[k]` tasks still out whose deadline is k steps away (None:
    any group may).

    Every step trains batch_size groups, so the tasks due within k steps, n_k of them, need
    n_k - k * batch_size of this batch's places. A group due later than some k that needs
    every place left must wait. The admission rule admits at most (eta + v + 1) * batch_size
    tasks by version v, so n_k - k * batch_size never exceeds batch_size: every deadline can
    be met, and no group is dropped as stale."""
    due = 0
    for deadline, count in enumerate(owed):
        due += count
        if due - deadline * batch_size >= places:
            return deadline
    return None


def mask_stale_tokens(group: protocol.TrajectoryGroup, version: int, limit: int) -> int:
    """Masks out of the loss every trained token of `group` sampled more than `limit`
    versions before `version` (an unversioned token, -1, counts as oldest); how many."""
    masked = 0
    for sample in group.samples:
        for index, (token_version, trained) in enumerate(zip(sample.versions, sample.mask)):
            if trained and version - token_version > limit:
                sample.mask[index] = 0
                masked += 1
    return masked


def mask_too_old(group: protocol.TrajectoryGroup, version: int, train: TrainSpec, stragglers: str) -> tuple[int, bool]:
    """With `stragglers: admit` and `train.max_token_staleness` set, masks `group`'s tokens
    older than it (`mask_stale_tokens`). How many, and whether that left a group that had
    tokens to train with none (it is refused as stale)."""
    limit = train.max_token_staleness
    if limit is None or stragglers != "admit":
        return 0, False
    had_tokens = group.min_version() is not None
    masked = mask_stale_tokens(group, version, limit)
    return masked, had_tokens and group.min_version() is None


def over_stale(group: protocol.TrajectoryGroup, version: int, max_staleness: int, stragglers: str) -> bool:
    """Older than `max_staleness` at `version` (unless late groups are admitted), or from a
    version newer than it."""
    oldest = group.min_version()
    staleness = version - (version if oldest is None else oldest)
    late = staleness > max_staleness and stragglers != "admit"
    return late or group.max_version() > version


class TaskLedger:
    """Which admitted tasks are trained, lost or still out, and by which step each still
    out must be trained (its deadline under the staleness bound)."""

    def __init__(self, dispatcher: Dispatcher, train: TrainSpec) -> None:
        self.dispatcher = dispatcher
        self.train = train
        self.trained: set[int] = set()
        """Tasks whose group was trained (checkpointed with the job)."""
        self.done_below = 0
        """Every task below this id is trained or lost."""

    def deadline(self, task_id: int, version: int) -> int | None:
        """Steps after `version` until the last version that may train `task_id`'s group:
        admitted at version a, it must be trained on a + eta at the latest (None: the
        dispatcher no longer knows the task's version, long past its deadline)."""
        admitted = self.dispatcher.admitted_version(task_id)
        return None if admitted is None else admitted + self.train.max_staleness - version

    def in_time(self, task_id: int, version: int, owed: list[int], places: int) -> bool:
        """Whether `task_id`'s group may take one of a batch's `places` left without keeping
        a task owed sooner from its deadline (`latest_fitting`)."""
        latest = latest_fitting(owed, places, self.train.batch_size)
        deadline = self.deadline(task_id, version)
        return latest is None or deadline is None or deadline <= latest

    def owed_by_deadline(self, version: int, seen: set[int]) -> list[int]:
        """How many tasks (neither trained, lost nor in `seen`, the batch) have their
        deadline 0, 1, ..., eta steps after `version`."""
        owed = [0] * (self.train.max_staleness + 1)
        for task_id in self.untrained_tasks():
            deadline = self.deadline(task_id, version)
            if task_id not in seen and deadline is not None and 0 <= deadline < len(owed):
                owed[deadline] += 1
        return owed

    def untrained_tasks(self) -> list[int]:
        """Admitted tasks neither trained nor lost, oldest first."""
        lost = self.dispatcher.lost
        while self.done_below < self.dispatcher.next_task_id and (
            self.done_below in self.trained or self.done_below in lost
        ):
            lost.discard(self.done_below)
            self.done_below += 1
        return [
            t for t in range(self.done_below, self.dispatcher.next_task_id) if t not in self.trained and t not in lost
        ]


class BatchIntake:
    COUNTS = ("stale_dropped", "duplicates", "held_over", "stale_masked_tokens")

    def __init__(
        self,
        job_id: str,
        train: TrainSpec,
        trajectories: StreamConsumer,
        dispatcher: Dispatcher,
        acks: Acks,
        vocab_size: int | None = None,
        log: GroupLog | None = None,
        stragglers: str = "drop",
    ) -> None:
        self.job_id = job_id
        self.train = train
        self.stragglers = stragglers
        """`train.stragglers` of an RL job; a generate job's version never moves, nothing it
        samples goes stale, and it drops (its default) nothing."""
        self.vocab_size = vocab_size
        """The policy's embedding rows: token ids at or above it are refused (None: unchecked)."""
        self.trajectories = trajectories
        self.dispatcher = dispatcher
        self.acks = acks
        self.log = log
        """Where each decision is recorded (None: nowhere)."""
        self.ledger = TaskLedger(dispatcher, train)
        self.counts = dict.fromkeys(self.COUNTS, 0)
        self.backlog: list[Delivery] = []
        """Entries read and not decided yet: an earlier run's, never acknowledged, and groups
        held over from the last batch (`stragglers: wait`)."""
        self.held_once: set[int] = set()
        """Tasks whose group was held over and is not decided yet."""
        self.admitted = 0
        """Groups this run took into a batch: the job's progress between steps."""
        self.mix = Mix()

    async def read_backlog(self) -> None:
        """Every trajectory entry an earlier run of this job read and never acknowledged, in
        stream order: all of them, since what a capped read leaves out is never read again."""
        pending = await self.trajectories.own_pending_count()
        self.backlog = await self.trajectories.read_own_pending(pending) if pending else []

    async def collect(
        self, version: int, when_idle: Callable[[], Awaitable[None]], size: int | None = None
    ) -> list[Delivery]:
        """`size` (default `batch_size`) fresh groups of distinct, untrained tasks for the
        step after `version`, keeping the dispatcher topped up; `when_idle` runs whenever a
        read finds nothing. With `stragglers: wait` a group takes a place only if every task
        still out can be trained before its deadline (`latest_fitting`); one that
        cannot is held over to a later batch, and the batch waits for the groups it owes."""
        size = size or self.train.batch_size
        batch: list[Delivery] = []
        seen: set[int] = set()
        waiting, held = self.backlog, list[Delivery]()  # held starts empty, typed
        while len(batch) < size:
            await self.dispatcher.top_up(version)
            if not waiting:
                waiting = await self.trajectories.read(size - len(batch), block_ms=200)
                if not waiting:
                    await when_idle()
                    waiting, held = held, []  # a place may have come free (a task owed was lost)
                    continue
            chunk, waiting = waiting, []
            owed = self.ledger.owed_by_deadline(version, seen) if self.stragglers == "wait" else None
            for index, delivery in enumerate(chunk):
                if len(batch) == size:
                    waiting = chunk[index:]
                    break
                if not self.fits(delivery, version, seen, owed, size - len(batch)):
                    held.append(delivery)
                    if delivery.message.task_id not in self.held_once:  # counted once however often it waits
                        self.held_once.add(delivery.message.task_id)
                        self.counts["held_over"] += 1
                        HELD_OVER.labels(self.job_id).inc()
                elif await self.admit(delivery, version, seen):
                    batch.append(delivery)
                    seen.add(delivery.message.task_id)
                    deadline = self.ledger.deadline(delivery.message.task_id, version)
                    if owed is not None and deadline is not None and 0 <= deadline < len(owed):
                        owed[deadline] -= 1
        self.backlog = held + waiting
        if self.log is not None:
            self.log.flush()
        return batch

    def fits(self, delivery: Delivery, version: int, seen: set[int], owed: list[int] | None, places: int) -> bool:
        """Whether the group may take one of the batch's `places` left (else it is held
        over): always unless the learner waits for stragglers (`owed` is not None) and the
        group's deadline is later than `latest_fitting` allows. Groups to refuse always
        "fit": `admit` decides them."""
        if owed is None or self.ledger.in_time(delivery.message.task_id, version, owed, places):
            return True
        return not self.eligible(delivery, version, seen)

    def eligible(self, delivery: Delivery, version: int, seen: set[int]) -> bool:
        """Whether `decide` would take the group into the batch (without deciding)."""
        group: protocol.TrajectoryGroup = delivery.message
        return (
            group.task_id not in self.ledger.trained
            and group.task_id not in seen
            and not invalid_reason(group, self.train.max_tokens_per_rank, self.vocab_size)
            and not over_stale(group, version, self.train.max_staleness, self.stragglers)
        )

    async def admit(self, delivery: Delivery, version: int, seen: set[int]) -> bool:
        """`decide`, recorded in the group log."""
        decision = await self.decide(delivery, version, seen)
        self.held_once.discard(delivery.message.task_id)
        self.mix.decided(delivery.message, decision)
        if self.log is not None:
            self.log.write(delivery.message, decision, version)
        self.admitted += decision == "trained"
        return decision == "trained"

    async def decide(self, delivery: Delivery, version: int, seen: set[int]) -> str:
        """Whether a group joins the batch trained on `version` ("trained") or why not.
        Refused: a task already trained (a rollout server died after writing it) or already
        in the batch ("duplicate"), groups the trainer must not see ("invalid",
        dead-lettered: `invalid_reason`), and over-stale groups, groups `mask_too_old` left
        nothing to train and groups from versions newer than `version` ("stale"; the last
        were sampled by weights a crashed learner published and this one never had)."""
        group: protocol.TrajectoryGroup = delivery.message
        if group.task_id in self.ledger.trained or group.task_id in seen:
            self.counts["duplicates"] += 1
            DUPLICATES.labels(self.job_id).inc()
            await self.acks.settle(delivery.entry_id)
            return "duplicate"
        problem = invalid_reason(group, self.train.max_tokens_per_rank, self.vocab_size)
        if problem:
            # Refused on rank 0 for all ranks: in a step it would fail on some, leaving the rest blocked.
            await self.trajectories.dead_letter(delivery.entry_id, protocol.encode(group), problem)
            return "invalid"  # the dispatcher replaces its task when it reads the dead stream
        masked, emptied = mask_too_old(group, version, self.train, self.stragglers)
        self.counts["stale_masked_tokens"] += masked
        STALE_MASKED.labels(self.job_id).inc(masked)
        if emptied or over_stale(group, version, self.train.max_staleness, self.stragglers):
            self.counts["stale_dropped"] += 1
            STALE_DROPPED.labels(self.job_id).inc()
            self.dispatcher.replace(group.task_id)
            await self.acks.settle(delivery.entry_id)
            return "stale"
        return "trained"

    async def trained_on(self, batch: list[Delivery]) -> None:
        """`batch` was trained: its entries are decided, its tasks done."""
        for delivery in batch:
            await self.acks.settle(delivery.entry_id)
        self.ledger.trained.update(d.message.task_id for d in batch)
        self.ledger.untrained_tasks()  # moves done_below on, forgetting lost tasks below it
