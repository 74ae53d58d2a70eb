"""Run model-written Python in a sandbox and report what it did: `run_tests` counts the unit
tests a solution passes (the code task), `run_code` returns what a program printed (the
python tool).

The program runs in namespaces of its own (user, PID, network, mount, IPC, UTS) as an
unprivileged user with no capabilities, in an empty environment, under limits on processes,
address space, file size, CPU seconds and open files, with a fresh tmpfs as its working
directory, and nothing it started outlives the call. Processes, from the caller down; each
is this file run by `python -I`:

    caller -> reaper -> init (PID 1 of the new PID namespace) -> evaluator -> program

- reaper (trusted, on the host): creates the PID namespace (and, unless it runs as root,
  the user namespace), forks init and waits for it. When init ends, the kernel kills every
  process left in its PID namespace: that is why nothing outlives the call. At the
  wall-clock timeout the caller SIGTERMs the reaper, which kills init and waits for it.
- init: builds a minimal root (read-only binds of /usr, the Python installation and this
  file; a fresh /proc; /dev/null, /dev/zero, /dev/urandom; a size-capped tmpfs as /tmp),
  pivots into it, limits the number of processes, forbids nested user namespaces, and runs
  the evaluator. As root (a container), init builds the root as real root, then drops to
  uid 65534 and creates the user namespace, and the reaper writes its id maps; as any other
  user the reaper creates the user namespace first. Either way the program is uid 1000 in
  its namespace, and exec leaves it no capabilities.
- evaluator (trusted, not dumpable): starts the program, then runs each test snippet itself
  with the program's top-level functions bound to proxies. A proxy call sends the function's
  name and arguments to the program over a pipe; the program answers with a value or the
  exception it raised, in a data-only encoding (`_encode`: None, bool, int, float, str,
  bytes, list, tuple, set, frozenset, dict; size and depth bounded). The tests compare plain
  data the evaluator decoded with its own builtins, so an object whose `==` always holds, a
  patched builtin or a patched harness does not reach them. The evaluator reports on its
  stdout, which the program never holds; not being dumpable closes its memory and file
  descriptors to the program through /proc. The program can kill it (same uid): then
  nothing more is reported, which fails safe.
- program (untrusted): lowers its own limits, runs the code, then serves the proxy calls.
  Its stdout and stderr go to files of their own, the program's output.

Where namespaces cannot be made (Docker's default seccomp profile refuses user namespaces,
for one), the sandbox fails closed: every call answers "sandbox unavailable: <why>" and runs
nothing, unless the operator sets TANDEM_SANDBOX=rlimits (`SANDBOX_ENV`).
"""

from __future__ import annotations

import builtins
import functools
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

SANDBOX_ENV = "TANDEM_SANDBOX"
"""`namespaces` (the default): the sandbox above, and no run at all where the kernel refuses
namespaces. `rlimits`: the operator's explicit opt-in to a weaker mode for hosts without
them: the same limits (but no process limit), evaluator and clean-up of descendants, but the
program shares the caller's user, network and file system: it can read what the server's
user can read and reach the network, and as root it can forge the test verdict."""

REAPER_GRACE_S = 2.0
"""How long the caller waits for the reaper's clean-up after the timeout before SIGKILL."""
MAX_MESSAGE_BYTES = 1 << 20
"""Largest encoded call or answer between evaluator and program; a bigger answer fails its test."""
MAX_DEPTH = 100
"""Deepest nesting of containers in a call or an answer."""
SANDBOX_UID = 1000
"""The program's uid (and gid) inside its user namespace: not 0, so exec leaves it no capabilities."""
NOBODY = 65534
"""The host uid and gid the sandbox runs as when the caller is root."""
SCRATCH_BYTES = 64 << 20
"""Size of the program's /tmp (a tmpfs, gone with the call)."""
MAX_OPEN_FILES = 256
_REAPER_ENV = {"PATH": os.defpath, "LC_ALL": "C.UTF-8"}
_SCRIPT_IN_SANDBOX = "/sandbox.py"


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    """Wall-clock seconds for the whole run (solution and all tests)."""
    cpu_s: int = 10
    """CPU seconds of the program process (RLIMIT_CPU; SIGXCPU at the limit, SIGKILL a second later)."""
    memory_bytes: int = 1 << 30
    """Address space of each program process (RLIMIT_AS): a bigger allocation raises MemoryError."""
    output_bytes: int = 1 << 20
    """Largest file the program may write, its stdout included (RLIMIT_FSIZE): a write past
    it raises OSError (EFBIG), as Python ignores SIGXFSZ."""
    num_processes: int = 64
    """Processes (threads included) the program may have at once, itself included
    (RLIMIT_NPROC, counted in the sandbox's own user namespace): a fork past it fails with
    EAGAIN. Not enforced in the `rlimits` mode."""


