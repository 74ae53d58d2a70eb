"""A generate job (`kind: generate`): CollabLLM's MR-ranked synthetic data.

The rollout servers play the conversations (`RankedRollout.ranked_conversation`: at each
assistant turn `group_size` responses scored by MR, the best carries on); this run writes
what they bring, a batch at a time, into the job's `dataset/` folder:

    sft.jsonl    {"messages", "example", "task_id", <the task's metrics>}: the conversations
                 of best responses, well-formed ones only (a warm start's `data`)
    pairs.jsonl  per turn, the best and the worst response when their MR differs by at
                 least `generate.pair_margin` (`services.preference`; an offline job's
                 `train.data`), with the context and both responses as text too

Both are listed in `job:{id}:datasets` (the API's `/datasets`) with their row counts. The
policy never changes, so every task is admitted at once and sampled by version 0.

The files are the job's state (`DatasetFiles`): a batch's rows are appended and fsynced,
then a line in `runs/<job>/written.jsonl` commits them (the batch's task ids, each file's
size after it, the dispatcher's state), and only then are the batch's groups acknowledged.
A resumed run cuts each file back to the last committed size (rows of a batch cut short,
a torn line), takes the committed tasks as done and collects only the rest: the groups of
an uncommitted batch are still pending in the trajectory stream and come again. A warm
start is kept as the step-0 checkpoint, so a resumed run plays the same policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import Counter

from learner import checkpoint
from learner import pairs as pair_picking
from learner.control import Command
from learner.cost import SpendCapReached
from learner.dispatcher import Dispatcher
from learner.intake import Acks, BatchIntake
from learner.runs.base import Learner
from learner.runs.rollout_fed import RolloutFedRun
from services import preference, protocol, retention
from services.config import GenerateJob, JobSpec
from services.queues import Keys
from services.stats import mean_by_key

log = logging.getLogger(__name__)

GENERATED = Counter("tandem_learner_generated_rows_total", "Rows a generate job wrote", ["job", "dataset"])
DATASETS = {
    "sft": "conversations of the best responses: {messages, example, task_id, task metrics}",
    "pairs": "per turn, the best and the worst response by MR: {context_ids, chosen_ids, rejected_ids, "
    "chosen_score, rejected_score, turn, example, task_id, context, chosen_text, rejected_text}",
}
LEDGER = "written.jsonl"
"""In the run folder: one line per committed batch (`DatasetFiles.append`)."""


def group_rows(group: protocol.TrajectoryGroup, example: int, margin: float) -> tuple[dict | None, list[dict], int]:
    """A ranked conversation's SFT row (None if a turn was malformed), its pair rows, and
    how many of its turns gave no pair (best and worst closer than `margin`)."""
    turns: dict[int, list[int]] = {}
    for index, sample in enumerate(group.samples):
        turns.setdefault(int(sample.metrics.get("turn", 0)), []).append(index)
    text = {s.sample_id: t for s, t in zip(group.samples, group.responses)}
    pairs, without = [], 0
    for turn, indices in sorted(turns.items()):
        picked = pair_picking.pick_pair([group.samples[i] for i in indices], margin)
        if picked is None or not all(1 in s.mask for s in picked):
            without += 1
            continue
        chosen, rejected = picked
        start = chosen.mask.index(1)
        context = group.conversation[: int(chosen.metrics.get("context_messages", 0))]
        pairs.append(
            preference.pair_row(
                chosen.tokens[:start],
                chosen,
                rejected,
                turn=turn,
                example=example,
                task_id=group.task_id,
                context=context,
                chosen_text=text.get(chosen.sample_id, ""),
                rejected_text=text.get(rejected.sample_id, ""),
            )
        )
    sft = None
    if group.conversation_metrics.get("well_formed", 0.0) == 1.0:
        sft = {
            "messages": group.conversation,
            "example": example,
            "task_id": group.task_id,
            **{k: v for k, v in group.conversation_metrics.items() if k != "well_formed"},
        }
    return sft, pairs, without


def complete_lines(path: Path) -> list[dict]:
    """The JSON lines of `path` that were written whole; a torn last line (a write a kill
    cut short, with no newline) is cut off the file. A missing file holds none."""
    if not path.exists():
        return []
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    return [json.loads(line) for line in whole.splitlines()]


def append_synced(path: Path, lines: list[str]) -> int:
    """Append `lines` to `path`, on disk when this returns; the file's size after them."""
    with open(path, "ab") as f:
        f.write("".join(lines).encode())
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


