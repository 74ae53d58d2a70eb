"""What a program in the sandbox cannot reach, outlive or forge: each test is an attack a
policy could find, run against real processes, and each fails on a sandbox that is only a
child process with rlimits."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
from test_code_sandbox import processes_with

from rollout.tasks.code_chat import FIXTURE as CODE_FIXTURE
from rollout.tools import sandbox
from rollout.tools.sandbox import SANDBOX_ENV, SandboxLimits, run_code, run_tests

FAST = SandboxLimits(timeout_s=5.0, cpu_s=5, memory_bytes=512 << 20, output_bytes=64 << 10)
CHUNK = next(json.loads(line) for line in CODE_FIXTURE.read_text().splitlines() if "`chunk(" in line)
SLEEPER = "[sys.executable, '-c', 'import time; time.sleep(30)', TOKEN]"
"""An argv that runs 30 s and carries the test's token, so the host's /proc shows whether it
outlived the call."""


def with_token(code: str) -> tuple[str, str]:
    token = secrets.token_hex(8)
    return f"import os, sys, time\nTOKEN = {token!r}\n" + code, token


def test_the_program_sees_nothing_of_the_callers_environment(monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("TANDEM_TEST_SECRET", secret)
    snooper = (
        "import os\n"
        "print(dict(os.environ))\n"
        "for pid in ['self', str(os.getppid()), '1', *os.listdir('/proc')]:\n"
        "    try:\n"
        "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print(pid, type(exc).__name__)\n"
    )

    result = run_code(snooper, FAST)

    assert secret not in result.output
    assert result.error is None
    # Empty but for the locale Python itself coerces C to.
    assert result.output.splitlines()[0] == "{'LC_CTYPE': 'C.UTF-8'}"
    assert "1 PermissionError" in result.output.splitlines()  # init is not dumpable


def test_the_program_cannot_connect_to_a_server_on_the_callers_loopback():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        caller = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as exc:\n"
            "    print(type(exc).__name__, exc.errno)\n"
        )

        result = run_code(caller, FAST)

        assert (result.output, result.error) == ("OSError 101", None)  # ENETUNREACH: its loopback is down
        with pytest.raises(BlockingIOError):
            server.accept()


def test_the_program_cannot_read_or_write_the_callers_files_but_has_a_scratch_dir(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(secrets.token_hex(16))
    planted = tmp_path / "planted"
    prowler = (
        f"for path in [{str(secret)!r}, '/etc/passwd', {os.path.abspath('pyproject.toml')!r}]:\n"
        "    try:\n"
        "        print(open(path).read())\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__)\n"
        "try:\n"
        f"    open({str(planted)!r}, 'w').write('x')\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
        "import os\n"
        "open('scratch', 'w').write('mine')\n"
        "print(os.getcwd(), open('/tmp/scratch').read())\n"
    )

    result = run_code(prowler, FAST)

    assert result.output.splitlines() == ["FileNotFoundError"] * 4 + ["/tmp mine"]
    assert not planted.exists()


def test_the_program_can_have_exactly_its_process_limit_and_no_more():
    limits = SandboxLimits(timeout_s=5.0, cpu_s=5, memory_bytes=512 << 20, output_bytes=64 << 10, num_processes=6)
    forker, token = with_token(
        "forked = 0\n"
        "try:\n"
        "    for _ in range(12):\n"
        "        if os.fork() == 0:\n"
        f"            os.execv(sys.executable, {SLEEPER})\n"
        "        forked += 1\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
        "print(forked)\n"
    )

    result = run_code(forker, limits)

    assert (result.output, result.error) == ("BlockingIOError\n5", None)  # 5 children and itself
    assert processes_with(token) == []


def test_a_fork_bomb_ends_at_the_timeout_and_leaves_nothing():
    limits = SandboxLimits(timeout_s=1.0, cpu_s=5, memory_bytes=512 << 20, output_bytes=64 << 10, num_processes=8)
    bomb, token = with_token(
        "bomb = 'import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass\\n'\n"
        "os.execv(sys.executable, [sys.executable, '-c', bomb, TOKEN])\n"
    )

    result = run_code(bomb, limits)

    assert result.error == "timed out after 1 s"
    assert processes_with(token) == []


DAEMON = (
    "import signal\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    f"        os.execv(sys.executable, {SLEEPER})\n"
    "    os._exit(0)\n"
    "time.sleep(0.3)\n"
)
"""Leaves a grandchild in a session of its own, out of reach of a process-group kill."""


def test_a_daemon_does_not_outlive_a_call_whose_supervisor_it_stopped():
    limits = SandboxLimits(timeout_s=1.0, cpu_s=5, memory_bytes=512 << 20, output_bytes=64 << 10)
    stopper, token = with_token(DAEMON + "os.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(10)\n")

    result = run_tests(stopper, ["assert True"], limits)

    assert processes_with(token) == []
    assert (result.passed, result.timed_out) == (0, True)


def test_killing_its_supervisor_does_not_let_a_daemon_outlive_the_call():
    # Its parent is the evaluator: the run ends with nothing reported.
    killer, token = with_token(DAEMON + "os.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(5)\n")

    result = run_tests(killer, ["assert True"], FAST)

    assert processes_with(token) == []
    assert (result.passed, result.error) == (0, "the sandbox ended without a verdict (status 137)")


FORGERS = {
    # The report lines, with the nonce found in the harness's frame if any, on its own
    # stdout and on the stdout of each ancestor below the test process; then quit.
    "report_lines": (
        "import os, sys\n"
        "job = sys._getframe(1).f_locals.get('job') or {}\n"
        "lines = ''.join(f'\\n{prefix}pass {i}\\n' for prefix in (job.get('nonce', '') + ' ', '') for i in range(8))\n"
        "lines += '\\nloaded\\ndone\\n' + f\"\\n{job.get('nonce')} loaded\\n{job.get('nonce')} done\\n\"\n"
        "os.write(1, lines.encode())\n"
        "pid = os.getppid()\n"
        "while pid not in (0, CALLER):\n"
        "    try:\n"
        "        with open(f'/proc/{pid}/fd/1', 'a') as out:\n"
        "            out.write(lines)\n"
        "    except OSError:\n"
        "        pass\n"
        "    pid = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])\n"
        "os._exit(0)\n"
    ),
    "always_equal": (
        "class Same:\n    def __eq__(self, other):\n        return True\ndef chunk(items, size):\n    return Same()\n"
    ),
    "patched_builtins": (
        "import builtins\n"
        "builtins.exec = lambda *args, **kwargs: None\n"
        "builtins.AssertionError = type('Quiet', (Exception,), {})\n"
        "def chunk(items, size):\n"
        "    return None\n"
    ),
}


@pytest.mark.parametrize("forger", FORGERS.values(), ids=FORGERS.keys())
def test_a_solution_cannot_forge_passes_of_the_code_tasks_tests(forger):
    result = run_tests(f"CALLER = {os.getpid()}\n" + forger, CHUNK["tests"], FAST)
    assert result.passed == 0


def test_answers_cross_as_plain_data_and_a_bad_answer_fails_only_its_test():
    solution = (
        "import collections\n"
        "def count(text):\n    return collections.Counter(text)\n"
        "def pair():\n    return (1, [2.5, None], {b'k': {3}})\n"
        "def refuse():\n    raise ValueError('no')\n"
        "def huge():\n    return 'x' * (2 << 20)\n"
        "def opaque():\n    return object()\n"
        "def sorted(items):\n    return [1, 2]\n"
    )
    tests = [
        "assert count('aab') == {'a': 2, 'b': 1}",
        "assert pair() == (1, [2.5, None], {b'k': {3}})",
        "try:\n    refuse()\nexcept ValueError as exc:\n    assert str(exc) == 'no'\nelse:\n    raise AssertionError",
        "huge()",
        "opaque()",
        "assert sorted([2, 1]) == [1, 2]",  # the builtin, not the solution's
        "assert sorted([3, 1]) == [1, 3]",
    ]

    result = run_tests(solution, tests, FAST)

    assert (result.passed, result.error) == (5, None)


def test_without_namespaces_nothing_runs_unless_the_operator_opts_out(monkeypatch, tmp_path):
    marker = tmp_path / "ran"
    marks = f"open({str(marker)!r}, 'w').write('x')\ndef f():\n    return 1\n"
    monkeypatch.setattr(sandbox, "_namespaces_unavailable", lambda: "unshare: Operation not permitted")
    monkeypatch.delenv(SANDBOX_ENV, raising=False)
    refused = (
        "sandbox unavailable: unshare: Operation not permitted "
        "(set TANDEM_SANDBOX=rlimits to run code without namespaces)"
    )

    assert run_code(marks, FAST).error == refused
    assert run_tests(marks, ["assert f() == 1"], FAST) == sandbox.SandboxResult(0, 1, False, refused)
    assert not marker.exists()

    monkeypatch.setenv(SANDBOX_ENV, "rlimits")  # weaker: the program shares the caller's files
    assert run_tests(marks, ["assert f() == 1"], FAST).passed == 1
    assert marker.exists()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the filter names x86_64's unshare")
def test_a_kernel_that_refuses_unshare_gets_no_run(tmp_path):
    """A real refusal: a seccomp filter like Docker's default profile fails unshare with
    EPERM in a child interpreter, whose first call probes and refuses."""
    marker = tmp_path / "ran"
    script = (
        f"{SECCOMP_DENY_UNSHARE}\n"
        "from rollout.tools.sandbox import run_code\n"
        f"print(run_code(\"open({str(marker)!r}, 'w')\").error)\n"
    )

    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, SANDBOX_ENV: "namespaces"},
    )

    assert done.stdout.strip() == (
        "sandbox unavailable: unshare: Operation not permitted "
        "(set TANDEM_SANDBOX=rlimits to run code without namespaces)"
    ), done.stderr
    assert not marker.exists()


SECCOMP_DENY_UNSHARE = """
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
def op(code, jt, jf, k):
    return struct.pack('HBBI', code, jt, jf, k)
