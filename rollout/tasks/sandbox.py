"""Run untrusted Python against unit tests in a child process with time, memory and output
limits, and count the tests that pass.

The parent (`run_tests`) starts `python -I` on this very file in a fresh temporary working
directory, with a minimal environment and its own process group, and sends the job on
stdin. The child (`_child_main`) first lowers its own resource limits (CPU seconds, address
space, size of any file written, its stdout included; no core dumps), then executes the
solution once and each test in turn in a copy of the solution's namespace. A test passes
when it runs without raising. The child reports on lines of their own on stdout, each
starting with a random nonce the parent sent on stdin (so printing from the solution cannot
forge a report by accident): `<nonce> loaded` once the solution ran, `<nonce> pass <index>`
after each passing test, `<nonce> done` at the end. Counting line by line keeps the passes
made before a later test loops or floods.

Between the parent and the child sits a trusted reaper (this file with `--reaper`): it
makes itself the subreaper of everything below it (Linux `PR_SET_CHILD_SUBREAPER`), so a
process the solution starts in a session of its own, and orphans, still lands under it;
when the child ends, or on the parent's SIGTERM at the wall-clock timeout, it kills every
descendant before it exits. The parent then kills the whole process group as a fallback.
Limits are set in the child rather than in `preexec_fn`, which is unsafe in a threaded
parent (the rollout server runs this from worker threads).

Not a security boundary: the solution runs in the same interpreter as the child's harness
and can reach the network and the file system with the caller's permissions.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


REAPER_GRACE_S = 2.0
"""How long the parent waits for the reaper's clean-up after the timeout before SIGKILL."""
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    """Wall-clock seconds for the whole run (solution and all tests)."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU; SIGXCPU at the limit, SIGKILL a second later)."""
    memory_bytes: int = 1 << 30
    """Address space (RLIMIT_AS): a bigger allocation raises MemoryError in the child."""
    output_bytes: int = 1 << 20
    """Largest file the child may write, its stdout included (RLIMIT_FSIZE): a write past
    it raises OSError (EFBIG), as Python ignores SIGXFSZ."""


@dataclass(frozen=True)
class SandboxResult:
    passed: int
    """Tests that ran without raising."""
    total: int
    timed_out: bool
    """The wall-clock timeout expired and the process group was killed."""
    error: str | None
    """Why the run did not finish normally (the timeout, a signal, the solution failing to
    load, an exit before the last test), with the last line of stderr when there is one;
    None when every test ran, passing or failing."""

    @property
    def pass_rate(self) -> float:
        """passed / total, in [0, 1]; 0 with no tests."""
        return self.passed / self.total if self.total else 0.0


def run_tests(solution: str, tests: list[str], limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Execute `solution`, then each test snippet (e.g. `assert f(2) == 4`), in a limited
    child process; blocks for at most about `limits.timeout_s`."""
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "solution": solution, "tests": tests, "cpu_s": limits.cpu_s,
           "memory_bytes": limits.memory_bytes, "output_bytes": limits.output_bytes}
    with tempfile.TemporaryDirectory() as workdir, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        returncode = _run_child(json.dumps(job).encode(), workdir, out, err, limits.timeout_s)
        stdout, stderr = _read_capped(out, limits.output_bytes), _read_capped(err, limits.output_bytes)
    passed, progress = _read_reports(stdout, nonce, len(tests))
    return SandboxResult(passed=len(passed), total=len(tests), timed_out=returncode is None,
                         error=_describe_failure(returncode, progress, stderr, limits.timeout_s))


@dataclass(frozen=True)
class CodeResult:
    output: str
    """What the program printed (the harness's own report lines removed)."""
    error: str | None
    """Why it stopped early: the exception it raised (`ZeroDivisionError: division by
    zero`), the timeout or a signal; None when it ran to the end."""


def run_code(code: str, limits: SandboxLimits = SandboxLimits()) -> CodeResult:
    """Execute a program in the same limited child process as `run_tests` and return what it
    printed; blocks for at most about `limits.timeout_s`."""
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "solution": code, "tests": [], "cpu_s": limits.cpu_s,
           "memory_bytes": limits.memory_bytes, "output_bytes": limits.output_bytes}
    with tempfile.TemporaryDirectory() as workdir, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        returncode = _run_child(json.dumps(job).encode(), workdir, out, err, limits.timeout_s)
        stdout, stderr = _read_capped(out, limits.output_bytes), _read_capped(err, limits.output_bytes)
    _, progress = _read_reports(stdout, nonce, 0)
    # A report starts on a line of its own: drop those lines and the newline put before each.
    printed = "\n".join(line for line in stdout.split("\n") if not line.startswith(nonce))
    error = _describe_failure(returncode, progress, stderr, limits.timeout_s)
    if error is not None and error.startswith("solution failed to load: "):
        error = error.removeprefix("solution failed to load: ")
    return CodeResult(output=printed.strip("\n"), error=error)


def _run_child(job: bytes, workdir: str, out, err, timeout_s: float) -> int | None:
    """The child's return code (negative: killed by that signal), or None on timeout.
    Every process the child left behind is killed either way."""
    proc = subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), "--reaper"], stdin=subprocess.PIPE, stdout=out,
        stderr=err, cwd=workdir, env={"PATH": os.defpath, "LC_ALL": "C.UTF-8"}, start_new_session=True,
    )
    try:
        proc.communicate(job, timeout=timeout_s)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        returncode = None
        proc.terminate()  # the reaper kills the child and everything below it, then exits
        try:
            proc.wait(timeout=REAPER_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc.pid)
    proc.wait()
    return returncode


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the child exited and left nothing behind