class DatasetFiles:
    """A generate job's output files and the ledger that says how much of them is
    committed: what a resumed run trusts."""

    def __init__(self, run_dir: Path) -> None:
        folder = run_dir / "dataset"
        self.paths = {name: folder / f"{name}.jsonl" for name in DATASETS}
        self.ledger = run_dir / LEDGER
        self.rows = dict.fromkeys(DATASETS, 0)
        """Committed rows per file."""
        self.task_ids: set[int] = set()
        """Tasks whose rows are committed (a task may have none)."""
        self.dispatcher: dict | None = None
        """The dispatcher's state at the last commit (None: no commit yet)."""

    def start(self) -> None:
        """A fresh run: every file empty."""
        self.paths["sft"].parent.mkdir(parents=True, exist_ok=True)
        for path in (*self.paths.values(), self.ledger):
            path.write_bytes(b"")

    def recover(self) -> None:
        """A resumed run: the committed state, each file cut back to its committed size
        (what follows belongs to a batch whose groups were never acknowledged)."""
        self.paths["sft"].parent.mkdir(parents=True, exist_ok=True)
        entries = complete_lines(self.ledger)
        none_yet = {"bytes": dict.fromkeys(DATASETS, 0), "rows": self.rows, "dispatcher": None}
        last: dict = entries[-1] if entries else none_yet
        for name, path in self.paths.items():
            with open(path, "a+b") as f:
                f.truncate(last["bytes"][name])
        self.rows = dict(last["rows"])
        self.task_ids = {task_id for entry in entries for task_id in entry["task_ids"]}
        self.dispatcher = last["dispatcher"]

    def append(self, rows: dict[str, list[dict]], task_ids: list[int], dispatcher: dict) -> None:
        """The batch's rows on disk, then the ledger line that commits them; its groups may
        be acknowledged once this returns."""
        sizes = {name: append_synced(self.paths[name], [json.dumps(r) + "\n" for r in rows[name]]) for name in DATASETS}
        for name in DATASETS:
            self.rows[name] += len(rows[name])
        self.task_ids.update(task_ids)
        entry = {"task_ids": task_ids, "bytes": sizes, "rows": self.rows, "dispatcher": dispatcher}
        append_synced(self.ledger, [json.dumps(entry) + "\n"])


def generate_spec(spec: JobSpec) -> GenerateJob:
    """`spec`, a generate job's: its run and its dispatcher read its `generate` section."""
    if not isinstance(spec, GenerateJob):
        raise TypeError(f"a generate job's part given a {spec.kind} job")
    return spec


class AllAtOnce(Dispatcher):
    """A generate job's dispatcher: the policy never changes, so every task is admitted at once."""

    def __init__(self, client: aioredis.Redis, job_id: str, spec: JobSpec) -> None:
        super().__init__(client, job_id, spec)
        self.conversations = generate_spec(spec).generate.conversations

    def limit(self, version: int) -> int:
        return self.conversations


