"""`tandem eval --job JOB [--step N]` and `tandem eval MODEL --spec FILE`: a policy on a job's
held-out examples, whatever the task.

The job's spec (its `runs/<job>/job.json`, or a spec file) says the task, the rollout limits,
the judge rubric and the `eval` section (its defaults when the spec has none; `--examples`
and `--trials` override it); the policy runs on this process's own engine: the job's final
policy (`runs/<job>/policy`), one it exported at a step (`policies/step-N`), or any HF folder.
The conversations are played and scored by the code a rollout server runs for a job's
evaluation rounds (`rollout.assembly`, `rollout.evaluate.HeldOutPlayer`) and summed up the
same way (`services.held_out.round_record`): the JSON's `held_out` is the record a job's
history holds for that policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from services import protocol
from services.config import (
    EvalSpec,
    GenerateJob,
    OfflineJob,
    RLJob,
    RolloutSettings,
    parse_job_spec,
    parse_job_spec_json,
)
from services.held_out import Round, held_out, round_record

SUMMARY = ("success", "well_formed", "asked", "judge", "tokens", "turns", "tool_calls")
"""The means the table shows, where the task has them."""


def job_policy(runs_dir: Path, job_id: str, step: int | None) -> tuple[RLJob, Path]:
    """A finished job's spec and its policy after `step` (None: the final one); SystemExit
    naming what to do when the folder is not there."""
    if "/" in job_id or job_id in ("", ".", ".."):
        sys.exit(f"tandem eval: {job_id!r} is not a job id")
    folder = runs_dir / job_id
    if not (folder / "job.json").is_file():
        sys.exit(f"tandem eval: no job {job_id} in {runs_dir} (--runs-dir, or $TANDEM_RUNS_DIR)")
    spec = rl_only(parse_job_spec_json((folder / "job.json").read_text()), str(folder / "job.json"))
    policy = folder / "policy" if step is None else folder / "policies" / f"step-{step:06d}"
    if not (policy / "config.json").is_file():
        sys.exit(
            f"tandem eval: {policy} is not there: the job exports its policy at train.export_every steps and at "
            f"its end; `tandem export {job_id} --step {step} DIR` makes one from a checkpoint, then "
            f"`tandem eval DIR --spec {folder / 'job.json'}`"
        )
    return spec, policy


def rl_only(spec: RLJob | OfflineJob | GenerateJob, path: str) -> RLJob:
    """The job spec read from the file at `path`, an RL job's; SystemExit for another kind."""
    if not isinstance(spec, RLJob):
        sys.exit(f"tandem eval: {path} is a {spec.kind} job; only an RL job's task is evaluated")
    return spec


def with_overrides(spec: RLJob, policy: Path, examples: int | None, trials: int | None) -> tuple[RLJob, EvalSpec]:
    """`spec` serving `policy`, with its `eval` section (the defaults when it has none) and
    the command line's examples and trials over it; and that section."""
    evaluation = (spec.eval or EvalSpec()).model_copy(
        update={k: v for k, v in {"examples": examples, "trials": trials}.items() if v}
    )
    model = spec.model.model_copy(update={"path": str(policy)})
    return spec.model_copy(update={"model": model, "eval": evaluation}), evaluation


async def evaluate_policy(spec: RLJob, trials: int, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Every held-out example `trials` times (the spec's `eval.trials`): the round's record
    and each conversation."""
    from rollout.assembly import assemble, check_sandbox, held_out_player
    from rollout.engine import Engine
    from rollout.tau2_eval import progress
    from services.judge_client import JudgeClient
    from services.tool_catalog import load_catalog

    settings = RolloutSettings()
    await check_sandbox(spec)
    engine = await asyncio.to_thread(Engine.start, spec.model, args.kv_cache_gib, spec.train.seed)
    client = JudgeClient(args.judge_url, token=args.judge_token)
    job_id = f"eval-{Path(spec.model.path).name}"
    try:
        catalog = load_catalog(settings.tool_catalog)
        played = await assemble(engine, spec, job_id, client, catalog, settings.allow_inline_mcp)
        player = await held_out_player(played, spec, job_id, client, "tandem-eval")
        tasks = [
            protocol.EvalTask(job_id=job_id, round=args.step or 0, example=example, trial=trial)
            for trial in range(trials)
            for example in held_out(spec).examples
        ]
        round_ = Round(args.step or 0, len(tasks), time.time())
        slots = asyncio.Semaphore(args.concurrency)

        async def one(task: protocol.EvalTask) -> None:
            async with slots:
                result = await asyncio.create_task(player.play(task))
            round_.results[(task.example, task.trial)] = result
            progress(len(round_.results), len(tasks), spec.task.name)

        await asyncio.gather(*(one(task) for task in tasks))
    finally:
        await client.aclose()
        engine.shutdown()
    rows = [
        {"example": r.example, "trial": r.trial, "metrics": r.metrics, "conversation": r.conversation}
        for r in sorted(round_.results.values(), key=lambda r: (r.example, r.trial))
    ]
    record = round_record(round_, trials, complete=True)
    return {k: v for k, v in record.items() if k not in ("phase", "seconds")}, rows


def table(task: str, record: dict, trials: int) -> str:
    shown = [name for name in SUMMARY if name in record] + [f"pass^{k}" for k in range(2, trials + 1)]
    head = ["task", "conversations", *shown]
    cells = [task, str(record["episodes"]), *(f"{record[name]:.3f}" for name in shown)]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(cells) + " |"])


def main(args: argparse.Namespace, spec_data: dict | None = None) -> None:
    """`spec_data`: the spec file's content, when the policy comes with one (`--spec`); None
    when `--job` names both."""
    if spec_data is None:
        spec, policy = job_policy(Path(args.runs_dir), args.job, args.step)
    else:
        spec, policy = rl_only(parse_job_spec(spec_data), args.spec), Path(args.model)
        if not (policy / "config.json").is_file():
            sys.exit(f"tandem eval: {policy} is not a model folder")
    spec, evaluation = with_overrides(spec, policy, args.examples, args.trials)
    record, rows = asyncio.run(evaluate_policy(spec, evaluation.trials, args))
    report = {
        "policy": str(policy),
        "job": args.job,
        "step": args.step,
        "task": spec.task.model_dump(),
        "eval": evaluation.model_dump(),
        "held_out": record,
        "conversations": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(spec.task.name, record, evaluation.trials))