def _read_capped(file, limit_bytes: int) -> str:
    file.seek(0)
    return file.read(limit_bytes).decode("utf-8", errors="replace")


def _read_reports(stdout: str, nonce: str, num_tests: int) -> tuple[set[int], set[str]]:
    """The indices of the tests the child reported passed, and its progress reports:
    'loaded' once the solution ran, 'done' once every test did."""
    passed, progress = set(), set()
    for line in stdout.splitlines():
        parts = line.split()
        if parts[:1] != [nonce]:
            continue
        if len(parts) == 3 and parts[1] == "pass" and parts[2].isdigit() and int(parts[2]) < num_tests:
            passed.add(int(parts[2]))
        elif len(parts) == 2:
            progress.add(parts[1])
    return passed, progress


def _describe_failure(returncode: int | None, progress: set[str], stderr: str, timeout_s: float) -> str | None:
    if returncode is None:
        return f"timed out after {timeout_s:g} s"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    if "loaded" not in progress:
        reason = "solution failed to load"
    elif returncode != 0 or "done" not in progress:
        # e.g. an output flood: the write past RLIMIT_FSIZE fails (Python ignores SIGXFSZ)
        reason = f"exited with status {returncode} before running every test"
    else:
        return None
    last_line = stderr.strip().rsplit("\n", 1)[-1]
    return f"{reason}: {last_line}" if last_line else reason


# --- the child's side ---------------------------------------------------------------


def _limit_self(job: dict) -> None:
    """Lower soft and hard limits together so the solution cannot raise them again."""
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_s"], job["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (job["output_bytes"], job["output_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _child_main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    _limit_self(job)
    namespace = {"__name__": "__solution__"}  # the solution's `if __name__ == "__main__"` stays off
    try:
        exec(compile(job["solution"], "<solution>", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: the solution did not load
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
    _report(job["nonce"], "loaded")
    for index, test in enumerate(job["tests"]):
        try:
            exec(compile(test, f"<test {index}>", "exec"), dict(namespace))
        except BaseException:  # noqa: BLE001 - a failing test, whatever it raised
            continue
        _report(job["nonce"], f"pass {index}")
    _report(job["nonce"], "done")


def _report(nonce: str, message: str) -> None:
    # Straight to fd 1 on a line of its own: the solution may have replaced sys.stdout or
    # left a line unfinished.
    os.write(1, f"\n{nonce} {message}\n".encode())


# --- the reaper, between the parent and the child ---------------------------------------


class _Stop(Exception):
    pass


def _reaper_main() -> int:
    """Run the child (stdin, stdout and stderr are passed on), then kill whatever is left
    below this process; exit as the child did. SIGTERM (the parent's timeout) cuts the wait short."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _become_subreaper()

    def stop(signum, frame) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    child = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)])
    try:
        returncode = child.wait()
    except _Stop:
        returncode = -signal.SIGTERM
    _kill_descendants()
    return returncode


def _become_subreaper() -> None:
    """Orphans below this process are re-parented to it rather than to init (Linux only;
    elsewhere a process that leaves its session escapes the clean-up)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _kill_descendants() -> None:
    """SIGKILL every live process below this one and reap the ones re-parented here, until
    none is left (a process may fork while the others are being killed)."""
    for _ in range(100):
        live = _descendants(os.getpid())
        if not live:
            return
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()
    _reap()


def _descendants(root: int) -> list[int]:
    """Live (non-zombie) processes below `root`, from /proc."""
    children: dict[int, list[tuple[int, bool]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append((int(entry), fields[0] == "Z"))
    found, todo = [], [root]
    while todo:
        for pid, zombie in children.get(todo.pop(), []):
            todo.append(pid)
            if not zombie:
                found.append(pid)
    return found


def _reap() -> None:
    """Collect every child of this process that has ended (re-parented ones included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _exit_like(returncode: int) -> None:
    """End this process the way the child ended: its exit status, or its signal."""
    if returncode >= 0:
        sys.exit(returncode)
    signal.signal(-returncode, signal.SIG_DFL)
    os.kill(os.getpid(), -returncode)
    sys.exit(128 - returncode)  # a signal that does not end a process by default


if __name__ == "__main__":
    if sys.argv[1:] == ["--reaper"]:
        _exit_like(_reaper_main())
    else:
        _child_main()
