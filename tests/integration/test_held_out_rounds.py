"""The learner's held-out rounds on real Redis: asked once, recorded once with hand-checked
means and pass^k, a lost conversation ends its round, a resumed run records what its
history lost, and the final wait has a deadline."""

from __future__ import annotations

import json

from learner.evaluation import HeldOutEvaluation
from learner.step_log import StepLog
from services import jobs, protocol
from services.config import parse_job_spec
from services.held_out import pass_hat_k
from services.queues import FIELD, Keys, publish

JOB = "evals-0123abcd"


def spec(**evaluation):
    return parse_job_spec(
        {
            "model": {"path": "/models/tiny"},
            "task": {"name": "clarify", "num_examples": 64},
            "train": {"num_steps": 4},
            "eval": {"every": 2, "examples": 3, "trials": 2} | evaluation,
        }
    )


async def job_record(redis_client, job_spec) -> None:
    await redis_client.hset(Keys.job(JOB), mapping={"spec": job_spec.model_dump_json(), "status": "RUNNING"})


def result(step: int, example: int, trial: int, success: float, tokens: float = 10.0) -> protocol.EvalResult:
    return protocol.EvalResult(
        job_id=JOB,
        round=step,
        example=example,
        trial=trial,
        server_id="s",
        metrics={"success": success, "tokens": tokens, "judge_tokens": 5.0},
        versions=[step, step + 1],
        elapsed_s=2.0,
    )


async def asked(redis_client) -> list[protocol.EvalTask]:
    entries = await redis_client.xrange(Keys.eval_tasks(JOB))
    return [protocol.decode(fields[FIELD], protocol.EvalTask) for _, fields in entries]


async def history(redis_client) -> list[dict]:
    return [json.loads(r) for r in await redis_client.lrange(Keys.history(JOB), 0, -1)]


def test_pass_hat_k_against_hand_numbers():
    # 2 trials; one example passes both, one passes one, one none: pass^1 = 3/6, pass^2 = 1/3.
    assert pass_hat_k([2, 1, 0], 2, 1) == 0.5
    assert pass_hat_k([2, 1, 0], 2, 2) == 1 / 3
    # 4 trials, 3 successes: C(3,2)/C(4,2) = 3/6.
    assert pass_hat_k([3], 4, 2) == 0.5


async def test_a_round_is_asked_once_and_recorded_with_its_means(redis_client, tmp_path):
    job_spec = spec()
    await job_record(redis_client, job_spec)
    evaluation = HeldOutEvaluation(redis_client, JOB, job_spec, StepLog(redis_client, JOB, tmp_path, []))
    assert [evaluation.due(s) for s in range(5)] == [True, False, True, False, True]

    await evaluation.ask(0)
    await evaluation.ask(0)  # asked already: nothing more
    await evaluation.ask(1)  # not due
    tasks = await asked(redis_client)
    assert sorted((t.round, t.example, t.trial) for t in tasks) == [(0, e, t) for e in range(3) for t in range(2)]

    successes = {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 0.0, (2, 0): 0.0, (2, 1): 0.0}
    for (example, trial), success in successes.items():
        await publish(redis_client, Keys.eval_results(JOB), result(0, example, trial, success))
    await publish(redis_client, Keys.eval_results(JOB), result(0, 0, 0, 1.0))  # played twice: counted once
    sample = protocol.Sample(
        sample_id="x",
        tokens=[1],
        mask=[1],
        logprobs=[-1.0],
        versions=[0],
        reward=0.0,
        advantage=0.0,
        num_turns=1,
        metrics={"judge_tokens": 30.0, "simulator_tokens": 15.0},
    )
    # A trained group of two conversations played side by side for 9 s: 18 conversation-seconds.
    group = protocol.TrajectoryGroup(job_id=JOB, task_id=0, server_id="s", elapsed_s=9.0, samples=[sample, sample])
    evaluation.observe_training([group])
    await evaluation.collect()

    (record,) = await history(redis_client)
    assert record["phase"] == "eval" and record["step"] == 0 and record["complete"]
    assert record["episodes"] == 6 and record["lost"] == 0
    assert record["success"] == 0.5 and record["pass^1"] == 0.5 and record["pass^2"] == 1 / 3
    assert (record["versions_min"], record["versions_max"]) == (0, 1)
    # 6 conversations of 2 s against 18 conversation-seconds; 6 x 5 judge tokens against 2 x 45.
    assert record["eval_share_rollout_seconds"] == 12.0 / 30.0
    assert record["eval_share_llm_tokens"] == 30.0 / 120.0
    kept = (await jobs.get_job(redis_client, JOB))["held_out"]
    assert kept["step"] == 0 and kept["success"] == 0.5
    await evaluation.ask(0)  # recorded: never asked again
    assert len(await asked(redis_client)) == 6


