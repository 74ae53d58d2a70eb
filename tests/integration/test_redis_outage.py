"""Redis goes away and comes back (a restart, a network blip): the rollout server keeps its
process (and, with a job, its loaded engine) and serves again once Redis answers; a call
during a short outage waits it out, one to a hung Redis times out; a running job survives
a restart of its Redis and succeeds."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
from helpers import wait_for

from services.queues import SOCKET_TIMEOUT_S, Keys, connect
from tandem.launcher import Ports, Stack
from tandem.redis_embed import EmbeddedRedis, free_port

pytestmark = pytest.mark.slow


def test_the_rollout_server_outlives_a_redis_restart(tmp_path):
    first = EmbeddedRedis().start()
    env = os.environ | {
        "TANDEM_REDIS_URL": first.url,
        "TANDEM_METRICS_PORT": str(free_port()),
        "TANDEM_SERVER_ID": "outage",
        "TANDEM_HEARTBEAT_S": "0.5",
    }
    with open(tmp_path / "rollout.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "rollout"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    second = None
    try:
        client = redis.Redis.from_url(first.url)
        wait_for(lambda: client.hexists(Keys.rollout_servers, "outage"), 60, "the first heartbeat")
        first.stop()
        time.sleep(2)  # the server's calls fail meanwhile
        second = EmbeddedRedis(port=first.port).start()  # empty: everything is announced again

        def announced_again() -> bool:
            assert server.poll() is None, (tmp_path / "rollout.log").read_text()[-2000:]
            return client.hexists(Keys.rollout_servers, "outage")

        wait_for(announced_again, 60, "a heartbeat after the restart")
    finally:
        server.terminate()  # a drain: an idle server exits within a heartbeat
        try:
            server.wait(timeout=30)
            stuck = False
        except subprocess.TimeoutExpired:
            server.kill()  # the test fails, but leaves no process behind
            server.wait()
            stuck = True
        for instance in (first, second):
            if instance:
                instance.stop()
    assert not stuck, "the rollout server did not exit within 30 s of SIGTERM"


def restart_with_its_data(server: EmbeddedRedis, outage_s: float) -> EmbeddedRedis:
    """Stop `server` with its data saved (SHUTDOWN SAVE), wait `outage_s`, and start a new
    one on its port and password from that data."""
    client = redis.Redis.from_url(server.url)
    folder = Path(client.config_get("dir")["dir"])
    client.shutdown(save=True)
    time.sleep(outage_s)
    again = EmbeddedRedis(port=server.port, password=server.password)
    shutil.copy(folder / "dump.rdb", again._dir)  # EmbeddedRedis cannot be told its folder
    server.stop()
    return again.start()


async def test_a_call_during_a_short_outage_waits_for_redis_to_return():
    first = EmbeddedRedis().start()
    client = connect(first.url, max_connections=4, wait_s=5.0, outage_s=20.0)
    await client.set("k", "v")
    restarted: list[EmbeddedRedis] = []
    restarter = threading.Thread(target=lambda: restarted.append(restart_with_its_data(first, 2.0)))
    try:
        restarter.start()
        await asyncio.sleep(0.5)  # Redis is down now
        started = time.monotonic()
        assert await client.get("k") == b"v"
        assert time.monotonic() - started > 1.0  # it waited for the restart
    finally:
        restarter.join()
        await client.aclose()
        for server in restarted:
            server.stop()


async def test_a_call_to_a_hung_redis_fails_after_the_outage_bound_instead_of_hanging():
    with EmbeddedRedis() as server:
        pid = redis.Redis.from_url(server.url).info("server")["process_id"]
        client = connect(server.url, max_connections=4, wait_s=5.0, outage_s=1.0)
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            async with asyncio.timeout(3 * SOCKET_TIMEOUT_S):  # without a socket timeout the call never returns
                with pytest.raises(redis.TimeoutError):
                    await client.get("k")
            # One attempt, cut by the socket timeout; it outlasts the 1 s bound, so no retry.
            assert time.monotonic() - started < SOCKET_TIMEOUT_S + 3.0
        finally:
            os.kill(pid, signal.SIGCONT)
            await client.aclose()


def test_a_running_job_waits_out_a_redis_restart_and_succeeds(tmp_path, tiny_model):
    env = {"TANDEM_RUNS_DIR": str(tmp_path / "runs"), "TANDEM_MAX_CONCURRENT_TASKS": "2"}
    spec = {
        "name": "outage",
        "model": {"path": str(tiny_model), "max_model_len": 512},
        "task": {"name": "clarify", "num_examples": 64},
        "rollout": {"group_size": 2, "max_new_tokens": 12, "max_turns": 2, "max_total_tokens": 128},
        "train": {"num_steps": 6, "batch_size": 2, "max_staleness": 1, "lr": 1e-4},
    }
    with Stack(tmp_path / "logs", ports=Ports.free(rollout_servers=1), learner_ranks=1, extra_env=env) as stack:
        api = httpx.Client(base_url=stack.api_url, timeout=10)
        client = redis.Redis.from_url(stack.redis_url)
        job_id = api.post("/v1/jobs", json=spec).json()["id"]

        def rl_steps() -> int:
            return sum(b'"phase": "rl"' in r for r in client.lrange(Keys.history(job_id), 0, -1))

        wait_for(lambda: rl_steps() >= 2, 180, "two RL steps", interval_s=0.5)
        stack.redis = restart_with_its_data(stack.redis, 4.0)
        assert client.hget(Keys.job(job_id), "status") == b"RUNNING"

        def ended() -> bytes | None:
            stack.check_alive()  # a learner that lost Redis fails the job, then dies failing to say so
            status = client.hget(Keys.job(job_id), "status")
            return status if status in (b"SUCCEEDED", b"FAILED", b"CANCELLED") else None

        status = wait_for(ended, 180, "the job to end", interval_s=0.5)
        error = client.hget(Keys.job(job_id), "error")
        steps = rl_steps()

    assert status == b"SUCCEEDED", error
    assert steps == 6
