"""Two real gloo ranks for a unit test: the same script in two Python processes, as torchrun
would start them (tests/ is on sys.path: pytest puts the folder of the root conftest.py there)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tandem.redis_embed import free_port

ROOT = Path(__file__).resolve().parents[1]


def run_two_ranks(script: str, *args: str, timeout_s: float = 300) -> list[str]:
    """Run `script` as ranks 0 and 1 (`sys.argv[1:3]` = rank, a free port for the rendezvous;
    then `args`); both must exit 0. Returns each rank's output."""
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), port, *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=timeout_s)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    return outputs
