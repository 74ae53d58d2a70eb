"""Groups carrying values the trainer must not see (a token id outside the vocabulary, a
behaviour logprob that is not a finite number <= 0) go to the job's dead stream with the
reason, acknowledged, on real Redis; a good group beside them is admitted."""

from __future__ import annotations

import math

import pytest

from learner.dispatcher import Dispatcher
from learner.intake import Acks, BatchIntake
from services import protocol
from services.config import ModelSpec, RLJob, TrainSpec
from services.queues import Delivery, Keys, StreamConsumer, publish

VOCAB = 512


def group(
    task_id: int, tokens: tuple[int, ...] = (1, 2, 3, 4), logprobs: tuple[float, ...] = (0.0, 0.0, -0.5, -1e-6)
) -> protocol.TrajectoryGroup:
    """One sample: two context tokens and two trained ones."""
    sample = protocol.Sample(
        sample_id=f"j:{task_id}:0",
        tokens=list(tokens),
        mask=[0, 0, 1, 1],
        logprobs=list(logprobs),
        versions=[-1, -1, 0, 0],
        reward=1.0,
        advantage=0.5,
        num_turns=1,
    )
    return protocol.TrajectoryGroup(job_id="j", task_id=task_id, samples=[sample], server_id="s", elapsed_s=0.0)


BAD = {  # task id -> (group, what its dead-letter reason must say)
    1: (group(1, tokens=(1, 2, VOCAB, 4)), "token id 512 is outside the model's vocabulary [0, 512)"),
    2: (group(2, tokens=(1, -1, 3, 4)), "token id -1 is outside the model's vocabulary [0, 512)"),
    3: (group(3, logprobs=(0.0, 0.0, math.nan, -0.5)), "behaviour logprob nan is not a finite number <= 0"),
    4: (group(4, logprobs=(0.0, 0.0, -0.5, math.inf)), "behaviour logprob inf is not a finite number <= 0"),
    5: (group(5, logprobs=(0.0, 0.0, -math.inf, -0.5)), "behaviour logprob -inf is not a finite number <= 0"),
    6: (group(6, logprobs=(0.0, 0.0, 0.3, -0.5)), "behaviour logprob 0.3 is not a finite number <= 0"),
}


@pytest.fixture
async def intake(redis_client):
    job = RLJob(model=ModelSpec(path="/m"), train=TrainSpec(batch_size=1, max_staleness=1))
    trajectories = await StreamConsumer(
        redis_client, Keys.trajectories("j"), "learner", "learner", protocol.TrajectoryGroup, Keys.dead("j")
    ).setup()
    return BatchIntake(
        "j",
        job.train,
        trajectories,
        Dispatcher(redis_client, "j", job),
        Acks(trajectories, deferred=True),
        vocab_size=VOCAB,
    )


async def test_groups_with_ids_outside_the_vocabulary_or_bad_logprobs_are_dead_lettered_and_a_good_one_admitted(
    intake, redis_client
):
    for bad, _ in BAD.values():
        await publish(redis_client, Keys.trajectories("j"), bad)
    await publish(redis_client, Keys.trajectories("j"), group(7))

    async def idle() -> None:
        raise AssertionError("the good group was not admitted")

    [admitted] = await intake.collect(version=0, when_idle=idle)

    assert admitted.message.task_id == 7
    dead = await redis_client.xrange(Keys.dead("j"))
    reasons = {
        protocol.decode(fields[b"m"], protocol.TrajectoryGroup).task_id: fields[b"reason"].decode()
        for _, fields in dead
    }
    assert reasons == {task_id: f"sample j:{task_id}:0: {reason}" for task_id, (_, reason) in BAD.items()}
    pending = await redis_client.xpending(Keys.trajectories("j"), "learner")
    assert pending["pending"] == 1  # only the admitted group waits for its checkpoint: the bad ones are acked


async def test_a_logprob_that_rounds_just_above_zero_is_admitted(intake):
    assert await intake.admit(Delivery(b"1-0", group(8, logprobs=(0.0, 0.0, 5e-5, -0.5))), 0, set())
