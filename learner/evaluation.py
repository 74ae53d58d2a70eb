"""Held-out evaluation inside an RL job, on rank 0: rounds asked, results read, one record each.

A round is the policy of one version evaluated on every held-out example (`services.held_out`)
`eval.trials` times. The learner asks for one at version 0 (the warm start), every
`eval.every` steps and at the end: one `EvalTask` per example and trial on the job's eval
tasks stream. It asks each round once: the round's entry in `eval:rounds` is set with HSETNX,
so a resumed run that trains through the step again asks nothing more. Rollout servers play
the conversations beside the training tasks (`rollout.server.ServedJob.play_eval`), with
whatever weights they hold when each turn is generated: a round's record says which versions
its tokens came from.

The learner reads results from a cursor whenever it takes a step or waits. A round whose
every conversation is in (or lost: its entry went to the dead stream) becomes a record in the
job's history (`phase: eval`), its metrics and the job record's `held_out`. The state is the
streams themselves: a resumed run reads them again from the start, skipping the rounds its
history already holds. After the last step the job waits for the rounds still out, for at
most `eval.timeout_s`; what is in by then is recorded, marked incomplete.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable

import msgspec
import redis.asyncio as aioredis
from prometheus_client import Gauge

from learner.step_log import StepLog
from services import jobs, protocol
from services.config import JobSpec
from services.held_out import Round, held_out, round_record
from services.queues import FIELD, Keys
from services.redis_values import raw, stream_entries

log = logging.getLogger(__name__)

HELD_OUT = Gauge(
    "tandem_eval_metric", "The latest held-out evaluation's mean, by metric (success, tokens, ...)", ["job", "metric"]
)
HELD_OUT_STEP = Gauge("tandem_eval_step", "The step (policy version) the latest held-out evaluation is of", ["job"])
READ_COUNT = 1000
"""Results read per round trip."""
WAIT_POLL_S = 0.5
"""How often the final wait reads the results."""


def shares(spend: dict[str, float]) -> dict[str, float]:
    """The evaluation's share, job so far, of the rollout servers' conversation-seconds (a
    conversation's wall time; a trained group's counts once per sample, since its samples
    are played side by side) and of the judge and simulator tokens (held-out conversations
    against trained groups)."""
    seconds = spend["eval_rollout_seconds"] + spend["rollout_seconds"]
    tokens = spend["eval_llm_tokens"] + spend["llm_tokens"]
    return {
        "eval_share_rollout_seconds": spend["eval_rollout_seconds"] / seconds if seconds else 0.0,
        "eval_share_llm_tokens": spend["eval_llm_tokens"] / tokens if tokens else 0.0,
    }


def tracked_rows(round_: Round, count: int) -> list[dict]:
    """The round's first `count` conversations (by example and trial), for the trackers' table."""
    kept = sorted(round_.results.values(), key=lambda r: (r.example, r.trial))[:count]
    return [
        {
            "example": r.example,
            "trial": r.trial,
            "success": r.metrics.get("success", 0.0),
            "conversation": r.conversation,
        }
        for r in kept
    ]


class ResultReader:
    """Reads a job's held-out results and lost conversations from cursors into its rounds."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        self.redis, self.job_id = client, job_id
        self.cursor = "0-0"
        self.dead_cursor = "0-0"
        self.received = 0
        """Results read: progress, for the watchdog, while the job waits for them."""

    async def read(self, rounds: dict[int, Round]) -> None:
        """Every new result into its round; every conversation lost to the dead stream too."""
        while entries := await self.redis.xrange(
            Keys.eval_results(self.job_id), min=f"({self.cursor}", count=READ_COUNT
        ):
            for entry_id, fields in stream_entries(entries):
                self.cursor = entry_id
                self.take(raw(fields.get(FIELD, b"")), rounds)
        stream = Keys.eval_tasks(self.job_id).encode()
        while entries := await self.redis.xrange(Keys.dead(self.job_id), min=f"({self.dead_cursor}", count=READ_COUNT):
            for entry_id, fields in stream_entries(entries):
                self.dead_cursor = entry_id
                ours = fields.get(b"stream") == stream
                task = decoded(raw(fields.get(FIELD, b"")), protocol.EvalTask) if ours else None
                if task is not None and task.round in rounds:
                    rounds[task.round].lost.add((task.example, task.trial))

    def take(self, data: bytes, rounds: dict[int, Round]) -> None:
        result = decoded(data, protocol.EvalResult)
        if result is None:
            log.warning("job %s: an eval result that does not decode, skipped", self.job_id)
            return
        round_ = rounds.get(result.round)
        if round_ is None or result.job_id != self.job_id:
            return
        self.received += 1
        if not all(math.isfinite(value) for value in result.metrics.values()):  # would poison the means
            log.warning("job %s: a held-out result with a non-finite metric, counted as lost", self.job_id)
            round_.lost.add((result.example, result.trial))
            return
        round_.results[(result.example, result.trial)] = result


def decoded(data: bytes, kind: type):
    """The message, or None when the bytes are not one."""
    try:
        return protocol.decode(data, kind)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None


