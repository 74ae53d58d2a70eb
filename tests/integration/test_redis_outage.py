"""Redis goes away and comes back (a restart, a network blip): the rollout server keeps its
process (and, with a job, its loaded engine) and serves again once Redis answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis

from services.queues import Keys
from tandem.redis_embed import EmbeddedRedis, free_port

from helpers import wait_for

pytestmark = pytest.mark.slow


def test_the_rollout_server_outlives_a_redis_restart(tmp_path):
    first = EmbeddedRedis().start()
    env = os.environ | {"TANDEM_REDIS_URL": first.url, "TANDEM_METRICS_PORT": str(free_port()),
                        "TANDEM_SERVER_ID": "outage", "TANDEM_HEARTBEAT_S": "0.5"}
    with open(tmp_path / "rollout.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "tandem.cli", "rollout"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
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
