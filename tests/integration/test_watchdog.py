"""The learner's watchdog on a real Redis: a job whose progress waits on something outside it
is PAUSED with the reason and RUNNING again when it is back; one that cannot progress fails
with a reason that names what the system saw, never waits in silence.

The watchdog reads the fleet's heartbeats, the job's record and its streams as the learner
does; its clock is a counter the test moves, so no bound here is a race against time.
"""

from __future__ import annotations

import time

import pytest

from learner.dispatcher import Dispatcher
from learner.driver import claim_job
from learner.publisher import WeightPublisher
from learner.watchdog import CHECK_EVERY_S, PAUSE_AFTER_S, JobStalled, Watchdog, dead_window
from services import jobs, protocol
from services.config import LearnerSettings, ModelSpec, RLJob, TrainSpec
from services.queues import FIELD, Keys

OUTAGE = "every upstream of model 'judge' is down: stand-in: connect_error ClientConnectorError (7 failures)"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Progress:
    """(steps, groups admitted) as a run reports them."""

    def __init__(self) -> None:
        self.steps, self.admitted = 0, 0

    def __call__(self) -> tuple[int, int]:
        return self.steps, self.admitted


def spec(**train) -> RLJob:
    return RLJob(
        name="watched",
        model=ModelSpec(path="/models/none"),
        train=TrainSpec(num_steps=10, batch_size=4, **train),
    )


async def running_job(client, job_spec: RLJob) -> str:
    job_id = await jobs.create_job(client, job_spec)
    assert await jobs.set_status(client, job_id, jobs.JobStatus.RUNNING)
    return job_id


async def heartbeat(client, job_id: str, server: str, waiting_on: str = "", age_s: float = 0.0) -> None:
    now = time.time()
    info = protocol.ServerInfo(
        server_id=server,
        heartbeat=now - age_s,
        job_id=job_id,
        waiting_on=waiting_on,
        waiting_since=now if waiting_on else 0.0,
    )
    await client.hset(Keys.rollout_servers, server, protocol.encode(info))


def watchdog_for(client, job_id: str, job_spec: RLJob, **settings) -> tuple[Watchdog, Clock, Progress, Dispatcher]:
    learner = LearnerSettings(**settings)
    clock, progress = Clock(), Progress()
    dispatcher = Dispatcher(client, job_id, job_spec)
    publisher = WeightPublisher(client, job_id, learner, worker=None)
    return (
        Watchdog(client, job_id, job_spec, learner, publisher, dispatcher, progress, clock),
        clock,
        progress,
        dispatcher,
    )


async def look(watchdog: Watchdog, clock: Clock, after_s: float = CHECK_EVERY_S) -> None:
    clock.advance(after_s)
    await watchdog.check()


async def test_a_server_waiting_on_a_judge_outage_pauses_the_job_with_the_reason_and_its_end_resumes_it(redis_client):
    job_spec = spec()
    job_id = await running_job(redis_client, job_spec)
    watchdog, clock, progress, _ = watchdog_for(redis_client, job_id, job_spec)
    await heartbeat(redis_client, job_id, "rollout-0")
    await watchdog.check()  # the first look starts the clock
    await heartbeat(redis_client, job_id, "rollout-0", waiting_on=OUTAGE)

    await look(watchdog, clock, after_s=PAUSE_AFTER_S / 2)  # a wait this short, nothing is paused yet
    assert (await jobs.get_job(redis_client, job_id))["status"] == "RUNNING"
    await look(watchdog, clock, after_s=PAUSE_AFTER_S / 2)
    paused = await jobs.get_job(redis_client, job_id)
    assert paused["status"] == "PAUSED"
    assert paused["paused_reason"] == OUTAGE
    assert watchdog.condition() == {"status": "degraded", "reason": f"paused: {OUTAGE}"}

    await look(watchdog, clock, after_s=LearnerSettings().judge_outage_s / 2)  # a long pause is no stall
    assert (await jobs.get_job(redis_client, job_id))["status"] == "PAUSED"

    await heartbeat(redis_client, job_id, "rollout-0")  # the upstream answers again
    await look(watchdog, clock)
    resumed = await jobs.get_job(redis_client, job_id)
    assert resumed["status"] == "RUNNING"
    assert "paused_reason" not in resumed and "paused_since" not in resumed
    assert watchdog.condition() == {"status": "ok"}
    progress.admitted += 1
    await look(watchdog, clock, after_s=job_spec.train.stall_timeout_s / 2)  # the stall clock began anew
    assert (await jobs.get_job(redis_client, job_id))["status"] == "RUNNING"


async def test_a_pause_past_judge_outage_s_fails_the_job_naming_the_outage(redis_client):
    job_spec = spec()
    job_id = await running_job(redis_client, job_spec)
    watchdog, clock, _, _ = watchdog_for(redis_client, job_id, job_spec, judge_outage_s=120)
    await heartbeat(redis_client, job_id, "rollout-0")
    await watchdog.check()
    await heartbeat(redis_client, job_id, "rollout-0", waiting_on=OUTAGE)
    await look(watchdog, clock, after_s=PAUSE_AFTER_S)
    assert (await jobs.get_job(redis_client, job_id))["status"] == "PAUSED"
    await heartbeat(redis_client, job_id, "rollout-0", waiting_on=OUTAGE)
    with pytest.raises(JobStalled, match=r"paused for 121s, past judge_outage_s=120s: every upstream of model 'judge'"):
        await look(watchdog, clock, after_s=121)


