"""A resumed job's step records, on real Redis: what a checkpoint covers stays, once."""

from __future__ import annotations

import json

from learner.step_log import StepLog
from services.queues import Keys


async def test_trimming_to_a_checkpoint_drops_the_later_records_from_metrics_jsonl_as_from_redis(
    redis_client, tmp_path
):
    """Steps 1-5 recorded, the checkpoint at step 3 covering three records: a resume trims
    to it and records step 4 again, so both the file and the history read 1, 2, 3, 4 (the
    new 4), with no step twice."""
    steps = StepLog(redis_client, "job-0123abcd", tmp_path, rules=[])
    for step in range(1, 6):
        await steps.write({"phase": "rl", "step": step}, step, step)

    await steps.trim(3)
    await steps.write({"phase": "rl", "step": 4, "resumed": True}, 4, 4)

    on_disk = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    in_redis = [json.loads(r) for r in await redis_client.lrange(Keys.history("job-0123abcd"), 0, -1)]
    for records in (on_disk, in_redis):
        assert [(r["step"], "resumed" in r) for r in records] == [(1, False), (2, False), (3, False), (4, True)]
