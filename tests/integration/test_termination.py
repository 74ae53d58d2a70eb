"""`tandem demo` (and `up`, which shares the handler) stopped by SIGTERM, as a CI timeout or a
plain `kill` stops it, takes every process it started down with it: the services run in
sessions of their own, so nothing but the launcher's own clean-up reaches them."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest
from helpers import wait_for

pytestmark = pytest.mark.slow


def test_sigterm_to_the_demo_stops_every_process_it_started(tmp_path):
    demo = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "demo", "--out", str(tmp_path), "--steps", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for(lambda: "submitted" in demo.stdout.readline(), 240, "the stack to be up and the job submitted")
        started = psutil.Process(demo.pid).children(recursive=True)
        names = {" ".join(p.cmdline()[1:4]) for p in started}
        assert any("cli rollout" in n for n in names) and any("learner.torchrun" in n for n in names), names

        demo.send_signal(signal.SIGTERM)

        assert demo.wait(timeout=120) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(started, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if demo.poll() is None:  # the test failed with the demo still up: leave nothing behind
            survivors = psutil.Process(demo.pid).children(recursive=True)
            demo.kill()
            for process in survivors:
                process.kill()