async def test_a_job_with_no_step_and_no_group_for_stall_timeout_s_fails_naming_the_newest_task_failure(
    redis_client,
):
    job_spec = spec(stall_timeout_s=600)
    job_id = await running_job(redis_client, job_spec)
    watchdog, clock, progress, _ = watchdog_for(redis_client, job_id, job_spec)
    await heartbeat(redis_client, job_id, "rollout-0")
    await watchdog.check()
    progress.steps = 3
    await look(watchdog, clock, after_s=500)  # progress: the clock starts again here
    for task_id in range(3):
        error = f"JudgeError: judge proxy answered 502: the judge's verdict on task {task_id} was unreadable"
        await redis_client.xadd(Keys.task_errors(job_id), {"task": task_id, "server": "rollout-0", "error": error})

    await heartbeat(redis_client, job_id, "rollout-0")
    await look(watchdog, clock, after_s=599)
    assert watchdog.condition()["status"] == "degraded"  # past half the bound: /healthz says so
    await heartbeat(redis_client, job_id, "rollout-0")
    with pytest.raises(JobStalled) as stalled:
        await look(watchdog, clock, after_s=2)
    message = str(stalled.value)
    assert message.startswith("no step and no admitted group for 601s (train.stall_timeout_s=600); ")
    assert "1 rollout server(s) on the job" in message
    assert "3 task failures on rollout servers, the newest (rollout-0): JudgeError: " in message
    assert "verdict on task 2 was unreadable" in message


async def test_more_than_max_dead_share_of_the_latest_tasks_dead_lettered_fails_the_job_before_any_stall(
    redis_client,
):
    job_spec = spec(max_dead_share=0.5)
    job_id = await running_job(redis_client, job_spec)
    watchdog, clock, progress, dispatcher = watchdog_for(redis_client, job_id, job_spec)
    await heartbeat(redis_client, job_id, "rollout-0")
    await dispatcher.top_up(version=0)
    window = dead_window(job_spec.train.batch_size)
    entries = await redis_client.xrange(Keys.tasks(job_id))
    progress.admitted = window // 2  # half the window trained: exactly the budget, no failure
    for entry_id, fields in entries[: window // 2]:
        reason = "delivered 4 times without an ack (max 3)"
        await redis_client.xadd(
            Keys.dead(job_id),
            {"stream": Keys.tasks(job_id), "entry_id": entry_id, FIELD: fields[FIELD], "reason": reason},
        )
    await dispatcher.top_up(version=0)
    await watchdog.check()
    assert (await jobs.get_job(redis_client, job_id))["status"] == "RUNNING"

    _, fields = entries[window // 2]
    await redis_client.xadd(
        Keys.dead(job_id), {"stream": Keys.tasks(job_id), "entry_id": b"0-1", FIELD: fields[FIELD], "reason": "bad"}
    )
    await dispatcher.top_up(version=0)
    with pytest.raises(JobStalled, match=rf"{window // 2 + 1} of the last {window} tasks to end went to the dead"):
        await look(watchdog, clock)


async def test_a_job_with_no_rollout_server_is_paused_and_fails_past_rollout_wait_s(redis_client):
    job_spec = spec()
    job_id = await running_job(redis_client, job_spec)
    watchdog, clock, _, _ = watchdog_for(redis_client, job_id, job_spec, rollout_wait_s=300, server_timeout_s=10)
    await heartbeat(redis_client, job_id, "rollout-0", age_s=11)  # silent past server_timeout_s
    await watchdog.check()
    paused = await jobs.get_job(redis_client, job_id)
    assert (paused["status"], paused["paused_reason"]) == ("PAUSED", "no rollout server is on the job")

    with pytest.raises(JobStalled, match="past rollout_wait_s=300s: no rollout server is on the job"):
        await look(watchdog, clock, after_s=301)


async def test_a_paused_job_can_be_cancelled_and_a_restarted_learner_resumes_it(redis_client):
    job_id = await running_job(redis_client, spec())
    assert await jobs.pause(redis_client, job_id, OUTAGE)
    assert await claim_job(redis_client, job_id, LearnerSettings(resume=True)) is not None
    assert (await jobs.get_job(redis_client, job_id))["status"] == "RUNNING"  # claimed: running again

    assert await jobs.pause(redis_client, job_id, OUTAGE)
    assert await jobs.cancel(redis_client, job_id) == "PAUSED"
    assert await jobs.cancel_requested(redis_client, job_id)
    assert await jobs.set_status(redis_client, job_id, jobs.JobStatus.CANCELLED)
    assert not await jobs.pause(redis_client, job_id, OUTAGE)  # an ended job is never paused again
    assert (await jobs.get_job(redis_client, job_id))["status"] == "CANCELLED"
