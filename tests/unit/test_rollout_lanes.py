"""How a rollout server shares its task slots between held-out conversations and training
tasks (`rollout.served_job.room`): never more in flight than its capacity, held-out ones never
more than their share, counting what it read this turn."""

from __future__ import annotations

from rollout.served_job import Lane, room


def test_a_turns_reads_count_against_the_capacity_and_each_lanes_share():
    held_out, tasks = Lane(object(), 2), Lane(object(), 4)
    assert room(held_out, {}, [], 4) == 2  # its share
    read = [(held_out, "e1"), (held_out, "e2")]
    assert room(tasks, {}, read, 4) == 2  # the capacity less the two just read
    assert room(held_out, {}, read, 4) == 0
    inflight = {(tasks.consumer, b"1"): None, (tasks.consumer, b"2"): None, (held_out.consumer, b"3"): None}
    assert room(held_out, inflight, [], 4) == 1
    assert room(tasks, inflight, [(held_out, "e4")], 4) == 0
