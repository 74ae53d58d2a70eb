"""Dispatch under the staleness bound and the learner's admit decisions, on real Redis."""

from __future__ import annotations

import msgspec
import pytest

from learner.dispatcher import Dispatcher
from learner.intake import Acks, BatchIntake, latest_fitting
from services import protocol
from services.config import (
    JobSpec,
    LearnerSettings,
    ModelSpec,
    RLJob,
    TrainSpec,
)
from services.queues import FIELD, Delivery, Keys, StreamConsumer


def spec(eta: int, batch: int = 4, steps: int = 10) -> JobSpec:
    return RLJob(model=ModelSpec(path="/m"), train=TrainSpec(max_staleness=eta, batch_size=batch, num_steps=steps))


@pytest.mark.parametrize(
    "eta, version, admitted",
    [
        (0, 0, 4),  # synchronous: only the batch about to be trained
        (0, 3, 16),
        (2, 0, 12),  # (eta + version + 1) * batch_size
        (2, 5, 32),
        (8, 5, 40),  # never more than num_steps * batch_size
    ],
)
async def test_admission_follows_the_staleness_rule(redis_client, eta, version, admitted):
    dispatcher = Dispatcher(redis_client, "j", spec(eta))
    await dispatcher.top_up(version)
    assert dispatcher.next_task_id == admitted
    assert await redis_client.xlen(Keys.tasks("j")) == admitted
    assert await dispatcher.top_up(version) == 0  # nothing more until the version moves


async def test_replaced_tasks_are_admitted_again_and_examples_are_a_function_of_the_task(redis_client):
    dispatcher = Dispatcher(redis_client, "j", spec(0))
    await dispatcher.top_up(0)
    dispatcher.replace(0)
    dispatcher.replace(1)
    assert await dispatcher.top_up(0) == 2
    again = Dispatcher(redis_client, "other", spec(0))
    assert [again.example(t) for t in range(6)] == [dispatcher.example(t) for t in range(6)]
    assert sorted(dispatcher.example(t) for t in range(512)) == list(range(512))  # a permutation per pass


async def test_only_dead_letters_of_its_own_tasks_are_replaced(redis_client):
    dispatcher = Dispatcher(redis_client, "j", spec(0))
    await dispatcher.top_up(0)
    own = protocol.Task(job_id="j", task_id=1, example=3, group_size=8, dispatched_version=0)
    stranger = protocol.Task(job_id="j", task_id=99, example=3, group_size=8, dispatched_version=0)
    for data in (protocol.encode(own), protocol.encode(stranger), b"garbage"):
        await redis_client.xadd(Keys.dead("j"), {b"stream": Keys.tasks("j"), b"reason": b"x", FIELD: data})

    assert await dispatcher.top_up(0) == 1


def group(task_id: int, versions: list[int], job_id: str = "j") -> Delivery:
    sample = protocol.Sample(
        sample_id="s",
        tokens=[1] * (len(versions) + 1),
        mask=[0] + [1] * len(versions),
        logprobs=[0.0] * (len(versions) + 1),
        versions=[-1] + versions,
        reward=1.0,
        advantage=0.0,
        num_turns=1,
    )
    return Delivery(
        b"1-0", protocol.TrajectoryGroup(job_id=job_id, task_id=task_id, samples=[sample], server_id="s", elapsed_s=0.0)
    )


@pytest.fixture
async def intake(redis_client):
    trajectories = await StreamConsumer(
        redis_client, Keys.trajectories("j"), "learner", "learner", protocol.TrajectoryGroup, Keys.dead("j")
    ).setup()
    job = spec(eta=1)
    return BatchIntake(
        "j", job.train, trajectories, Dispatcher(redis_client, "j", job), Acks(trajectories, deferred=False)
    )


VERSION = 5


async def test_stale_groups_over_bound_are_dropped_counted_and_replaced(intake):
    assert await intake.admit(group(1, [4, 5]), VERSION, set())  # staleness 1 = eta: kept
    assert not await intake.admit(group(2, [3, 5]), VERSION, set())  # oldest token 2 versions back
    assert intake.counts["stale_dropped"] == 1
    assert intake.dispatcher.replaced == 1


async def test_groups_from_versions_the_learner_never_had_are_dropped(intake):
    assert not await intake.admit(group(3, [5, 6]), VERSION, set())  # a crashed learner's version 6
    assert intake.counts["stale_dropped"] == 1


async def test_a_task_trained_before_or_already_in_the_batch_is_skipped(intake):
    await intake.trained_on([group(7, [5])])
    assert not await intake.admit(group(7, [5]), VERSION, set())
    assert not await intake.admit(group(8, [5]), VERSION, {8})
    assert intake.counts["duplicates"] == 2
    assert intake.dispatcher.replaced == 0