@dataclass(frozen=True)
class SandboxResult:
    passed: int
    """Tests that ran without raising."""
    total: int
    timed_out: bool
    """The wall-clock timeout expired and everything in the sandbox was killed."""
    error: str | None
    """Why the run did not finish normally (the sandbox unavailable, the timeout, a signal,
    the solution failing to load, an exit before the last test), with the last line of the
    program's stderr when there is one; None when every test ran, passing or failing."""

    @property
    def pass_rate(self) -> float:
        """passed / total, in [0, 1]; 0 with no tests."""
        return self.passed / self.total if self.total else 0.0


@dataclass(frozen=True)
class CodeResult:
    output: str
    """What the program printed on its stdout."""
    error: str | None
    """Why it stopped early: the exception it raised (`ZeroDivisionError: division by
    zero`), the timeout, a signal or the sandbox unavailable; None when it ran to the end."""


def run_tests(solution: str, tests: list[str], limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Execute `solution`, then each test snippet (e.g. `assert f(2) == 4`) against its
    top-level functions; blocks for at most about `limits.timeout_s`."""
    run = _run(solution, tests, limits)
    return SandboxResult(passed=len(run.passed), total=len(tests), timed_out=run.timed_out, error=run.error)


def run_code(code: str, limits: SandboxLimits = SandboxLimits()) -> CodeResult:
    """Execute a program in the sandbox and return what it printed; blocks for at most about
    `limits.timeout_s`."""
    run = _run(code, [], limits)
    error = run.error
    if error is not None and error.startswith("solution failed to load: "):
        error = error.removeprefix("solution failed to load: ")
    return CodeResult(output=run.output.strip("\n"), error=error)


# --- the caller's side ------------------------------------------------------------------


@dataclass
class _Run:
    passed: set[int] = field(default_factory=set)
    timed_out: bool = False
    error: str | None = None
    output: str = ""


def refusal() -> str | None:
    """Why this process may not run model-written code (namespaces refused and no opt-in to
    the weaker mode), or None. Blocks for a trial run the first time."""
    return _refusal(os.environ.get(SANDBOX_ENV, "namespaces"))


def _run(code: str, tests: list[str], limits: SandboxLimits) -> _Run:
    refused = refusal()
    if refused is not None:
        return _Run(error=f"sandbox unavailable: {refused}")
    return _run_in(os.environ.get(SANDBOX_ENV, "namespaces"), code, tests, limits)


def _refusal(mode: str) -> str | None:
    """Why nothing may run in this mode, or None."""
    if mode == "rlimits":
        return None
    if mode != "namespaces":
        return f"{SANDBOX_ENV}={mode!r} is neither 'namespaces' nor 'rlimits'"
    reason = _namespaces_unavailable()
    if reason is None:
        return None
    return f"{reason} (set {SANDBOX_ENV}=rlimits to run code without namespaces)"


@functools.cache
def _namespaces_unavailable() -> str | None:
    """Why this kernel, in this process's security context, refuses the sandbox's
    namespaces, or None: a trial run of an empty program, once per process."""
    trial = _run_in("namespaces", "", [], SandboxLimits(timeout_s=60.0))
    return None if trial.error is None else trial.error.removeprefix("sandbox unavailable: ")


def _run_in(mode: str, code: str, tests: list[str], limits: SandboxLimits) -> _Run:
    job = {
        "code": code,
        "tests": tests,
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_bytes,
        "output_bytes": limits.output_bytes,
    }
    with (
        tempfile.TemporaryDirectory() as workdir,
        tempfile.TemporaryFile() as verdicts,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        command = [
            sys.executable,
            "-I",
            "-S",
            os.path.abspath(__file__),
            "--reaper",
            mode,
            str(limits.num_processes),
            str(out.fileno()),
        ]
        returncode = _run_reaper(command, json.dumps(job).encode(), workdir, verdicts, err, out, limits.timeout_s)
        report = _read_capped(verdicts, MAX_MESSAGE_BYTES)
        output, stderr = _read_capped(out, limits.output_bytes), _read_capped(err, limits.output_bytes)
    verdict = _Verdict.parse(report, len(tests))
    return _Run(
        passed=verdict.passed,
        timed_out=returncode is None,
        output=output,
        error=verdict.describe(returncode, stderr, limits.timeout_s),
    )


def _run_reaper(command: list[str], job: bytes, workdir: str, verdicts, err, out, timeout_s: float) -> int | None:
    """The reaper's return code, or None on timeout. Nothing of the sandbox is left running
    when it returns."""
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=verdicts,
        stderr=err,
        pass_fds=(out.fileno(),),
        cwd=workdir,
        env=_REAPER_ENV,
        start_new_session=True,
    )
    try:
        proc.communicate(job, timeout=timeout_s)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        returncode = None
        proc.terminate()  # the reaper kills init (so the whole namespace) and waits for it
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
        pass  # the reaper exited and left nothing behind


def _read_capped(file, limit_bytes: int) -> str:
    file.seek(0)
    return file.read(limit_bytes).decode("utf-8", errors="replace")


@dataclass
class _Verdict:
    """What the evaluator (or the sandbox's setup) reported, one line each: `loaded`,
    `pass <test index>`, `done`, `ended <program's return code>`, `unavailable <why>`."""

    passed: set[int] = field(default_factory=set)
    progress: set[str] = field(default_factory=set)
    ended: int | None = None
    unavailable: str | None = None

    @classmethod
    def parse(cls, report: str, num_tests: int) -> _Verdict:
        verdict = cls()
        for line in report.splitlines():
            word, _, rest = line.partition(" ")
            if word == "pass" and rest.isdigit() and int(rest) < num_tests:
                verdict.passed.add(int(rest))
            elif word in ("loaded", "done") and not rest:
                verdict.progress.add(word)
            elif word == "ended" and rest.lstrip("-").isdigit():
                verdict.ended = int(rest)
            elif word == "unavailable" and verdict.unavailable is None:  # the first failure is the cause
                verdict.unavailable = rest
        return verdict

    def describe(self, returncode: int | None, stderr: str, timeout_s: float) -> str | None:
        """Why the run did not finish normally, or None."""
        if returncode is None:
            return f"timed out after {timeout_s:g} s"
        if self.unavailable is not None:
            return f"sandbox unavailable: {self.unavailable}"
        if "done" in self.progress:
            return None
        if self.ended is not None and self.ended < 0:
            return f"killed by {signal.Signals(-self.ended).name}"
        if self.ended is None:
            # e.g. the program killed the evaluator: whatever it had reported stands
            reason = f"the sandbox ended without a verdict (status {returncode})"
        elif "loaded" in self.progress:
            # e.g. os._exit, or an output flood: the write past RLIMIT_FSIZE fails
            reason = f"exited with status {self.ended} before running every test"
        else:
            reason = "solution failed to load"
        last_line = stderr.strip().rsplit("\n", 1)[-1]
        return f"{reason}: {last_line}" if last_line else reason


# --- kernel calls (Python 3.11 has no os.unshare) -----------------------------------------

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_STRICTATIME = 1 << 14, 1 << 18, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_ST_RELATIME = 4096


@functools.cache
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(name: str, result: int) -> None:
    if result != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")


def _unshare(flags: int) -> None:
    _check("unshare", _libc().unshare(flags))


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _check(f"mount {target}", _libc().mount(encode(source), encode(target), encode(fstype), flags, encode(data)))


def _pivot_root_here() -> None:
    """Make the current directory the root, the old root gone (pivot_root(".", ".") stacks
    the old root on the new one; the detach takes it off)."""
    _check("pivot_root", _libc().syscall(_SYS_PIVOT_ROOT[os.uname().machine], b".", b"."))
    _check("umount old root", _libc().umount2(b".", MNT_DETACH))
    os.chdir("/")


def _prctl(option: int, value: int) -> None:
    _check("prctl", _libc().prctl(option, value, 0, 0, 0))


# --- the reaper, on the host ------------------------------------------------------------


class _Stop(Exception):
    pass


def _stop(signum, frame) -> None:
    raise _Stop


def _reaper_main(mode: str, num_processes: int, output_fd: int) -> int:
    """Run the evaluator in the sandbox (stdin, stdout, stderr and `output_fd` passed on) and
    return its status. SIGTERM (the caller's timeout) cuts the wait short."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the caller's thread gone, so is the sandbox
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    if mode == "rlimits":
        return _run_unconfined(output_fd)
    try:
        init = _start_init(num_processes, output_fd)
    except OSError as exc:
        _report(f"unavailable {_why(exc)}")
        return 1
    # Only now: a SIGTERM before this ends the reaper by default, and init with it.
    signal.signal(signal.SIGTERM, _stop)
    try:
        return _wait_status(init)
    except _Stop:
        os.kill(init, signal.SIGKILL)  # the kernel kills the rest of its PID namespace
        _wait_status(init)  # init is reaped only once every process in it is gone
        return -signal.SIGTERM


def _start_init(num_processes: int, output_fd: int) -> int:
    """Fork init into a new PID namespace once it has its user namespace, and return its pid."""
    as_root = os.geteuid() == 0
    if as_root:
        _unshare(CLONE_NEWPID)
    else:
        outer_uid, outer_gid = os.geteuid(), os.getegid()
        _unshare(CLONE_NEWUSER | CLONE_NEWPID)
        _write_id_maps("self", outer_uid, outer_gid)
    _prctl(PR_SET_DUMPABLE, 0)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        _init_main(as_root, num_processes, output_fd, ready_w, go_r)
    os.close(ready_w)
    os.close(go_r)
    if not os.read(ready_r, 1):
        return pid  # init failed on its way in, and said why
    if as_root:
        _write_id_maps(str(pid), NOBODY, NOBODY)
    os.write(go_w, b"g")
    return pid


def _write_id_maps(pid: str, outer_uid: int, outer_gid: int) -> None:
    """Map the sandbox's uid and gid to one host uid and gid, and refuse setgroups."""
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{SANDBOX_UID} {outer_uid} 1"),
        ("gid_map", f"{SANDBOX_UID} {outer_gid} 1"),
    ):
        with open(f"/proc/{pid}/{name}", "w") as file:
            file.write(text)


def _why(exc: OSError) -> str:
    return f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc.strerror)


def _wait_status(pid: int) -> int:
    """The return code of a child (negative: killed by that signal)."""
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _run_unconfined(output_fd: int) -> int:
    """The `rlimits` mode: the evaluator in the host's namespaces, and every descendant
    killed at the end (this process becomes their subreaper, so a daemon still lands here)."""
    _prctl(PR_SET_DUMPABLE, 0)  # its stdout is the verdict channel
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGTERM, _stop)
    evaluator = subprocess.Popen(
        _command(os.path.abspath(__file__), "--evaluate", str(output_fd)), pass_fds=(output_fd,)
    )
    try:
        return evaluator.wait()
    except _Stop:
        return -signal.SIGTERM
    finally:
        _kill_descendants()


