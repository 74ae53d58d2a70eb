"""The memory one sandbox call can hold, with the default limits: no cgroup caps the call as
a whole, so the bound is arithmetic. At most `num_processes` processes (RLIMIT_NPROC), each
at most `memory_bytes` of address space (RLIMIT_AS, inherited across fork and not raisable),
plus the /tmp tmpfs (`SCRATCH_BYTES`, host memory the processes' limits do not count). Each
factor is checked on a real sandbox here, for `SandboxLimits()` as the python tool uses it."""

from __future__ import annotations

from rollout.tools.sandbox import SCRATCH_BYTES, SandboxLimits, run_code

DEFAULTS = SandboxLimits()
FORK_ALL = """
import os, resource
r, w = os.pipe()
children = 0
try:
    while True:
        if os.fork() == 0:
            os.close(w)
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            try:
                resource.setrlimit(resource.RLIMIT_AS, (hard + 1, hard + 1))
                raised = "raised"
            except (ValueError, OSError):
                raised = "kept"
            print(soft, hard, raised, flush=True)
            os.read(r, 1)  # alive until the parent has forked all it can
            os._exit(0)
        children += 1
except BlockingIOError:
    pass
os.close(w)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
scratch = os.statvfs("/tmp")
print("children", children, "scratch", scratch.f_frsize * scratch.f_blocks)
"""


def test_a_calls_processes_and_scratch_hold_at_most_num_processes_times_memory_bytes_plus_scratch():
    result = run_code(FORK_ALL, DEFAULTS)

    assert result.error is None, result.error
    *children, summary = result.output.splitlines()
    _, forked, _, scratch_bytes = summary.split()
    assert int(forked) == len(children) == DEFAULTS.num_processes - 1  # and the program itself
    assert set(children) == {f"{DEFAULTS.memory_bytes} {DEFAULTS.memory_bytes} kept"}
    assert int(scratch_bytes) == SCRATCH_BYTES
    bound_bytes = (int(forked) + 1) * DEFAULTS.memory_bytes + int(scratch_bytes)
    assert bound_bytes == DEFAULTS.num_processes * DEFAULTS.memory_bytes + SCRATCH_BYTES == (64 << 30) + (64 << 20)