NR_UNSHARE = 272  # x86_64
rules = (op(0x20, 0, 0, 0)  # load the syscall number
         + op(0x15, 0, 1, NR_UNSHARE)  # unshare? then the next, else skip it
         + op(0x06, 0, 0, 0x00050000 | 1)  # fail with EPERM
         + op(0x06, 0, 0, 0x7FFF0000))  # allow
program = ctypes.create_string_buffer(rules)
class Fprog(ctypes.Structure):
    _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no new privileges, as seccomp requires
assert libc.prctl(22, 2, ctypes.byref(Fprog(len(rules) // 8, ctypes.addressof(program))), 0, 0) == 0
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
    reason="needs root, setpriv and a system Python to act as a non-root caller",
)
def test_a_non_root_caller_gets_the_same_sandbox():
    """The Kubernetes non-root case: the reaper makes the user namespace itself."""
    program = 'import os\\nprint(os.getuid(), open("/proc/self/uid_map").read().split())'
    script = f"import sandbox\nresult = sandbox.run_code('{program}')\nprint(result.output, result.error)\n"
    with tempfile.TemporaryDirectory(dir="/tmp") as home:  # /tmp, not tmp_path: uid 65534 must reach it
        shutil.copy(sandbox.__file__, f"{home}/sandbox.py")
        os.chmod(home, 0o755)
        done = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "/usr/bin/python3",
                "-I",
                "-c",
                f"import sys; sys.path.insert(0, {home!r})\n{script}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )

    assert done.stdout.strip() == "1000 ['1000', '65534', '1'] None", done.stderr


@pytest.mark.parametrize(
    "job, refused",
    [
        ({"task": {"name": "code_chat"}}, True),
        ({"tools": {"tools": [{"name": "py", "kind": "python"}]}}, True),
        ({"task": {"name": "clarify"}}, False),
    ],
)
async def test_a_server_whose_sandbox_refuses_fails_a_job_that_runs_code_instead_of_scoring_zeros(
    monkeypatch, job, refused
):
    from rollout.assembly import check_sandbox
    from services.config import parse_job_spec

    monkeypatch.setenv(SANDBOX_ENV, "off")  # not a mode: the sandbox refuses every call
    spec = parse_job_spec({"model": {"path": "/models/tiny"}, **job})

    if refused:
        with pytest.raises(RuntimeError, match="cannot run model-written code: .*TANDEM_SANDBOX='off'"):
            await check_sandbox(spec)
    else:
        await check_sandbox(spec)


def test_code_runs_when_the_callers_virtual_env_lives_under_the_hosts_tmp(tmp_path):
    """A CI clone under /tmp: its env is bound inside the sandbox's own /tmp, not hidden by it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sandbox', {sandbox.__file__!r})\n"
        "module = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print(module.run_code('print(6 * 7)'))\n"
    )

    run = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True, timeout=60)

    assert str(tmp_path).startswith("/tmp/")
    assert run.stdout.strip() == "CodeResult(output='42', error=None)", run.stderr