async def test_tasks_whose_trajectory_group_was_dead_lettered_are_replaced(redis_client):
    dispatcher = Dispatcher(redis_client, "j", spec(0))
    await dispatcher.top_up(0)
    consumer = await StreamConsumer(
        redis_client, Keys.trajectories("j"), "learner", "learner", protocol.TrajectoryGroup, Keys.dead("j")
    ).setup()
    malformed = msgspec.msgpack.encode({"schema": 1, "job_id": "j", "task_id": 3, "samples": "?"})
    await redis_client.xadd(Keys.trajectories("j"), {FIELD: malformed})
    await redis_client.xadd(Keys.trajectories("j"), {FIELD: b"garbage"})
    assert await consumer.read(10) == []  # neither decodes: dead-lettered by the learner's consumer
    for task_id, job_id in ((2, "j"), (99, "j"), (1, "other")):  # e.g. over-delivered groups
        data = protocol.encode(group(task_id, [0], job_id).message)
        await redis_client.xadd(Keys.dead("j"), {b"stream": Keys.trajectories("j"), b"reason": b"x", FIELD: data})
    await redis_client.xadd(Keys.dead("j"), {b"stream": Keys.trajectories("other"), b"reason": b"x", FIELD: b"garbage"})

    # Task 3's malformed group and task 2's group; garbage names no task and replaces none.
    assert await dispatcher.top_up(0) == 2
    assert dispatcher.replaced == 2


async def test_a_resumed_run_reads_back_every_entry_it_left_pending(intake, redis_client):
    consumer = intake.trajectories
    num_pending = 10_050
    data = protocol.encode(group(1, [0]).message)
    async with redis_client.pipeline(transaction=False) as pipe:
        for _ in range(num_pending):
            pipe.xadd(Keys.trajectories("j"), {FIELD: data})
        await pipe.execute()
    assert len(await consumer.read(num_pending)) == num_pending  # read, never acknowledged

    await intake.read_backlog()
    assert len(intake.backlog) == num_pending


async def test_a_malformed_group_is_dead_lettered_with_the_reason_and_its_task_replaced(intake, redis_client):
    await intake.dispatcher.top_up(VERSION)
    bad = group(2, [5, 5])
    bad.message.samples[0].logprobs.pop()

    assert not await intake.admit(bad, VERSION, set())
    [(_, fields)] = await redis_client.xrange(Keys.dead("j"))
    assert b"differ in length" in fields[b"reason"]
    assert await intake.dispatcher.top_up(VERSION) == 1


async def test_a_job_cancelled_between_the_read_and_the_claim_is_not_started(redis_client, monkeypatch):
    from learner.driver import claim_job
    from services import jobs

    job_id = await jobs.create_job(redis_client, spec(0))
    read = jobs.get_job

    async def read_then_cancel(client, job):  # the API's cancel lands right after the learner's read
        record = await read(client, job)
        assert await jobs.cancel(redis_client, job) == "CANCELLED"
        return record

    monkeypatch.setattr(jobs, "get_job", read_then_cancel)

    assert await claim_job(redis_client, job_id, LearnerSettings()) is None  # no model loaded, no warm start
    assert (await read(redis_client, job_id))["status"] == "CANCELLED"
    assert not await redis_client.sismember(Keys.jobs_running, job_id)


# ---- stragglers: wait ------------------------------------------------------------------


async def test_the_dispatcher_knows_which_version_admitted_each_task(redis_client):
    dispatcher = Dispatcher(redis_client, "j", spec(eta=1, batch=2))
    await dispatcher.top_up(0)  # (1 + 0 + 1) * 2: tasks 0-3 at version 0
    await dispatcher.top_up(1)  # tasks 4, 5 at version 1
    dispatcher.replace(3)  # one lost: task 6 at version 1 takes its place
    await dispatcher.top_up(1)
    assert [dispatcher.admitted_version(t) for t in (0, 3, 4, 6, 7)] == [0, 0, 1, 1, None]
    await dispatcher.top_up(2)  # tasks 7, 8 at version 2; version 0 is forgotten (2 - eta = 1)
    assert dispatcher.admitted_at == [(1, 4), (2, 7)]
    assert [dispatcher.admitted_version(t) for t in (3, 4, 8, 9)] == [None, 1, 2, None]


async def arrive(redis_client, *groups: Delivery) -> None:
    for delivery in groups:
        await redis_client.xadd(Keys.trajectories("j"), {FIELD: protocol.encode(delivery.message)})