class HeldOutEvaluation:
    """One RL job's evaluation rounds (the module's docstring says how they go); a job
    without `eval` has none, and each method then does nothing."""

    def __init__(self, client: aioredis.Redis, job_id: str, spec: JobSpec, steps: StepLog) -> None:
        self.redis, self.job_id, self.steps = client, job_id, steps
        self.spec = spec.evaluation()
        self.examples = held_out(spec).examples if self.spec is not None else ()
        self.num_steps = spec.train.num_steps
        self.rounds: dict[int, Round] = {}
        """Rounds asked for and not yet recorded, by step."""
        self.recorded: set[int] = set()
        self.reader = ResultReader(client, job_id)
        self.spend = {"eval_rollout_seconds": 0.0, "eval_llm_tokens": 0.0, "rollout_seconds": 0.0, "llm_tokens": 0.0}
        """What held-out rounds and trained groups took, job so far: the evaluation's share."""

    @property
    def received(self) -> int:
        return self.reader.received

    # ---- asking --------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether the policy of `step` is evaluated."""
        if self.spec is None:
            return False
        if step == self.num_steps:
            return self.spec.final or (self.spec.every > 0 and step % self.spec.every == 0)
        return self.spec.every > 0 and step % self.spec.every == 0

    async def ask(self, step: int) -> None:
        """Ask for the round of `step`'s policy if it is due and was never asked for."""
        spec = self.spec
        if spec is None or not self.due(step) or step in self.recorded or step in self.rounds:
            return
        expected = len(self.examples) * spec.trials
        entry = json.dumps({"expected": expected, "asked": time.time()})
        if not await self.redis.hsetnx(Keys.eval_rounds(self.job_id), str(step), entry):
            await self.load_rounds()  # asked by the run before a restart: awaited, not asked again
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for trial in range(spec.trials):
                for example in self.examples:
                    task = protocol.EvalTask(job_id=self.job_id, round=step, example=example, trial=trial)
                    pipe.xadd(Keys.eval_tasks(self.job_id), {FIELD: protocol.encode(task)})
            await pipe.execute()
        self.rounds[step] = Round(step, expected, time.time())
        log.info("job %s: held-out evaluation of step %d asked for (%d conversations)", self.job_id, step, expected)

    async def load_rounds(self) -> None:
        """The rounds asked for (by this run or one before it) that its history lacks."""
        for field, value in (await self.redis.hgetall(Keys.eval_rounds(self.job_id))).items():
            step = int(field)
            if step not in self.recorded and step not in self.rounds:
                entry = json.loads(value)
                self.rounds[step] = Round(step, entry["expected"], entry["asked"])

    async def resume(self, spend: dict | None) -> None:
        """After the run's history was trimmed to its checkpoint, whose `spend` it takes: the
        rounds the history holds are done, every other asked round is awaited, and the
        results are read again from the start."""
        self.spend.update(spend or {})
        if self.spec is None:
            return
        # The run folder's file, not Redis: Redis keeps only the newest records of a long job.
        lines = self.steps.path.read_text().splitlines() if self.steps.path.exists() else []
        self.recorded = {r["step"] for r in map(json.loads, lines) if r.get("phase") == "eval"}
        self.rounds, self.reader = {}, ResultReader(self.redis, self.job_id)
        await self.load_rounds()

    # ---- results -------------------------------------------------------------------

    async def after_step(self, step: int, groups: list[protocol.TrajectoryGroup]) -> None:
        """After RL step `step` trained `groups`: its round if due, and the results in so far."""
        self.observe_training(groups)
        await self.ask(step)
        await self.collect()

    def observe_training(self, groups: list[protocol.TrajectoryGroup]) -> None:
        """Count a step's trained groups into what training took, for the evaluation's share."""
        self.spend["rollout_seconds"] += sum(g.elapsed_s * len(g.samples) for g in groups)
        self.spend["llm_tokens"] += sum(
            s.metrics.get("judge_tokens", 0.0) + s.metrics.get("simulator_tokens", 0.0)
            for g in groups
            for s in g.samples
        )

    async def collect(self) -> None:
        """Read the new results and lost entries; record every round that is done."""
        if not self.rounds:
            return
        await self.reader.read(self.rounds)
        for step in sorted(self.rounds):
            if self.rounds[step].done():
                await self.record(self.rounds.pop(step), complete=True)

    async def record(self, round_: Round, complete: bool) -> None:
        if self.spec is None:
            raise RuntimeError("a held-out round is recorded only for a job with eval")
        record = round_record(round_, self.spec.trials, complete)
        self.spend["eval_rollout_seconds"] += record["rollout_seconds"]
        self.spend["eval_llm_tokens"] += record["llm_tokens"]
        record |= shares(self.spend)
        rows = tracked_rows(round_, self.steps.trackers.conversations_kept)
        await self.steps.write_eval(record, rows)
        self.recorded.add(round_.step)
        HELD_OUT_STEP.labels(self.job_id).set(round_.step)
        for name, value in record.items():
            if isinstance(value, float) and name not in ("seconds",):
                HELD_OUT.labels(self.job_id, name).set(value)
        summary = {k: v for k, v in record.items() if k not in ("phase", "time")}
        await jobs.record_held_out(self.redis, self.job_id, summary)
        log.info(
            "job %s: held-out step %d: success %.3f over %d conversations%s",
            self.job_id,
            round_.step,
            record.get("success", float("nan")),
            record["episodes"],
            "" if complete else " (incomplete)",
        )

    async def finish(self, waiting: Callable[[], Awaitable[None]], wait: bool = True) -> None:
        """Wait for every round still out, for at most `eval.timeout_s` (not at all without
        `wait`: a spend cap refuses their calls), calling `waiting` between reads (cancels,
        stops, the watchdog); record what is in by then."""
        if self.spec is None:
            return
        deadline = time.monotonic() + (self.spec.timeout_s if wait else 0.0)
        await self.collect()
        while self.rounds and time.monotonic() < deadline:
            await waiting()
            await asyncio.sleep(WAIT_POLL_S)
            await self.collect()
        for step in sorted(self.rounds):
            round_ = self.rounds.pop(step)
            log.warning(
                "job %s: held-out evaluation of step %d incomplete after eval.timeout_s %.0f s: %d of %d in",
                self.job_id,
                step,
                self.spec.timeout_s,
                len(round_.results),
                round_.expected,
            )
            await self.record(round_, complete=False)
