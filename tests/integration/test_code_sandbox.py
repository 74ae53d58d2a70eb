"""The code task's sandbox against real child processes: right and wrong code, and programs
that loop, eat memory, flood their output or leave processes behind. What the program cannot
reach or forge is in test_sandbox_isolation.py."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import secrets
import time

import pytest

from rollout.tasks.code_chat import FIXTURE as CODE_FIXTURE
from rollout.tools.sandbox import SandboxLimits, run_code, run_tests

FAST = SandboxLimits(timeout_s=1.0, cpu_s=5, memory_bytes=512 << 20, output_bytes=64 << 10)
SLOWER = dataclasses.replace(FAST, timeout_s=10.0)
"""For runs that must finish: a loaded machine once took over a second to start the sandbox."""
CODE_ROWS = [json.loads(line) for line in CODE_FIXTURE.read_text().splitlines()]


@pytest.mark.parametrize("row", CODE_ROWS, ids=[row["goal"].split("`")[1] for row in CODE_ROWS])
def test_every_reference_solution_passes_all_its_tests(row):
    result = run_tests(row["reference"], row["tests"])
    assert (result.passed, result.total, result.timed_out, result.error) == (
        len(row["tests"]),
        len(row["tests"]),
        False,
        None,
    )


def test_wrong_code_fails_exactly_the_tests_it_gets_wrong():
    off_by_one = (
        "def moving_average(values, window):\n"
        "    return [sum(values[i:i + window]) / window for i in range(len(values) - window)]\n"
    )
    tests = [
        "assert moving_average([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]",  # loses the last mean
        "assert moving_average([1, 2], 3) == []",  # still empty
        "assert moving_average([5], 1) == [5.0]",
    ]  # loses its only mean

    result = run_tests(off_by_one, tests)

    assert (result.passed, result.total, result.pass_rate, result.error) == (1, 3, pytest.approx(1 / 3), None)


def test_an_infinite_loop_is_killed_at_the_wall_clock_timeout_keeping_earlier_passes():
    started = time.monotonic()
    result = run_tests("def spin():\n    while True:\n        pass\n", ["assert True", "spin()", "assert True"], FAST)
    elapsed_s = time.monotonic() - started

    assert result.timed_out
    assert (result.passed, result.total, result.error) == (1, 3, "timed out after 1 s")
    assert 1.0 <= elapsed_s < 2.5


def test_cpu_time_is_capped_even_when_the_wall_clock_allows_more():
    limits = SandboxLimits(timeout_s=30.0, cpu_s=1, memory_bytes=512 << 20, output_bytes=64 << 10)
    started = time.monotonic()
    result = run_tests("while True:\n    pass\n", ["assert True"], limits)

    assert not result.timed_out
    assert (result.passed, result.error) == (0, "killed by SIGXCPU")
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize(
    "hungry",
    [
        "def eat():\n    return bytearray(8 << 30)\n",  # one huge allocation
        "def eat():\n    chunks = []\n    while True:\n        chunks.append(bytearray(1 << 20))\n",  # steady growth
    ],
    ids=["one_huge_allocation", "steady_growth"],
)
def test_a_memory_hungry_test_fails_with_memory_error_and_the_rest_still_run(hungry):
    limit_before = resource.getrlimit(resource.RLIMIT_AS)
    # Growing to the limit a MiB at a time took over FAST's 1 s of wall time once on a loaded
    # machine: the memory limit is under test here, not the clock.
    limits = dataclasses.replace(FAST, timeout_s=10.0)
    result = run_tests(hungry, ["assert True", "eat()", "assert 1 + 1 == 2"], limits)

    assert (result.passed, result.total, result.timed_out, result.error) == (2, 3, False, None)
    assert resource.getrlimit(resource.RLIMIT_AS) == limit_before  # the caller's limits are untouched


def test_an_output_flood_fails_its_test_at_the_file_size_limit_and_the_rest_still_run():
    flood = "def shout():\n    while True:\n        print('x' * 1000)\n"
    result = run_tests(flood, ["assert True", "shout()", "assert True"], FAST)
    assert (result.passed, result.timed_out, result.error) == (2, False, None)


def test_a_program_flooding_its_output_is_cut_at_the_file_size_limit():
    result = run_code("while True:\n    print('x' * 1000)\n", FAST)
    assert (len(result.output), result.error) == (FAST.output_bytes, "OSError: [Errno 27] File too large")


def test_printing_pass_lines_does_not_forge_passes():
    forger = "print('pass 0')\nprint('0 pass 0')\nprint('\\nx pass 1 \\n')\n"
    result = run_tests(forger, ["assert False", "assert False"], FAST)
    assert (result.passed, result.error) == (0, None)


@pytest.mark.parametrize(
    "test",
    [
        "assert all(map(lambda x: double(x) == 2 * x, [1, 2, 3]))",
        "assert all(double(x) == 2 * x for x in [1, 2, 3])",
        "assert list(map(double, [1, 2])) == []",
        "assert [double(x) for x in [1]] == [2]",
    ],
)
def test_a_solution_raising_stop_iteration_fails_tests_that_iterate_over_its_calls(test):
    stopper = "def double(x):\n    raise StopIteration\n"
    result = run_tests(stopper, [test, "assert double(2) == 4"], SLOWER)
    assert (result.passed, result.total, result.error) == (0, 2, None)


@pytest.mark.parametrize(
    ("solution", "error"),
    [
        ("def broken(:\n", "solution failed to load: SyntaxError: invalid syntax (<solution>, line 1)"),
        ("raise SystemExit(3)\n", "solution failed to load: SystemExit: 3"),
        ("import os\nos._exit(0)\n", "solution failed to load"),
    ],
)
def test_a_solution_that_does_not_load_passes_nothing_and_says_why(solution, error):
    result = run_tests(solution, ["assert True"], FAST)
    assert (result.passed, result.error) == (0, error)


def test_exit_calls_fail_a_test_or_end_the_run_early():
    exits = "import os, sys\ndef leave():\n    sys.exit(0)\ndef vanish():\n    os._exit(0)\n"
    result = run_tests(exits, ["leave()", "assert True", "vanish()", "assert True"], FAST)
    assert (result.passed, result.error) == (1, "exited with status 0 before running every test")


def test_processes_the_solution_starts_are_killed_with_it():
    token = secrets.token_hex(8)
    spawner = (
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])\n"
        "def child_alive():\n    return child.poll() is None\n"
    )

    result = run_tests(spawner, ["import time\ntime.sleep(0.2)\nassert child_alive()"], SLOWER)

    assert result.passed == 1  # it ran during the call
    assert processes_with(token) == []  # and not after


# A grandchild in a session (and process group) of its own, its parent gone: out of reach of
# a process-group kill.
ESCAPER = (
    "import os, sys, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        open('/tmp/pid', 'w').write(str(os.getpid()))\n"
    "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', TOKEN])\n"
    "    os._exit(0)\n"
    "time.sleep(0.3)\n"
    "def escaped_alive():\n    os.kill(int(open('/tmp/pid').read()), 0)\n    return True\n"
    "def spin():\n    while True:\n        pass\n"
)


def test_a_process_that_leaves_the_session_is_killed_too():
    token = secrets.token_hex(8)
    result = run_tests(f"TOKEN = {token!r}\n" + ESCAPER, ["assert escaped_alive()"], SLOWER)

    assert result.passed == 1
    assert processes_with(token) == []


def test_a_process_that_leaves_the_session_is_killed_at_the_timeout():
    token = secrets.token_hex(8)
    result = run_tests(
        f"TOKEN = {token!r}\n" + ESCAPER, ["assert escaped_alive()", "spin()"], dataclasses.replace(FAST, timeout_s=3.0)
    )

    assert (result.passed, result.timed_out) == (1, True)
    assert processes_with(token) == []


def processes_with(token: str) -> list[int]:
    """Host pids whose command line holds `token`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if token.encode() in cmdline.read():
                    found.append(int(entry))
        except OSError:
            continue  # gone meanwhile
    return found