async def nothing_arrived() -> None:
    raise AssertionError("the batch waited for a group that will not come")


async def play(
    redis_client, stragglers: str, eta: int, schedule: list[list[Delivery]], batch: int = 2
) -> tuple[list[list[int]], BatchIntake]:
    """Batches of `batch` on versions 0, 1, ...: before the batch on version v is collected,
    the groups `schedule[v]` arrive. Returns the task ids of each batch, and the intake."""
    trajectories = await StreamConsumer(
        redis_client, Keys.trajectories("j"), "learner", "learner", protocol.TrajectoryGroup, Keys.dead("j")
    ).setup()
    job = RLJob(
        model=ModelSpec(path="/m"),
        train=TrainSpec(max_staleness=eta, batch_size=batch, num_steps=10, stragglers=stragglers),
    )
    intake = BatchIntake(
        "j",
        job.train,
        trajectories,
        Dispatcher(redis_client, "j", job),
        Acks(trajectories, deferred=False),
        stragglers=stragglers,
    )
    batches = []
    for version, arrivals in enumerate(schedule):
        await arrive(redis_client, *arrivals)
        batch = await intake.collect(version, nothing_arrived)
        await intake.trained_on(batch)
        batches.append([d.message.task_id for d in batch])
    return batches, intake


# batch 2, eta 1: version 0 admits tasks 0-3; 2 and 3 come back first. Version 1 admits 4
# and 5; group 4 comes back before the slow groups of tasks 0 and 1 (sampled on version 0),
# then groups 5 and 6 (task 6 exists if version 2 admitted it).
ONE_SLOW_PAIR = [
    [group(2, [0]), group(3, [0])],
    [group(4, [1]), group(0, [0]), group(1, [0])],
    [group(5, [1]), group(6, [2])],
]


async def test_waiting_trains_every_straggler_within_the_bound(redis_client):
    batches, intake = await play(redis_client, "wait", 1, ONE_SLOW_PAIR)
    # Version 1: tasks 0 and 1 (admitted at version 0) must be trained now, and take both
    # places; group 4 is held over to version 2, where it is 1 version old.
    assert batches == [[2, 3], [0, 1], [4, 5]]
    assert intake.counts == {"stale_dropped": 0, "duplicates": 0, "held_over": 1, "stale_masked_tokens": 0}
    assert intake.dispatcher.replaced == 0


async def test_dropping_loses_the_straggler_that_came_last(redis_client):
    batches, intake = await play(redis_client, "drop", 1, ONE_SLOW_PAIR)
    # Version 1 takes the first two to arrive (4 and 0); group 1 is then 2 versions old
    # at version 2 and dropped, its task replaced by a new one (6), sampled on version 2.
    assert batches == [[2, 3], [4, 0], [5, 6]]
    assert intake.counts["stale_dropped"] == 1
    assert intake.dispatcher.replaced == 1 and intake.ledger.done_below == 7  # 0-6 trained or lost: forgotten


# batch 2, eta 2: version 0 admits tasks 0-5, all due by version 2; 0 and 1 come back at
# once. Version 1 admits 6 and 7, which come back before 2-5 (sampled on version 0).
FOUR_SLOW = [
    [group(0, [0]), group(1, [0])],
    [group(6, [1]), group(7, [1]), group(2, [0]), group(3, [0]), group(4, [0]), group(5, [0])],
    [],
    [],
]


async def test_admitting_trains_the_stragglers_late(redis_client):
    batches, intake = await play(redis_client, "admit", 1, ONE_SLOW_PAIR)
    # As with drop, version 1 takes 4 and 0; group 1, 2 versions old at version 2, is
    # trained there (its tokens weighted by the behaviour correction) instead of replaced.
    assert batches == [[2, 3], [4, 0], [1, 5]]
    assert intake.counts["stale_dropped"] == 0 and intake.dispatcher.replaced == 0


async def admitting(redis_client, max_token_staleness: int) -> BatchIntake:
    """An intake of `stragglers: admit` at eta 1 with the given token bound."""
    trajectories = await StreamConsumer(
        redis_client, Keys.trajectories("j"), "learner", "learner", protocol.TrajectoryGroup, Keys.dead("j")
    ).setup()
    train = TrainSpec(max_staleness=1, batch_size=2, stragglers="admit", max_token_staleness=max_token_staleness)
    job = RLJob(model=ModelSpec(path="/m"), train=train)
    return BatchIntake(
        "j", train, trajectories, Dispatcher(redis_client, "j", job), Acks(trajectories, False), stragglers="admit"
    )