def _command(script: str, *args: str) -> list[str]:
    return [sys.executable, "-I", "-S", script, *args]


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


# --- init, PID 1 of the sandbox ---------------------------------------------------------


def _init_main(as_root: bool, num_processes: int, output_fd: int, ready_w: int, go_r: int) -> None:
    """Enter the sandbox, run the evaluator and exit as it did; never returns (it is a fork
    of the reaper). A failure before the evaluator runs is reported as `unavailable`."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 ignores signals it has no handler for
    try:
        _enter_sandbox(as_root, num_processes, ready_w, go_r)
        evaluator = _spawn(_command(_SCRIPT_IN_SANDBOX, "--evaluate", str(output_fd)))
    except OSError as exc:
        _report(f"unavailable {_why(exc)}")
        os._exit(1)
    except BaseException as exc:  # noqa: BLE001 - never fall back into the reaper's code
        _report(f"unavailable {type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(_reap_until(evaluator))


def _enter_sandbox(as_root: bool, num_processes: int, ready_w: int, go_r: int) -> None:
    _unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
    _build_root(scratch_owner=NOBODY if as_root else SANDBOX_UID)
    if as_root:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    # Set after the uid change, which clears them; the reaper's go below proves it still
    # lived once the death signal was armed.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_DUMPABLE, 0)
    if as_root:
        _unshare(CLONE_NEWUSER)  # the reaper maps it once told
    os.write(ready_w, b"r")
    if os.read(go_r, 1) != b"g":
        os._exit(1)
    _forbid_user_namespaces()
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    # RLIMIT_NPROC counts the sandbox uid's processes in this user namespace only: init,
    # the evaluator, and the reaper when it made the namespace.
    own = 2 if as_root else 3
    resource.setrlimit(resource.RLIMIT_NPROC, (num_processes + own, num_processes + own))
    os.chdir("/tmp")


def _build_root(scratch_owner: int) -> None:
    """Mount the sandbox's file system on the current directory and pivot into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates out
    root = os.getcwd()
    _mount("sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    _link_host_roots(root)
    # The scratch first: a virtual env or checkout under the host's /tmp (a CI clone) is
    # then bound inside it, read-only, instead of being hidden by it.
    os.mkdir(f"{root}/tmp")
    _mount(
        "scratch",
        f"{root}/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"mode=0700,size={SCRATCH_BYTES},uid={scratch_owner},gid={scratch_owner}",
    )
    for path in _host_paths():
        _bind(path, root + path, read_only=True)
    for name in ("null", "zero", "urandom"):
        _bind(f"/dev/{name}", f"{root}/dev/{name}", read_only=False)
    _bind(os.path.abspath(__file__), root + _SCRIPT_IN_SANDBOX, read_only=True)
    _mount_proc(f"{root}/proc")
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    _pivot_root_here()


def _host_paths() -> list[str]:
    """What Python needs from the host: /usr, the top-level directories a merged /usr
    turns into links, and the interpreter's installation and virtual env."""
    paths = ["/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        if os.path.isdir(f"/{name}") and not os.path.islink(f"/{name}"):
            paths.append(f"/{name}")
    # Under -S, sys.prefix is not the virtual env's: site sets it, from the pyvenv.cfg
    # that sits one level above the interpreter's directory.
    venv = os.path.dirname(os.path.dirname(sys.executable))
    prefixes = [sys.base_prefix, venv] if os.path.exists(f"{venv}/pyvenv.cfg") else [sys.base_prefix]
    for prefix in prefixes:
        if not any(prefix == path or prefix.startswith(path + "/") for path in paths):
            paths.append(prefix)
    return paths


def _bind(source: str, target: str, read_only: bool) -> None:
    """Bind `source` on a new `target` of the same kind; top-level links of the host root
    (/bin -> usr/bin) are recreated as links."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    if os.path.isdir(source):
        os.mkdir(target)
    else:
        open(target, "x").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | _kept_flags(target))


def _kept_flags(path: str) -> int:
    """The flags of a bind's mount that a remount must keep: in a user namespace, the kernel
    refuses one that drops nodev, noexec or the atime mode of a mount from outside."""
    flags = os.statvfs(path).f_flag
    kept = flags & (MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)  # ST_* bits equal MS_* bits here
    if not flags & (_ST_RELATIME | MS_NOATIME):
        kept |= MS_STRICTATIME
    return kept


def _mount_proc(target: str) -> None:
    """A /proc of the sandbox's PID namespace. A kernel refuses one while the host's /proc
    is partly masked (Kubernetes and Docker mask some of its files): then the sandbox goes
    without, as Python runs without it."""
    os.mkdir(target)
    try:
        _mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except PermissionError:
        pass


def _forbid_user_namespaces() -> None:
    """No nested user namespace, so the program cannot gain capabilities over new mount or
    network namespaces (kernel attack surface). Needs the sandbox's /proc."""
    if os.path.exists("/proc/sys/user/max_user_namespaces"):
        with open("/proc/sys/user/max_user_namespaces", "w") as file:
            file.write("0")


def _link_host_roots(root: str) -> None:
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        if os.path.islink(f"/{name}"):
            os.symlink(os.readlink(f"/{name}"), f"{root}/{name}")


def _spawn(command: list[str]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            os.execv(command[0], command)
        except OSError as exc:
            print(f"sandbox: cannot run {command[0]}: {exc}", file=sys.stderr)
        finally:
            os._exit(127)
    return pid


def _reap_until(pid: int) -> int:
    """Reap every child (orphans are re-parented to PID 1) until `pid` ends; its exit code,
    or 128 + signal."""
    while True:
        child, status = os.wait()
        if child == pid:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


# --- the evaluator ----------------------------------------------------------------------


def _report(message: str) -> None:
    """A line on the verdict channel, fd 1, which only the trusted processes hold."""
    os.write(1, f"{message}\n".encode())


def _evaluator_main(output_fd: int) -> None:
    _prctl(PR_SET_DUMPABLE, 0)  # before the program exists: /proc/<pid>/fd and mem stay shut
    job = json.loads(sys.stdin.buffer.read())
    program = _Program(output_fd)
    names = program.load(job)
    if names is None:
        if not program.gone:
            program.process.kill()  # it answered out of protocol
        _report(f"ended {program.wait()}")
        return
    _report("loaded")
    namespace = {name: _proxy(program, name) for name in names}
    for index, test in enumerate(job["tests"]):
        if _passes(test, index, namespace):
            _report(f"pass {index}")
        if program.gone:
            _report(f"ended {program.wait()}")
            return
    _report("done")
    program.finish()


def _passes(test: str, index: int, names: dict) -> bool:
    try:
        exec(compile(test, f"<test {index}>", "exec"), {"__builtins__": builtins, **names})
    except BaseException:  # noqa: BLE001 - a failing test, whatever it raised
        return False
    return True


class _ProgramGone(Exception):
    pass


class _Program:
    """The untrusted program process, seen from the evaluator: a function call in, a value or
    an exception out."""

    def __init__(self, output_fd: int) -> None:
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), "--program", str(requests_r), str(answers_w)],
            stdin=subprocess.DEVNULL,
            stdout=output_fd,
            pass_fds=(requests_r, answers_w),
            env={},
        )
        for fd in (requests_r, answers_w, output_fd):
            os.close(fd)
        self.requests = open(requests_w, "wb")
        self.answers = open(answers_r, "rb")
        self.gone = False

    def load(self, job: dict) -> list[str] | None:
        """Send the code and its limits; the names of its top-level functions, or None when
        it did not load."""
        try:
            self._send([job["code"], job["cpu_s"], job["memory_bytes"], job["output_bytes"]])
            names = self._receive()
        except (_ProgramGone, ValueError):
            return None
        if not (isinstance(names, list) and all(isinstance(n, str) and n.isidentifier() for n in names)):
            return None
        # A name that shadows a builtin would let the program answer for `sorted` or `len`
        # in the tests; keyword and dunder names are not the program's functions.
        return [name for name in names if not hasattr(builtins, name) and not name.startswith("__")]

    def call(self, name: str, args: tuple, kwargs: dict):
        self._send(_encode((name, args, kwargs)))
        answer = _decode(self._receive())
        if isinstance(answer, tuple) and len(answer) == 2 and answer[0] == "value":
            return answer[1]
        if isinstance(answer, tuple) and len(answer) == 3 and answer[0] == "raise":
            raise _exception(str(answer[1]), str(answer[2]))
        raise ValueError("the program answered out of protocol")

    def _send(self, message) -> None:
        try:
            _write_message(self.requests, message)
        except OSError:
            self.gone = True
            raise _ProgramGone from None

    def _receive(self):
        try:
            return _read_message(self.answers)
        except EOFError:
            self.gone = True
            raise _ProgramGone from None

    def wait(self) -> int:
        return self.process.wait()

    def finish(self) -> None:
        """Let the program end (it flushes its output) and wait for it."""
        self.requests.close()
        self.process.wait()