async def test_a_lost_conversation_ends_its_round_and_a_resumed_run_records_what_its_history_lost(
    redis_client, tmp_path
):
    job_spec = spec(trials=1)
    await job_record(redis_client, job_spec)
    steps = StepLog(redis_client, JOB, tmp_path, [])
    first = HeldOutEvaluation(redis_client, JOB, job_spec, steps)
    await first.ask(0)
    for example in (0, 1):
        await publish(redis_client, Keys.eval_results(JOB), result(0, example, 0, 1.0))
    lost = protocol.EvalTask(job_id=JOB, round=0, example=2, trial=0)
    await redis_client.xadd(
        Keys.dead(JOB), {b"stream": Keys.eval_tasks(JOB), b"reason": b"bad", FIELD: protocol.encode(lost)}
    )
    await first.collect()
    (record,) = await history(redis_client)
    assert (record["episodes"], record["lost"], record["success"]) == (2, 1, 1.0)

    # Round 2 asked and recorded, then a crash; the checkpoint covered only round 0's record.
    await first.ask(2)
    for example in range(3):
        await publish(redis_client, Keys.eval_results(JOB), result(2, example, 0, 0.0))
    await first.collect()
    assert [r["step"] for r in await history(redis_client)] == [0, 2]
    await steps.trim(1)

    resumed = HeldOutEvaluation(redis_client, JOB, job_spec, steps)
    await resumed.resume(None)
    await resumed.ask(2)  # asked by the lost run: awaited, not asked again
    assert len(await asked(redis_client)) == 6
    await resumed.collect()
    assert [(r["step"], r["success"]) for r in await history(redis_client)] == [(0, 1.0), (2, 0.0)]


async def test_the_final_wait_ends_at_its_deadline_with_what_came_in(redis_client, tmp_path):
    job_spec = spec(trials=1, timeout_s=0.3)
    await job_record(redis_client, job_spec)
    evaluation = HeldOutEvaluation(redis_client, JOB, job_spec, StepLog(redis_client, JOB, tmp_path, []))
    await evaluation.ask(4)
    await publish(redis_client, Keys.eval_results(JOB), result(4, 0, 0, 1.0))
    waits = []

    async def waiting() -> None:
        waits.append(1)

    await evaluation.finish(waiting)
    (record,) = await history(redis_client)
    assert record["step"] == 4 and not record["complete"] and record["episodes"] == 1
    assert waits  # the wait ran the job's checks between reads


async def test_a_result_with_a_non_finite_metric_another_jobs_or_garbage_poisons_no_mean(redis_client, tmp_path):
    job_spec = spec(trials=1)
    await job_record(redis_client, job_spec)
    evaluation = HeldOutEvaluation(redis_client, JOB, job_spec, StepLog(redis_client, JOB, tmp_path, []))
    await evaluation.ask(0)
    await publish(redis_client, Keys.eval_results(JOB), result(0, 0, 0, 1.0))
    await publish(redis_client, Keys.eval_results(JOB), result(0, 1, 0, float("nan")))
    await publish(redis_client, Keys.eval_results(JOB), result(0, 2, 0, 0.0, tokens=float("inf")))
    foreign = protocol.EvalResult(
        **{**protocol.msgspec.structs.asdict(result(0, 2, 0, 0.0)), "job_id": "other-0123abcd"}
    )
    await publish(redis_client, Keys.eval_results(JOB), foreign)
    await redis_client.xadd(Keys.eval_results(JOB), {FIELD: b"\xc1 not msgpack"})
    await evaluation.collect()

    (record,) = await history(redis_client)
    assert (record["episodes"], record["lost"], record["success"], record["tokens"]) == (1, 2, 1.0, 10.0)
    assert json.loads(json.dumps(record, allow_nan=False)) == record  # nothing a JSON reader refuses
