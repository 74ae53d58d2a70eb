"""A generate job (`kind: generate`): CollabLLM's MR-ranked synthetic data.

The rollout servers play the conversations (`GroupRollout.ranked_conversation`: at each
assistant turn `group_size` responses scored by MR, the best carries on); this run writes
what they bring, a batch at a time, into the job's `dataset/` folder:

    sft.jsonl    {"messages", "example", "task_id", <the task's metrics>}: the conversations
                 of best responses, well-formed ones only (a warm start's `data`)
    pairs.jsonl  per turn, the best and the worst response when their MR differs by at
                 least `generate.pair_margin` (`services.preference`; an offline job's
                 `train.data`), with the context and both responses as text too

Both are listed in `job:{id}:datasets` (the API's `/datasets`) with their row counts. The
policy never changes, so every task is admitted at once and sampled by version 0. A
generate job does not resume: a learner restarted with `--resume` fails it, and the rows
written so far stay on disk.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prometheus_client import Counter

from learner.dispatcher import Dispatcher
from learner.intake import Acks, BatchIntake
from learner.runs.rollout_fed import RolloutFedRun
from learner import pairs as pair_picking
from services import preference, protocol
from services.queues import Keys
from services.stats import mean_by_key

GENERATED = Counter("tandem_learner_generated_rows_total", "Rows a generate job wrote", ["job", "dataset"])
DATASETS = {
    "sft": "conversations of the best responses: {messages, example, task_id, task metrics}",
    "pairs": "per turn, the best and the worst response by MR: {context_ids, chosen_ids, rejected_ids, "
    "chosen_score, rejected_score, turn, example, task_id, context, chosen_text, rejected_text}",
}


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


class AllAtOnce(Dispatcher):
    """A generate job's dispatcher: the policy never changes, so every task is admitted at once."""

    def limit(self, version: int) -> int:
        return self.spec.generate.conversations


class GenerateRun(RolloutFedRun):
    """Rollout servers' ranked conversations in, dataset rows out; no training."""

    dispatcher_class = AllAtOnce

    async def run(self, resuming: bool = False) -> None:
        if resuming:
            raise RuntimeError(
                f"a generate job does not resume; submit it again (the rows written so far are in "
                f"{self.run_dir / 'dataset'})"
            )
        folder = self.run_dir / "dataset"
        folder.mkdir(parents=True, exist_ok=True)
        self.files = {name: folder / f"{name}.jsonl" for name in DATASETS}
        for path in self.files.values():
            path.write_text("")
        self.counts_written = dict.fromkeys(DATASETS, 0)
        trajectories = await self.trajectories()
        self.intake = BatchIntake(
            self.job_id, self.spec.train, trajectories, self.dispatcher, Acks(trajectories, deferred=False)
        )
        await self.warm_start()
        await self.publish_datasets()
        await self.publisher.wait_for_servers(self.check_waiting)
        await self.publisher.publish(self.version)
        self.steps.start_rl()
        total, done = self.spec.generate.conversations, 0
        while done < total:
            await self.check_cancel()
            waited = time.monotonic()
            batch = await self.intake.collect(
                self.version, self.while_waiting, size=min(self.spec.train.batch_size, total - done)
            )
            done += len(batch)
            await self.write(batch, done, time.monotonic() - waited)

    async def write(self, batch: list, done: int, wait_s: float) -> None:
        """The batch's rows appended to the files, its entries settled, a history record."""
        groups: list[protocol.TrajectoryGroup] = [d.message for d in batch]
        sft_rows, pair_rows, without = [], [], 0
        for group in groups:
            sft, pairs, missing = group_rows(
                group, self.dispatcher.example(group.task_id), self.spec.generate.pair_margin
            )
            sft_rows += [sft] if sft else []
            pair_rows += pairs
            without += missing
        for name, rows in (("sft", sft_rows), ("pairs", pair_rows)):
            with open(self.files[name], "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            self.counts_written[name] += len(rows)
            GENERATED.labels(self.job_id, name).inc(len(rows))
        await self.publish_datasets()
        await self.intake.trained_on(batch)
        spreads = [p["chosen_score"] - p["rejected_score"] for p in pair_rows]
        record = {
            "phase": "generate",
            "step": done,
            "version": self.version,
            "conversations": done,
            "sft_rows": self.counts_written["sft"],
            "pairs": self.counts_written["pairs"],
            "turns_without_pair": without,
            "pair_score_gap_mean": sum(spreads) / max(len(spreads), 1),
            "responses": sum(len(g.samples) for g in groups),
            "rollout_seconds_mean": sum(g.elapsed_s for g in groups) / len(groups),
            **mean_by_key([g.conversation_metrics for g in groups]),
            **self.steps.waited(wait_s),
        }
        await self.steps.write(record, done, self.version)

    async def checkpoint(self, stopping: bool = False) -> None:
        """Nothing to keep, a stop's included: the rows are on disk as they come, and the
        job does not resume."""

    async def publish_datasets(self) -> None:
        await self.redis.hset(
            Keys.datasets(self.job_id),
            mapping={
                name: json.dumps(
                    {
                        "path": str(Path(path).resolve()),
                        "rows": self.counts_written[name],
                        "description": DATASETS[name],
                    }
                )
                for name, path in self.files.items()
            },
        )