async def test_admitting_with_a_token_bound_masks_only_the_tokens_older_than_it(redis_client):
    intake = await admitting(redis_client, max_token_staleness=2)
    late = group(1, [2, 3, 4, 5])  # at version 5 its tokens are 3, 2, 1 and 0 versions old
    assert await intake.admit(late, VERSION, set())
    assert late.message.samples[0].mask == [0, 0, 1, 1, 1]  # the prompt token stays out, the oldest goes
    assert intake.counts["stale_masked_tokens"] == 1 and intake.counts["stale_dropped"] == 0


async def test_a_group_whose_every_token_is_older_than_the_bound_is_refused_counted_and_replaced(redis_client):
    intake = await admitting(redis_client, max_token_staleness=2)
    assert not await intake.admit(group(2, [1, 2]), VERSION, set())  # 4 and 3 versions old
    assert intake.counts["stale_dropped"] == 1 and intake.counts["stale_masked_tokens"] == 2
    assert intake.dispatcher.replaced == 1
    assert intake.mix.record()["wasted_llm_tokens"] == 0.0  # counted as finished, not trained
    assert intake.mix.finished.groups == 1 and intake.mix.trained.groups == 0


async def test_a_group_claiming_a_version_newer_than_the_learners_is_refused_not_trained_unmasked(redis_client):
    # The versions come from a rollout server (or anyone who can write to the stream). A
    # claimed future version would make every token look fresh to the token bound.
    intake = await admitting(redis_client, max_token_staleness=2)
    forged = group(3, [0, VERSION + 7])
    assert not await intake.admit(forged, VERSION, set())
    assert intake.counts["stale_dropped"] == 1 and intake.mix.trained.groups == 0


async def test_waiting_keeps_places_for_deadlines_of_later_steps(redis_client):
    batches, intake = await play(redis_client, "wait", 2, FOUR_SLOW)
    # Version 1: four tasks are due by version 2, and two steps (1 and 2) train two groups
    # each, so version 1 owes both places to them (4 - 1 * 2 = 2): 6 and 7 wait. Taking
    # them (no task is due *at* version 1) would leave four due at version 2 and two of
    # them over-stale.
    assert batches == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert intake.counts["stale_dropped"] == 0
    assert intake.counts["held_over"] == 2  # 6 and 7 (at versions 1 and 2, counted once each)


async def test_dropping_loses_what_the_fast_groups_pushed_back(redis_client):
    batches, intake = await play(redis_client, "drop", 2, FOUR_SLOW[:3] + [[group(8, [2]), group(9, [2])]])
    # Version 3 finds 4 and 5 three versions old: dropped (and replaced), and takes 8 and 9.
    assert batches == [[0, 1], [6, 7], [2, 3], [8, 9]]
    assert intake.counts["stale_dropped"] == 2


async def test_the_dispatch_state_survives_a_checkpoint(redis_client):
    import json

    dispatcher = Dispatcher(redis_client, "j", spec(eta=1, batch=2))
    await dispatcher.top_up(0)
    await dispatcher.top_up(1)
    dispatcher.replace(2)
    restored = Dispatcher(redis_client, "j", spec(eta=1, batch=2))
    restored.load_state(json.loads(json.dumps(dispatcher.state())))  # as meta.json keeps it
    assert [restored.admitted_version(t) for t in range(7)] == [0, 0, 0, 0, 1, 1, None]
    assert restored.lost == {2}
    restored.skip_past(8, version=1)  # a lost run admitted 6-8 after the checkpoint
    assert restored.next_task_id == 9 and restored.admitted_version(8) == 1
    older = Dispatcher(redis_client, "j", spec(eta=1, batch=2))
    older.load_state({"next_task_id": 4, "replaced": 0, "dead_cursor": "0-0"})  # before admitted_at existed
    assert older.admitted_version(3) is None and older.lost == set()


@pytest.mark.parametrize(
    "owed, places, latest",
    [
        ([2, 2, 2], 2, 0),  # two tasks due now take both places: only they fit
        ([0, 4, 2], 2, 1),  # four due within 1 step, two steps of 2: this batch owes 4 - 2 = 2
        ([0, 0, 6], 2, 2),  # six within 2 steps, 3 batches of 2: owes 6 - 4 = 2, so k <= 2
        ([0, 1, 1], 2, None),  # 1 - 2 and 2 - 4 owe nothing: any group fits
        ([1, 0, 0], 1, 0),  # the last place belongs to the one due now
        ([1, 0, 0], 2, None),  # ... but with two places left, one is free
    ],
)
def test_the_places_a_batch_owes_by_deadline(owed, places, latest):
    assert latest_fitting(owed, places, batch_size=2) == latest
