"""The learner's per-group records: what `groups.jsonl` says about one group."""

from learner.group_log import GroupLog, group_record, read
from services import protocol


def sample(reward: float, versions: list[int], metrics: dict[str, float]) -> protocol.Sample:
    return protocol.Sample(
        sample_id="s",
        tokens=[1] * (len(versions) + 1),
        mask=[0] + [1] * len(versions),
        logprobs=[0.0] * (len(versions) + 1),
        versions=[-1] + versions,
        reward=reward,
        advantage=0.0,
        num_turns=1,
        metrics=metrics,
    )


GROUP = protocol.TrajectoryGroup(
    job_id="j",
    task_id=7,
    server_id="r0",
    elapsed_s=12.5,
    dispatched_version=3,
    samples=[
        sample(1.25, [4, 4], {"asked": 1.0, "success": 1.0}),
        sample(0.25, [5], {"asked": 0.0, "success": 0.0}),
        sample(-0.5, [4], {"success": 0.0}),
    ],
)  # a follow-up context: no `asked`


def test_a_record_says_when_the_group_was_made_and_what_it_held() -> None:
    record = group_record(GROUP, "stale", version=7, arrived_s=40.0)
    assert record["decision"] == "stale"
    assert (record["learner_version"], record["dispatched_version"], record["behaviour_version"]) == (7, 3, 4)
    assert record["staleness"] == 3
    assert record["elapsed_s"] == 12.5 and record["arrived_s"] == 40.0
    assert record["reward_mean"] == (1.25 + 0.25 - 0.5) / 3
    assert record["reward_spread"] == 1.75
    assert record["metrics"] == {"asked": 0.5, "success": 1 / 3}  # asked over the two that say


def test_records_append_one_line_per_decision(tmp_path) -> None:
    log = GroupLog(tmp_path)
    log.write(GROUP, "trained", 5)
    log.write(GROUP, "duplicate", 6)
    assert not (tmp_path / "groups.jsonl").exists()  # kept for the batch's one write
    log.flush()
    assert [r["decision"] for r in read(tmp_path / "groups.jsonl")] == ["trained", "duplicate"]


def test_a_group_the_learner_refuses_still_makes_a_record() -> None:
    """Invalid groups are recorded too, whatever a rollout server sent: no samples, or
    non-finite rewards and metrics."""
    empty = protocol.TrajectoryGroup(job_id="j", task_id=1, server_id="r0", elapsed_s=0.0, samples=[])
    assert group_record(empty, "invalid", 3, 1.0)["reward_mean"] == 0.0
    assert group_record(empty, "invalid", 3, 1.0)["staleness"] is None
    broken = protocol.TrajectoryGroup(
        job_id="j",
        task_id=2,
        server_id="r0",
        elapsed_s=0.0,
        samples=[sample(float("nan"), [3], {"success": float("inf")})],
    )
    record = group_record(broken, "invalid", 3, 1.0)
    assert record["reward_mean"] != record["reward_mean"] and record["metrics"]["success"] == float("inf")


def test_a_record_lists_each_distinct_reward_source_once() -> None:
    judged = {"judge_model": "smollm2", "simulator_model": "smollm2", "rubric_sha256": "ab12", "seed": "0"}
    unjudged = {"simulator_model": "smollm2", "seed": "0"}
    samples = [sample(0.5, [1], {}), sample(0.0, [1], {}), sample(-1.0, [1], {}), sample(0.0, [1], {})]
    for one, source in zip(samples, (judged, dict(judged), unjudged, {})):
        one.reward_source = source
    group = protocol.TrajectoryGroup(job_id="j", task_id=1, server_id="r0", elapsed_s=1.0, samples=samples)
    assert group_record(group, "trained", version=1, arrived_s=1.0)["reward_sources"] == [judged, unjudged]
    assert "reward_sources" not in group_record(GROUP, "trained", version=7, arrived_s=1.0)  # no LLM scored GROUP


def test_trimming_to_a_checkpoint_leaves_each_decision_recorded_once(tmp_path) -> None:
    """Two batches, a checkpoint, a third batch the lost run recorded: the resumed run cuts
    the file back to the checkpoint's size, decides the third batch again, and the file
    holds each batch once."""
    log = GroupLog(tmp_path)
    for version in (1, 2):
        log.write(GROUP, "trained", version)
        log.flush()
    at_checkpoint = log.written_bytes()
    log.write(GROUP, "trained", 3)
    log.flush()

    resumed = GroupLog(tmp_path)
    resumed.trim(at_checkpoint)
    resumed.write(GROUP, "stale", 3)
    resumed.flush()

    assert [(r["learner_version"], r["decision"]) for r in read(tmp_path / "groups.jsonl")] == [
        (1, "trained"),
        (2, "trained"),
        (3, "stale"),
    ]