def _proxy(program: _Program, name: str):
    def call(*args, **kwargs):
        return program.call(name, args, kwargs)

    call.__name__ = call.__qualname__ = name
    return call


_ITERATION_ENDS = ("StopIteration", "StopAsyncIteration")
"""Exceptions that end an iteration: raised in a test by `map`'s function, they would end
`all(map(...))` early and make it true. Like a generator since PEP 479, the evaluator
raises them as RuntimeError, so a call that raised one can only fail its test."""


def _exception(type_name: str, message: str) -> Exception:
    """The builtin exception of that name (so `except ValueError` works in a test), or a
    plain Exception; never a BaseException such as SystemExit, which would stop the evaluator,
    nor one that ends an iteration."""
    if type_name in _ITERATION_ENDS:
        return RuntimeError(f"the solution raised {type_name}: {message}")
    cls = getattr(builtins, type_name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:
            pass  # e.g. UnicodeDecodeError takes five arguments
    return Exception(f"{type_name}: {message}")


# --- the program ------------------------------------------------------------------------


def _program_main(requests_fd: int, answers_fd: int) -> None:
    for fd in (requests_fd, answers_fd):
        os.set_inheritable(fd, False)  # a process the program execs does not keep the evaluator waiting
    requests, answers = open(requests_fd, "rb"), open(answers_fd, "wb")
    code, cpu_s, memory_bytes, output_bytes = _read_message(requests)
    _limit_self(cpu_s, memory_bytes, output_bytes)
    namespace = {"__name__": "__solution__"}  # the solution's `if __name__ == "__main__"` stays off
    try:
        exec(compile(code, "<solution>", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: the solution did not load
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
    _write_message(answers, [name for name, value in namespace.items() if callable(value)])
    while True:
        try:
            request = _read_message(requests)
        except EOFError:
            return  # the evaluator is done
        _write_message(answers, _answer(namespace, request))


def _limit_self(cpu_s: int, memory_bytes: int, output_bytes: int) -> None:
    """Lower soft and hard limits together so the program cannot raise them again."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))


def _answer(namespace: dict, request):
    """Call the function a request names; the encoded ("value", result) or ("raise", type
    name, message)."""
    try:
        name, args, kwargs = _decode(request)
        return _encode(("value", namespace[name](*args, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: that call failed, not the program
        return _encode(("raise", type(exc).__name__, str(exc)[:1000]))


# --- the wire between evaluator and program ---------------------------------------------


def _write_message(stream, message) -> None:
    payload = json.dumps(message).encode()
    stream.write(len(payload).to_bytes(4, "big") + payload)
    stream.flush()


def _read_message(stream):
    """The next message; EOFError when the writer is gone, ValueError for one that is too
    big (skipped, so the next one still lines up) or not JSON."""
    header = stream.read(4)
    if len(header) < 4:
        raise EOFError
    size = int.from_bytes(header, "big")
    if size > MAX_MESSAGE_BYTES:
        _skip(stream, size)
        raise ValueError(f"message of {size} bytes")
    payload = stream.read(size)
    if len(payload) < size:
        raise EOFError
    return json.loads(payload)


def _skip(stream, size: int) -> None:
    while size > 0:
        chunk = stream.read(min(size, 1 << 16))
        if not chunk:
            raise EOFError
        size -= len(chunk)


_SEQUENCES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
_SCALARS = {"bool": bool, "int": int, "float": float, "str": str}


def _encode(value, depth: int = 0) -> list:
    """`value` as JSON-ready [type name, payload]; TypeError for anything but plain data.
    Subclasses become their base (a Counter a dict), so what arrives is plain data."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if value is None:
        return ["none", None]
    for name, kind in _SCALARS.items():  # bool before int: True is an int too
        if isinstance(value, kind):
            return [name, kind(value)]
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", bytes(value).hex()]
    for name, kind in _SEQUENCES.items():
        if isinstance(value, kind):
            return [name, [_encode(item, depth + 1) for item in value]]
    if isinstance(value, dict):
        return ["dict", [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]]
    raise TypeError(f"a {type(value).__name__} cannot leave the sandbox, only plain data")


def _decode(node, depth: int = 0):
    """The value `_encode` made; ValueError for anything else (unhashable keys included)."""
    if depth > MAX_DEPTH or not (isinstance(node, list) and len(node) == 2 and isinstance(node[0], str)):
        raise ValueError("not an encoded value")
    name, payload = node
    if name == "none" and payload is None:
        return None
    if name in _SCALARS and type(payload) is _SCALARS[name]:
        return payload
    if name == "bytes" and isinstance(payload, str):
        return bytes.fromhex(payload)
    if name in _SEQUENCES and isinstance(payload, list):
        try:
            return _SEQUENCES[name](_decode(item, depth + 1) for item in payload)
        except TypeError as exc:  # an unhashable member of a set
            raise ValueError(str(exc)) from None
    if name == "dict" and isinstance(payload, list) and all(isinstance(p, list) and len(p) == 2 for p in payload):
        try:
            return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in payload}
        except TypeError as exc:
            raise ValueError(str(exc)) from None
    raise ValueError("not an encoded value")


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if role == "--reaper":
        sys.exit(_reaper_main(args[0], int(args[1]), int(args[2])) & 0xFF)
    elif role == "--evaluate":
        _evaluator_main(int(args[0]))
    elif role == "--program":
        _program_main(int(args[0]), int(args[1]))
