"""A rollout server that heartbeats but can never join the weight group (a wrong advertised
address, a firewall) is evicted, and the job goes on with the servers that can: before, it
stayed a member, every publish failed for everyone (3 attempts of `weight_timeout_s`), and
with version 0 unsent no task was ever played.

The unreachable member is a heartbeat record the test keeps fresh for the job, as such a
server's would be; the rest is the whole system as separate processes.

Bound: version 0's first two attempts each wait `weight_timeout_s` (5 s) for the member and
up to `server_timeout_s` (5 s) settling; the member is then evicted and the third attempt
reaches the real server. Then 3 tiny steps. 180 s leaves room for a slow machine.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import redis
from helpers import job_ended

from services import protocol
from services.queues import Keys
from tandem.launcher import Ports, Stack

pytestmark = pytest.mark.slow
UNREACHABLE = "behind-a-firewall"


def keep_heartbeating(redis_url: str, job_id: str, stop: threading.Event) -> None:
    client = redis.Redis.from_url(redis_url)
    started = time.time()
    while not stop.is_set():
        info = protocol.ServerInfo(
            server_id=UNREACHABLE, heartbeat=time.time(), job_id=job_id, capacity=4, started=started
        )
        client.hset(Keys.rollout_servers, UNREACHABLE, protocol.encode(info))
        stop.wait(1.0)
    client.hdel(Keys.rollout_servers, UNREACHABLE)


def test_a_server_that_never_reaches_the_weight_store_is_evicted_and_the_job_succeeds(tmp_path, tiny_model):
    env = {
        "TANDEM_WEIGHT_TIMEOUT_S": "5",
        "TANDEM_SERVER_TIMEOUT_S": "5",
        "TANDEM_RUNS_DIR": str(tmp_path / "runs"),
    }
    spec = {
        "name": "eviction",
        "model": {"path": str(tiny_model), "max_model_len": 512},
        "task": {"name": "clarify", "num_examples": 64},
        "rollout": {"group_size": 2, "max_new_tokens": 12, "max_turns": 2, "max_total_tokens": 128},
        "train": {"num_steps": 3, "batch_size": 2, "max_staleness": 1, "lr": 1e-4},
    }
    stop = threading.Event()
    with Stack(tmp_path / "logs", ports=Ports.free(rollout_servers=1), extra_env=env) as system:
        api = httpx.Client(base_url=system.api_url, timeout=10)
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        beating = threading.Thread(target=keep_heartbeating, args=(system.redis_url, job_id, stop), daemon=True)
        beating.start()
        try:
            final = job_ended(api, job_id, timeout_s=180)
            memberships = [
                json.loads(r) for r in redis.Redis.from_url(system.redis_url).lrange(Keys.servers(job_id), 0, -1)
            ]
        finally:
            stop.set()
            beating.join(timeout=10)

    assert final["status"] == "SUCCEEDED", final.get("error")
    left = [record["left"][UNREACHABLE] for record in memberships if UNREACHABLE in record["left"]]
    assert left == ["evicted: it did not reach the weight store in 2 updates"]
    assert final["metrics"]["evictions"] == 1