class GenerateRun(RolloutFedRun):
    """Rollout servers' ranked conversations in, dataset rows out; no training."""

    dispatcher_class = AllAtOnce
    spec: GenerateJob

    def __init__(self, learner: Learner, job_id: str, spec: JobSpec) -> None:
        super().__init__(learner, job_id, generate_spec(spec))

    async def run(self, resuming: bool = False) -> None:
        self.make_run_dir()
        self.files = DatasetFiles(self.run_dir)
        self.files.recover() if resuming else self.files.start()
        trajectories = await self.trajectories()
        self.intake = BatchIntake(
            self.job_id, self.spec.train, trajectories, self.dispatcher, Acks(trajectories, deferred=False)
        )
        if resuming:
            await self.resume()
        await self.start_policy(resuming)
        await self.publish_datasets()
        await self.publisher.wait_for_servers(self.check_waiting)
        await self.publisher.publish(self.version)
        await self.intake.read_backlog()
        await self.cost.begin(len(self.files.task_ids))
        self.steps.start_rl()
        total = self.spec.generate.conversations
        with contextlib.suppress(SpendCapReached):  # the proxy refuses its calls: keep what is written
            while len(self.files.task_ids) < total:
                await self.check_cancel()
                waited = time.monotonic()
                size = min(self.spec.train.batch_size, total - len(self.files.task_ids))
                batch = await self.intake.collect(self.version, self.waiting_for_groups, size=size)
                await self.write(batch, time.monotonic() - waited)
        if len(self.files.task_ids) < total:
            self.ended_early = await self.cost.reason(len(self.files.task_ids), total)

    async def resume(self) -> None:
        """Continue from the files' last commit: its tasks are done, and the dispatcher
        goes on from its state then, past every task already in the stream."""
        self.intake.ledger.trained = set(self.files.task_ids)
        if self.files.dispatcher is not None:
            self.dispatcher.load_state(self.files.dispatcher)
        await self.dispatcher.skip_dispatched(self.version)
        log.info("resuming generate job %s: %d conversations written", self.job_id, len(self.files.task_ids))

    async def start_policy(self, resuming: bool) -> None:
        """The policy that plays the conversations: the warm start's, kept as the step-0
        checkpoint so that a resumed run plays with the same weights. The checkpoint is
        written before any task is dispatched; a run stopped before it starts over."""
        if not self.spec.warm_start.steps:
            return
        path = checkpoint.checkpoint_dir(self.settings.runs_dir, self.job_id, 0)
        if resuming and path == checkpoint.latest(self.settings.runs_dir, self.job_id):
            self.worker.run(Command(kind="load", path=str(path)))
            return
        if resuming:
            await self.steps.trim(0)  # the cut-short warm start's records
        await self.warm_start()
        self.worker.run(Command(kind="save", path=str(path), meta_json=json.dumps({"step": 0, "version": 0})))

    async def write(self, batch: list, wait_s: float) -> None:
        """The batch's rows committed to the files, then its entries acknowledged, the
        streams trimmed of what every reader has acknowledged, and a history record."""
        groups: list[protocol.TrajectoryGroup] = [d.message for d in batch]
        rows: dict[str, list[dict]] = {name: [] for name in DATASETS}
        without = 0
        for group in groups:
            sft, pairs, missing = group_rows(
                group, self.dispatcher.example(group.task_id), self.spec.generate.pair_margin
            )
            rows["sft"] += [sft] if sft else []
            rows["pairs"] += pairs
            without += missing
        await asyncio.to_thread(self.files.append, rows, [g.task_id for g in groups], self.dispatcher.state())
        for name in DATASETS:
            GENERATED.labels(self.job_id, name).inc(len(rows[name]))
        await self.publish_datasets()
        await self.intake.trained_on(batch)
        for stream in (Keys.tasks(self.job_id), Keys.trajectories(self.job_id)):
            await retention.trim_acked(self.redis, stream)
        done = len(self.files.task_ids)
        spreads = [p["chosen_score"] - p["rejected_score"] for p in rows["pairs"]]
        record = {
            "phase": "generate",
            "step": done,
            "version": self.version,
            "conversations": done,
            "sft_rows": self.files.rows["sft"],
            "pairs": self.files.rows["pairs"],
            "turns_without_pair": without,
            "pair_score_gap_mean": sum(spreads) / max(len(spreads), 1),
            "responses": sum(len(g.samples) for g in groups),
            "rollout_seconds_mean": sum(g.elapsed_s for g in groups) / len(groups),
            **mean_by_key([g.conversation_metrics for g in groups]),
            **self.steps.waited(wait_s),
            **await self.cost.after_step(done, groups, self.spec.generate.conversations),
        }
        await self.steps.write(record, done, self.version)

    async def checkpoint(self, stopping: bool = False) -> None:
        """Nothing more to keep, a stop's included: every committed batch is on disk
        (`DatasetFiles`), and the warm start's policy is the step-0 checkpoint."""

    async def publish_datasets(self) -> None:
        await self.redis.hset(
            Keys.datasets(self.job_id),
            mapping={
                name: json.dumps(
                    {
                        "path": str(Path(path).resolve()),
                        "rows": self.files.rows[name],
                        "description": DATASETS[name],
                    }
                )
                for name, path in self.files.paths.items()
            },
        )
