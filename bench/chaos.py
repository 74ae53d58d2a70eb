"""Chaos: one judge-bound job, one fault per run, each on a fresh stack; what the job does.

The job: the clarify task with the multiturn-aware reward on the tiny model, the user
simulator and the judge on the repo's stand-in provider (a process of its own, with its
latency model), as in tests/integration/test_judge_outage.py: a warm start, then
`--steps` RL steps of 4 groups of 2, a checkpoint every step (a restarted learner resumes
from it). Once the job has trained one RL step the bench injects the fault, holds it for
`--hold-s` seconds, clears it (sets the provider right, or restarts what it killed, as
compose's restart policy or a supervisor would; a restarted rollout server keeps its server
id, `rollout-N`, as a restarted container keeps its hostname) and follows the job to its
end (a job with no RL step for STUCK_S after the clearing is cancelled, reported stuck).

Faults (`--faults`, comma-separated; the first row, `none`, is the baseline: the same job
with no fault, measured from its first RL step as if a fault were injected there):
  judge-refused         the provider process SIGKILLed (connections refused); started again
  judge-hung            the provider accepts calls and never answers (`hang`)
  judge-429             every call answered 429 (`429`)
  judge-5xx             every call answered 500 (`5xx`)
  judge-garbage         every call answered 200 with a body that is not JSON (`garbage`)
  judge-unparseable     well-formed completions no judge rubric reads (`unparseable`)
  judge-back-2min       connections closed without a reply (`drop`) for 120 s, whatever `--hold-s`
  rollout-sigkill       one of 2 rollout servers SIGKILLed with its engine; a new one started
  rollout-sigkill-last  the only rollout server SIGKILLed with its engine; a new one started
  rollout-sigstop       the only rollout server SIGSTOPped (the server process, not its engine);
                        then SIGKILLed and a new one started, as a liveness probe would
  rollout-engine        the engine processes (children) of one of 2 servers SIGKILLed; the
                        server is expected to exit; a new one is started
  learner-rank          one torchrun worker (rank 1) SIGKILLed; torchrun ends the learner; a
                        new learner is started (`--resume`, as the launcher always starts it)
  learner-sigkill       the learner's whole process tree SIGKILLed; a new one started
  redis-restart         Redis stopped with its data (SHUTDOWN SAVE, as a restart of the deployed
                        Redis with its append-only file keeps it) for REDIS_DOWN_S, then started
                        on the same port from that data

Faults that end the job, then `tandem resume` (a fault with `resume` is held until the job
ends, or `--hold-s`; once it is cleared, a job it left FAILED or CANCELLED is resumed with
`tandem resume JOB` and followed to its end again):
  disk-full-checkpoint  the runs folder on a tmpfs of RUNS_TMPFS_MIB (the bench must run as
                        root to mount it), filled by a file to leave less than one checkpoint
                        free; the learner restarted by the bench whenever it exits, as a
                        supervisor would; cleared by deleting the file
  learner-oom-batch     the learner swapped (SIGTERM, a clean stop) for one whose rank 1
                        SIGKILLs itself as it starts training the step after next, every time
                        (bench.chaos_learner: the OOM killer on one batch), restarted by the
                        bench whenever it exits, as a supervisor would; cleared by swapping the
                        plain learner back
  cancel-resume         the job cancelled (`POST /v1/jobs/{id}/cancel`); nothing to clear
Other faults of the learner's:
  second-learner        a second learner (its own torchrun, `--resume`) started beside the
                        first; once it is up and SECOND_LEARNER_HOLD_S later, the first one's
                        tree SIGKILLed: the second is to take the job over when the first's
                        lease lapses (TANDEM_LEASE_TTL_S, 30 s)
  generate-sigterm      a generate job (the same task, reward and judge; 4 conversations a
                        step) whose learner is SIGTERMed (it stops at a safe point, leaving the
                        job RUNNING) and started again with `--resume` after GENERATE_DOWN_S

Measured from the moment of injection, by polling the job's record every 0.5 s (the
timeline, kept for the plot): the seconds until the record shows the fault (PAUSED with a
reason, FAILED with an error; for a fault the system absorbs, the next RL step); what the
job did (went on / paused / failed / warned: RUNNING with the record's `warning` that its
learner went silent, with the reason; or stalled: RUNNING at one step for SILENT_S or more
with no reason shown); tasks lost (entries dead-lettered, and
tasks dispatched but neither trained, dropped as over-stale nor dead-lettered: this also
counts the tasks in flight when the job ended, so compare with the baseline); groups
trained twice (task ids repeated in the history) and steps recorded twice or missing from
it; steps thrown away (work lost: the record's step fell back to an older checkpoint's,
summed over the run, and at a resume the steps past the checkpoint it resumed from; those
steps are trained again); for a generate job, tasks whose rows
were written twice or never (its dataset files and ledger); judge calls paid twice (idempotency keys
the provider admitted more than once); whether the job SUCCEEDED after the fault cleared,
and how long after the clearing its next step came; and the longest stretch after
injection that the record said RUNNING with its step unchanged (the baseline's is the
normal gap between steps). For judge-refused the killed provider's counts are read just
before the kill and added to the new one's (a call admitted in that last moment is
missed), and the stand-in counts a call when it admits it, before its reply: a call cut by
the kill is asked again after the restart and shows as paid twice, which a provider that
bills only answered calls would not charge. Under judge-hung the stand-in answers (and
counts) a hung call once the hang clears even if the proxy gave up on it and asked again.

Settings that make faults show fast (not defaults): TANDEM_CIRCUIT_FAILURES 3 (default 5),
TANDEM_CIRCUIT_OPEN_S 5 (10), TANDEM_TASK_RECLAIM_IDLE_S 5 (15), TANDEM_SERVER_TIMEOUT_S 5
(10), TANDEM_WEIGHT_TIMEOUT_S 20 (120), TANDEM_MAX_CONCURRENT_TASKS 4 (16, a small machine).
Defaults kept (their values when this was written): the upstream's timeout_s and
first_byte_timeout_s (60 s: a hung call fails only then), rate_limit_outage_s (60 s: a run
of 429s opens the circuit only after it), judge_outage_s (1800 s) and rollout_wait_s (600
s: a pause for either fails the job only past it), redis_outage_s (30 s), engine_stall_s
(300 s), train.stall_timeout_s (1800 s), train.max_dead_share (0.5).

Writes, in `--out` (bench/results/chaos by default), chaos.json, chaos.png (one band per
run: the job's status over time from the injection, the fault window shaded) and every
run's jobs and logs under `<fault>/`; `--publish` copies the report and figure into
docs/results/.

Run: python -m bench.chaos [--faults none,judge-5xx,...] [--hold-s 150] [--steps 20] [--add]
     (--add: keep the runs of other faults already in --out's chaos.json)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from bench.harness import REPO, common_args, out_folder, pyplot, rig, write_report
from services import protocol
from services.job_lease import lease_key
from services.queues import FIELD, Keys
from tandem.client import ApiClient, load_spec_file
from tandem.demo import DEMO_SPEC, prepare
from tandem.launcher import Ports, Stack, kill_all, learner_command, process_tree
from tandem.progress import Progress
from tandem.redis_embed import free_port

NAME = "chaos"
POLL_S = 0.5
REDIS_DOWN_S = 10.0
"""How long Redis is down in redis-restart: a restart, within the processes' redis_outage_s
(30 s); a longer outage is another fault."""
BACK_AFTER_S = 120.0
"""judge-back-2min's outage, whatever `--hold-s`."""
STUCK_S = 300.0
"""After the fault clears, a job with no RL step for this long is cancelled by the bench
(`cancelled_by_bench_s`), whatever its record says."""
RUNS_TMPFS_MIB = 64
"""disk-full-checkpoint's runs folder: room for the warm start, the exported policy and
`keep_checkpoints` checkpoints (7.7 MB each for the tiny model's two shards)."""
FREE_LEFT_BYTES = 2 << 20
"""What disk-full-checkpoint leaves free: less than one checkpoint, more than the step
records and group logs of the rest of the run."""
FILLER = "chaos-filler"
SECOND_LEARNER_HOLD_S = 10.0
"""How long second-learner runs both learners before it kills the first: short, so that the
job is still running when it does."""
GENERATE_DOWN_S = 5.0
"""How long generate-sigterm's learner stays down once it has stopped."""
SILENT_S = 30.0
"""A job neither paused nor failed that sat RUNNING at one step this long after the
injection is reported as stalled: the baseline's longest gap is a few seconds, and a cause
the learner knows pauses the job within 5 s."""
ENDED = ("SUCCEEDED", "FAILED", "CANCELLED")
ENV = {
    "TANDEM_CIRCUIT_FAILURES": "3",
    "TANDEM_CIRCUIT_OPEN_S": "5",
    "TANDEM_TASK_RECLAIM_IDLE_S": "5",
    "TANDEM_SERVER_TIMEOUT_S": "5",
    "TANDEM_WEIGHT_TIMEOUT_S": "20",
    "TANDEM_MAX_CONCURRENT_TASKS": "4",
}


class Provider:
    """The stand-in provider as a process of its own on a fixed port, so that it can be
    killed and started again where the proxy expects it; its request tags summed over its
    lives."""

    def __init__(self, out: Path) -> None:
        self.port, self.out = free_port(), out
        self.url = f"http://127.0.0.1:{self.port}"
        self.upstreams_file = out / "upstreams.yaml"
        self.upstreams_file.write_text(
            f"upstreams:\n  - name: stand-in\n    model: judge\n    base_url: {self.url}/v1\n"
            "    tpm: 50000000\n    rpm: 500000\n    max_concurrency: 256\n"
        )
        self.earlier_tags: Counter[str] = Counter()
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "devtools.provider", "--port", str(self.port), "--model", "judge"]
        command += ["--tpm", "50000000", "--rpm", "500000", "--latency", "--latency-median-s", "0.3"]
        command += ["--latency-p99-s", "1.0", "--tokens-per-s", "400", "--seed", "3"]
        with open(self.out / "logs" / "stand-in.log", "ab") as log:
            self.process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not answers(f"{self.url}/admin/stats"):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"the stand-in did not start (see {self.out / 'logs' / 'stand-in.log'})")
            time.sleep(0.2)

    def fault(self, mode: str) -> None:
        httpx.post(f"{self.url}/admin/fault", json={"mode": mode}, timeout=5).raise_for_status()

    def tags(self) -> Counter[str]:
        return self.earlier_tags + Counter(httpx.get(f"{self.url}/admin/request-tags", timeout=10).json())

    def kill(self) -> None:
        self.earlier_tags = self.tags()
        self.process.kill()
        self.process.wait()


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Run:
    """One run's stack, provider and job, for a fault to act on."""

    stack: Stack
    provider: Provider
    job_id: str
    runs_dir: Path
    notes: dict = field(default_factory=dict)
    """What a fault's actions saw (kept in the report), and the learner the bench restarts
    (`learner_command`, `learner_env`: the plain one when absent)."""


def restart(run: Run, name: str) -> None:
    """Start process `name` again as the launcher started it, its old log kept aside."""
    stack = run.stack
    old = stack.processes.pop(name, None)
    if old is not None:
        kill_all(process_tree(old.pid))
    log = stack.log_dir / f"{name}.log"
    if log.exists():
        log.rename(log.with_suffix(f".{time.time():.0f}.log"))
    if name == "learner":
        command = run.notes.get("learner_command") or learner_command(stack.learner_ranks)
        env = run.notes.get("learner_env", {}) | {"TANDEM_METRICS_PORT": str(stack.ports.learner)}
        stack.spawn(name, command, **env)
    else:
        index = int(name.rsplit("-", 1)[1])
        stack.spawn_rollout(index, stack.ports.rollout[index])


def kill_tree(run: Run, name: str) -> None:
    kill_all(process_tree(run.stack.processes[name].pid))


def kill_engine(run: Run) -> None:
    kill_all(process_tree(run.stack.processes["rollout-1"].pid)[1:])


def kill_rank(run: Run) -> None:
    """SIGKILL the torchrun worker whose RANK is 1."""
    for process in process_tree(run.stack.processes["learner"].pid)[1:]:
        if process.environ().get("RANK") == "1":
            process.kill()
            return
    raise RuntimeError("no learner worker with RANK=1")


def stop_server(run: Run) -> None:
    os.kill(run.stack.processes["rollout-0"].pid, signal.SIGSTOP)


def restart_redis(run: Run) -> None:
    """Start the embedded Redis again: its folder, port and password are kept, and a Redis
    started in a folder with a dump.rdb loads it."""
    run.stack.redis.start()


def stop_redis(run: Run) -> None:
    redis.Redis.from_url(run.stack.redis_url).shutdown(save=True)


@contextlib.contextmanager
def runs_on_tmpfs(out: Path) -> Iterator[None]:
    """The run's runs folder on a tmpfs of RUNS_TMPFS_MIB: a disk small enough to fill."""
    if os.geteuid() != 0:
        raise SystemExit("disk-full-checkpoint mounts a tmpfs: run the bench as root")
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={RUNS_TMPFS_MIB}m", "tmpfs", str(runs)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "--lazy", str(runs)], check=True)


def fill_disk(run: Run) -> None:
    """Leave FREE_LEFT_BYTES free where the runs folder is: the next checkpoint does not
    fit. Written, not allocated sparsely, so that tmpfs counts it."""
    stats = os.statvfs(run.runs_dir)
    left = stats.f_bavail * stats.f_frsize - FREE_LEFT_BYTES
    run.notes["filled_bytes"] = left
    chunk = bytes(1 << 20)
    with open(run.runs_dir / FILLER, "wb") as filler, contextlib.suppress(OSError):
        while left > 0:  # a checkpoint being written meanwhile may fill it first: as well
            left -= filler.write(chunk[: min(left, len(chunk))])


def free_disk(run: Run) -> None:
    (run.runs_dir / FILLER).unlink()


def stop_learner(run: Run) -> None:
    """SIGTERM the learner (torchrun forwards it: rank 0 checkpoints and leaves its job
    RUNNING for `--resume`, marked as stopped, which counts no crash) and wait for it."""
    process = run.stack.processes["learner"]
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=180)


def swap_learner(run: Run, command: list[str] | None, env: dict[str, str]) -> None:
    """The learner stopped cleanly and started again as `command` (None: the plain one)."""
    stop_learner(run)
    run.notes["learner_command"], run.notes["learner_env"] = command, env
    restart(run, "learner")


def oom_learner(run: Run) -> None:
    """bench.chaos_learner in the learner's place, its rank 1 dying on the step after next."""
    command = learner_command(run.stack.learner_ranks)
    command[command.index("learner")] = "bench.chaos_learner"  # torchrun's `-m learner`
    stop_learner(run)
    kill_at = recorded_step(run) + 2
    run.notes["kill_at_step"] = kill_at
    run.notes["learner_command"] = command
    run.notes["learner_env"] = {"TANDEM_CHAOS_KILL_AT_STEP": str(kill_at), "TANDEM_CHAOS_KILL_RANK": "1"}
    restart(run, "learner")


def recorded_step(run: Run) -> int:
    return httpx.get(f"{run.stack.api_url}/v1/jobs/{run.job_id}", timeout=10).json()["step"]


def supervise_learner(run: Run) -> None:
    """A learner that exited is started again, as compose's restart policy would."""
    if run.stack.processes["learner"].poll() is not None:
        run.notes["learner_restarts"] = run.notes.get("learner_restarts", 0) + 1
        restart(run, "learner")


def cancel(run: Run) -> None:
    httpx.post(f"{run.stack.api_url}/v1/jobs/{run.job_id}/cancel", timeout=30).raise_for_status()


def start_second_learner(run: Run) -> None:
    """A second learner, up (it answers its health check) when this returns."""
    port = free_port()
    run.stack.spawn("learner-2", learner_command(run.stack.learner_ranks), TANDEM_METRICS_PORT=str(port))
    deadline = time.monotonic() + 180
    while not answers(f"http://127.0.0.1:{port}/healthz"):
        if time.monotonic() > deadline or run.stack.processes["learner-2"].poll() is not None:
            raise RuntimeError("the second learner did not start")
        time.sleep(0.5)


def note_lease_holder(run: Run) -> None:
    """The learners that held the job's lease, in turn, with their fencing tokens."""
    value = redis.Redis.from_url(run.stack.redis_url).get(lease_key(run.job_id))
    if value is None:
        return
    token, holder = value.decode().split(" ", 1)
    pid = int(holder.split(":")[1])
    name = next(
        (n for n, p in run.stack.processes.items() if pid in {q.pid for q in process_tree(p.pid)}), "another process"
    )
    holders = run.notes.setdefault("lease_holders", [])
    if not holders or holders[-1] != [name, int(token)]:
        holders.append([name, int(token)])


@dataclass(frozen=True)
class Fault:
    name: str
    rollout_servers: int
    inject: Callable[[Run], None]
    clear: Callable[[Run], None]
    hold_s: float | None = None
    """Its own hold (None: `--hold-s`)."""
    resume: bool = False
    """Held until the job ends (at most STUCK_S); cleared even then, and a job left FAILED
    or CANCELLED is resumed with `tandem resume`."""
    during: Callable[[Run], None] | None = None
    """Called at every poll from the injection on (a supervisor's restarts, a probe)."""
    around: Callable[[Path], contextlib.AbstractContextManager] = lambda out: contextlib.nullcontext()
    """Around the run's whole stack (its runs folder's filesystem)."""
    kind: str = "rl"
    """The job's kind: `rl` (`job_spec`) or `generate` (`generate_spec`)."""


def judge_fault(name: str, mode: str, hold_s: float | None = None) -> Fault:
    return Fault(name, 1, lambda run: run.provider.fault(mode), lambda run: run.provider.fault("none"), hold_s)


def killed(name: str, rollout_servers: int, victim: str) -> Fault:
    """`victim`'s whole process tree SIGKILLed, then started again."""
    return Fault(name, rollout_servers, lambda run: kill_tree(run, victim), lambda run: restart(run, victim))


FAULTS = {
    fault.name: fault
    for fault in (
        Fault("none", 1, lambda run: None, lambda run: None, 0.0),
        Fault("judge-refused", 1, lambda run: run.provider.kill(), lambda run: run.provider.start()),
        judge_fault("judge-hung", "hang"),
        judge_fault("judge-429", "429"),
        judge_fault("judge-5xx", "5xx"),
        judge_fault("judge-garbage", "garbage"),
        judge_fault("judge-unparseable", "unparseable"),
        judge_fault("judge-back-2min", "drop", BACK_AFTER_S),
        killed("rollout-sigkill", 2, "rollout-1"),
        killed("rollout-sigkill-last", 1, "rollout-0"),
        Fault("rollout-sigstop", 1, stop_server, lambda run: restart(run, "rollout-0")),
        Fault("rollout-engine", 2, kill_engine, lambda run: restart(run, "rollout-1")),
        Fault("learner-rank", 1, kill_rank, lambda run: restart(run, "learner")),
        killed("learner-sigkill", 1, "learner"),
        Fault("redis-restart", 1, stop_redis, restart_redis, REDIS_DOWN_S),
        Fault(
            "disk-full-checkpoint", 1, fill_disk, free_disk, resume=True, during=supervise_learner, around=runs_on_tmpfs
        ),
        Fault(
            "learner-oom-batch",
            1,
            oom_learner,
            lambda run: swap_learner(run, None, {}),
            resume=True,
            during=supervise_learner,
        ),
        Fault(
            "second-learner",
            1,
            start_second_learner,
            lambda run: kill_tree(run, "learner"),
            SECOND_LEARNER_HOLD_S,
            during=note_lease_holder,
        ),
        Fault("cancel-resume", 1, cancel, lambda run: None, resume=True),
        Fault(
            "generate-sigterm", 1, stop_learner, lambda run: restart(run, "learner"), GENERATE_DOWN_S, kind="generate"
        ),
    )
}


def job_spec(out: Path, steps: int) -> dict:
    """tests/integration/test_judge_replay.py's judge-bound job, checkpointing every step."""
    spec = prepare(out, load_spec_file(DEMO_SPEC))
    spec["name"] = "chaos"
    spec["task"] |= {"num_examples": 64, "user": "llm"}
    spec["rollout"] |= {"group_size": 2, "max_new_tokens": 32, "max_turns": 2, "max_total_tokens": 256}
    spec["reward"] = {
        "mode": "multiturn",
        "window": 2,
        "futures": "adaptive",
        "num_futures": 3,
        "min_futures": 2,
        "judge_rubric": "interactivity",
        "judge_weight": 0.5,
        "judge_model": "judge",
        "user_model": "judge",
        "judge_mode": "group",
    }
    spec["train"] |= {"num_steps": steps, "batch_size": 4, "max_staleness": 3, "lr": 1e-4, "checkpoint_every": 1}
    spec["warm_start"] |= {"steps": 150, "batch_size": 32, "lr": 3e-3}
    return spec


def generate_spec(out: Path, steps: int) -> dict:
    """The same task, reward and judge as a generate job of `steps` batches of 4
    conversations (each turn's 2 responses ranked by MR, the better carrying on)."""
    spec = job_spec(out, steps)
    spec |= {"kind": "generate", "generate": {"conversations": 4 * steps}}
    spec["train"] = {"batch_size": 4}
    spec.pop("health", None)  # an RL job's rules
    return spec


class Timeline(threading.Thread):
    """The job's record every POLL_S: (seconds since submission, status, step, reason); the
    status is None when the API did not answer. The report keeps its `changes`."""

    def __init__(self, api_url: str, job_id: str) -> None:
        super().__init__(daemon=True)
        self.api = httpx.Client(base_url=api_url, timeout=5)
        self.job_id, self.started = job_id, time.monotonic()
        self.samples: list[tuple[float, str | None, int, str]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            t = time.monotonic() - self.started
            try:
                record = self.api.get(f"/v1/jobs/{self.job_id}").json()
                reason = record.get("paused_reason") or record.get("error") or record.get("warning") or ""
                self.samples.append((t, record["status"], record["step"], reason))
            except (httpx.HTTPError, ValueError, KeyError):
                self.samples.append((t, None, self.samples[-1][2] if self.samples else 0, ""))
            self.done.wait(max(0.0, POLL_S - (time.monotonic() - self.started - t)))

    def now(self) -> float:
        return time.monotonic() - self.started

    def stepped_at(self) -> float:
        """When the record's step last changed (0: never)."""
        known = [s for s in self.samples if s[1] is not None]
        return next((s[0] for s, r in zip(reversed(known), reversed(known[:-1]), strict=False) if s[2] != r[2]), 0.0)

    def last(self) -> tuple[float, str | None, int, str]:
        known = [s for s in self.samples if s[1] is not None]
        return known[-1] if known else (0.0, None, 0, "")


def follow(timeline: Timeline, until: Callable[[], bool], progress: Progress, steps: int, deadline: float) -> bool:
    """Wait until `until()` or `deadline` (the timeline's clock), showing progress; whether
    `until()` came true."""
    while not until():
        if timeline.now() > deadline:
            return False
        _, status, step, _ = timeline.last()
        progress.update(step, postfix={"status": str(status), "t": f"{timeline.now():.0f}s"})
        time.sleep(POLL_S)
    return True


def run_fault(fault: Fault, args: argparse.Namespace, out: Path) -> dict:
    """One fault on a stack of its own in `out` (`out/runs`, `out/logs`), with its own
    provider (killable, and told its faults) in place of the harness's stand-in."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    provider = Provider(out)
    provider.start()
    env = ENV | {"TANDEM_UPSTREAMS": str(provider.upstreams_file)}
    spec = (generate_spec if fault.kind == "generate" else job_spec)(args.out, args.steps)
    try:
        ports = Ports.free(rollout_servers=fault.rollout_servers)
        with fault.around(out), rig(out, env=env, ports=ports, learner_ranks=2) as system:
            run = Run(system.stack, provider, system.client.submit(spec)["id"], system.runs)
            timeline = Timeline(system.stack.api_url, run.job_id)
            timeline.start()
            with Progress(args.steps, f"  {fault.name}", "steps", file=sys.stdout) as progress:
                events = inject_and_follow(fault, run, timeline, progress, args)
                time.sleep(2 * POLL_S)  # the final record in the timeline
            timeline.done.set()
            timeline.join()
            books = (
                dataset_books(run, spec)
                if fault.kind == "generate"
                else job_books(system.stack.redis_url, system.client, run.job_id)
            )
            tags = provider.tags()
    finally:
        if provider.process and provider.process.poll() is None:
            provider.process.kill()
            provider.process.wait()
    return {
        "fault": fault.name,
        "commit": code_version(),
        **events,
        **books,
        **paid(tags),
        "notes": run.notes,
        "timeline": changes(timeline.samples),
    }


def inject_and_follow(fault: Fault, run: Run, timeline: Timeline, progress: Progress, args: argparse.Namespace) -> dict:
    """Inject the fault after the first step, hold it, clear it, follow the job to its end
    (resumed with `tandem resume` for a fault with `resume`); the events' times."""
    hold_s = args.hold_s if fault.hold_s is None else fault.hold_s
    events: dict = {"hold_s": hold_s}

    def ended() -> bool:
        return timeline.last()[1] in ENDED

    def watching(until: Callable[[], bool]) -> Callable[[], bool]:
        """`until`, with the fault's `during` called at each poll."""
        return lambda: (fault.during is not None and fault.during(run)) or until()

    def ended_or_stuck(since: str) -> Callable[[], bool]:
        return lambda: ended() or timeline.now() - max(events[since], timeline.stepped_at()) > STUCK_S

    follow(timeline, lambda: timeline.last()[2] >= 1 or ended(), progress, args.steps, 900)
    events["injected_s"] = timeline.now()
    fault.inject(run)
    if fault.resume:
        follow(timeline, watching(ended), progress, args.steps, events["injected_s"] + STUCK_S)
        events["hold_s"] = round(timeline.now() - events["injected_s"], 1)
    else:
        follow(timeline, watching(lambda: False), progress, args.steps, events["injected_s"] + hold_s)
    events["cleared_s"] = timeline.now()
    if fault.resume or not ended():  # nothing to restart for a job that is over, unless resumed
        fault.clear(run)
    follow(timeline, watching(ended_or_stuck("cleared_s")), progress, args.steps, math.inf)
    if fault.resume and timeline.last()[1] in ("FAILED", "CANCELLED"):
        events |= resume(run, timeline)
        # The timeline's last sample may predate the resume: only a later one counts.
        follow(timeline, lambda: timeline.last()[0] > events["resumed_s"], progress, args.steps, math.inf)
        follow(timeline, watching(ended_or_stuck("resumed_s")), progress, args.steps, math.inf)
    if not ended():
        events["cancelled_by_bench_s"] = timeline.now()
        cancel(run)
        follow(timeline, ended, progress, args.steps, timeline.now() + 120)
    return events


def resume(run: Run, timeline: Timeline) -> dict:
    """`tandem resume JOB`, as a user would; how the job had ended and the checkpoint that
    a resume continues from (the newest complete one)."""
    from learner.checkpoint import steps as checkpoint_steps

    _, status, step, reason = timeline.last()
    complete = checkpoint_steps(run.runs_dir, run.job_id)
    command = [sys.executable, "-m", "tandem.cli", "resume", run.job_id, "--api", run.stack.api_url]
    answer = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    return {
        "resumed_s": timeline.now(),
        "ended_before_resume": status,
        "error_before_resume": reason,
        "step_before_resume": step,
        "resumed_from_checkpoint": complete[-1] if complete else None,
        "resume_answer": (answer.stdout + answer.stderr).strip(),
    }


def job_books(redis_url: str, api: ApiClient, job_id: str) -> dict:
    """Trained, twice, dropped, dead-lettered and unaccounted tasks, from the history and Redis."""
    client = redis.Redis.from_url(redis_url)
    history = api.history(job_id)
    rl = [r for r in history if r["phase"] == "rl"]
    trained = [task_id for r in rl for task_id in r["task_ids"]]
    newest = client.xrevrange(Keys.tasks(job_id), count=1)
    dispatched = protocol.decode(newest[0][1][FIELD], protocol.Task).task_id + 1 if newest else 0
    dead = client.xlen(Keys.dead(job_id))
    stale = rl[-1].get("stale_dropped", 0) if rl else 0
    steps = [r["step"] for r in rl]
    return {
        "steps": len(rl),
        "history_steps_twice": len(steps) - len(set(steps)),
        "history_steps_missing": len(set(range(1, max(steps, default=0) + 1)) - set(steps)),
        "dispatched": dispatched,
        "groups_trained": len(trained),
        "groups_trained_twice": len(trained) - len(set(trained)),
        "stale_dropped": stale,
        "dead_lettered": dead,
        "unaccounted": dispatched - len(set(trained)) - stale - dead,
    }


def dataset_books(run: Run, spec: dict) -> dict:
    """A generate job's tasks and rows, from its ledger and dataset files: tasks committed
    twice or never, rows written twice (a task's SFT row, a task's pair for one turn)."""
    folder = run.runs_dir / run.job_id
    ledger = [json.loads(line) for line in (folder / "written.jsonl").read_text().splitlines()]
    committed = [task_id for entry in ledger for task_id in entry["task_ids"]]
    sft = [json.loads(line)["task_id"] for line in (folder / "dataset" / "sft.jsonl").read_text().splitlines()]
    pairs = [(r["task_id"], r["turn"]) for r in map(json.loads, (folder / "dataset" / "pairs.jsonl").open())]
    conversations = spec["generate"]["conversations"]
    return {
        "conversations": conversations,
        "tasks_committed": len(set(committed)),
        "tasks_committed_twice": len(committed) - len(set(committed)),
        "tasks_never_written": len(set(range(conversations)) - set(committed)),
        "sft_rows": len(sft),
        "sft_rows_twice": len(sft) - len(set(sft)),
        "pair_rows": len(pairs),
        "pair_rows_twice": len(pairs) - len(set(pairs)),
    }


def work_lost_and_duplicated(result: dict, rolled_back: int) -> tuple[int, int]:
    """Work lost (steps or rows thrown away and done again, or never done) and work done
    twice (groups trained, steps recorded, tasks or rows written more than once)."""
    lost = rolled_back + result.get("history_steps_missing", 0) + result.get("tasks_never_written", 0)
    twice = sum(
        result.get(key, 0)
        for key in (
            "groups_trained_twice",
            "history_steps_twice",
            "tasks_committed_twice",
            "sft_rows_twice",
            "pair_rows_twice",
        )
    )
    return lost, twice


def rolled_back(samples: list) -> int:
    """Steps the record fell back by, summed: completed steps a restarted or resumed
    learner threw away for an older checkpoint's (and trains again)."""
    known = [s[2] for s in samples if s[1] is not None]
    return sum(max(0, a - b) for a, b in zip(known, known[1:], strict=False))


def steps_redone_at_resume(result: dict, rolled_back: int) -> int:
    """Steps a resume trains again: those between its checkpoint and the step the job had
    recorded, less any the record already showed falling back (counted there)."""
    if result.get("resumed_from_checkpoint") is None:
        return 0
    return max(0, result["step_before_resume"] - result["resumed_from_checkpoint"] - rolled_back)


def paid(tags: Counter[str]) -> dict:
    twice = {tag: n for tag, n in tags.items() if n > 1}
    return {
        "judge_calls": sum(tags.values()),
        "judge_calls_paid_twice": sum(n - 1 for n in twice.values()),
        "judge_tags_paid_twice": twice,
    }


def summarize(result: dict) -> dict:
    """From the timeline: when the fault showed and how, what the job did, how it ended."""
    t0 = result["injected_s"]
    known = [s for s in result["timeline"] if s[1] is not None]
    before = [s for s in known if s[0] <= t0]
    step0 = before[-1][2] if before else 0
    after = [s for s in known if s[0] > t0]
    shown = next((s for s in after if s[1] in ("PAUSED", "FAILED", "CANCELLED") or s[2] > step0 or s[3]), None)
    paused = next((s for s in after if s[1] == "PAUSED"), None)
    failed = next((s for s in after if s[1] == "FAILED"), None)
    cancelled = next((s for s in after if s[1] == "CANCELLED"), None)
    warned = next((s for s in after if s[1] == "RUNNING" and s[3]), None)
    silent_s = longest_silent_running(before[-1:] + after, t0)
    did, reason = ("failed", failed[3]) if failed else ("paused", paused[3]) if paused else ("went on", "")
    if did == "went on" and cancelled:
        did = "cancelled"
    if did == "went on" and warned:
        did, reason = "warned", warned[3]
    if did == "went on" and silent_s >= SILENT_S:
        did = "stalled"
    final = known[-1] if known else (0.0, None, 0, "")
    at_clear = [s for s in known if s[0] <= result["cleared_s"]]
    step_at_clear = at_clear[-1][2] if at_clear else 0
    resumed = next((s for s in known if s[0] > result["cleared_s"] and s[2] > step_at_clear), None)
    steps_rolled_back = rolled_back(result["timeline"])
    redone = steps_redone_at_resume(result, steps_rolled_back)
    lost, twice = work_lost_and_duplicated(result, steps_rolled_back + redone)
    return {
        "steps_rolled_back": steps_rolled_back,
        "steps_redone_at_resume": redone,
        "work_lost": lost,
        "work_duplicated": twice,
        "resumed_to_succeeded": (final[1] == "SUCCEEDED") if "resumed_s" in result else None,
        "shown_after_s": round(shown[0] - t0, 1) if shown else None,
        "shown_as": (shown[1] if shown[1] != "RUNNING" else "warning" if shown[3] else "next step") if shown else None,
        "did": did,
        "reason": reason,
        "final_status": final[1],
        "final_error": final[3] if final[1] == "FAILED" else stuck_note(result),
        "succeeded_after_clear": final[1] == "SUCCEEDED",
        "next_step_after_clear_s": round(resumed[0] - result["cleared_s"], 1) if resumed else None,
        "longest_silent_running_s": round(silent_s, 1),
        "total_s": round(final[0], 1),
    }


def code_version() -> str:
    """The commit the run measured (with `+dirty` for changes not committed): `--add` keeps
    runs of several, and a row must say which code it measured."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def stuck_note(result: dict) -> str:
    if "cancelled_by_bench_s" not in result:
        return ""
    return f"cancelled by the bench: no RL step for {STUCK_S:.0f} s after the fault cleared"


def longest_silent_running(samples: list, t0: float) -> float:
    """The longest stretch from `t0` that the record said RUNNING at one step with no reason
    shown (a learner gone silent is a reason: the record's `warning`), in seconds;
    `samples` start with the state at `t0`."""
    longest, start, state = 0.0, t0, None
    for t, status, step, reason in samples:
        if (status, step, bool(reason)) != state:
            if state is not None and state[0] == "RUNNING" and not state[2]:
                longest = max(longest, t - start)
            start, state = max(t, t0), (status, step, bool(reason))
    if state is not None and state[0] == "RUNNING" and not state[2]:
        longest = max(longest, samples[-1][0] - start)
    return longest


def changes(samples: list) -> list:
    """The samples where the record changed (status, step or reason), and the last one: the
    timeline kept in the report."""
    kept = [s for i, s in enumerate(samples) if i == 0 or s[1:] != samples[i - 1][1:]]
    return kept + samples[-1:] if samples and kept[-1] is not samples[-1] else kept


def print_report(report: dict) -> None:
    print(f"\nchaos: judge-bound job, {report['steps']} RL steps, faults held {report['hold_s']:.0f} s")
    print(
        f"{'fault':>20} {'shown':>7} {'as':>9} {'did':>8} {'final':>9} {'resumed':>7} {'dead':>5} "
        f"{'unacct':>6} {'lost':>4} {'twice':>5} {'tandem resume':>13} {'paid 2x':>7} {'silent':>6} "
        f"{'total':>6}  reason"
    )
    for row in report["runs"]:
        why = " / ".join(dict.fromkeys(filter(None, (row["reason"], row["final_error"]))))
        print(
            f"{row['fault']:>20} {seconds(row['shown_after_s']):>7} {row['shown_as'] or '-':>9} {row['did']:>8} "
            f"{row['final_status'] or '?':>9} {seconds(row['next_step_after_clear_s']):>7} "
            f"{row.get('dead_lettered', '-'):>5} {row.get('unaccounted', '-'):>6} {row['work_lost']:>4} "
            f"{row['work_duplicated']:>5} {resumed_with_cli(row):>13} {row['judge_calls_paid_twice']:>7} "
            f"{seconds(row['longest_silent_running_s']):>6} "
            f"{seconds(row['total_s']):>6}  {why[:160]}"
        )
    print(
        "shown: seconds from injection until the record showed PAUSED, FAILED or a next step; "
        "resumed: seconds from the fault's clearing to the next step; dead: entries dead-lettered; "
        "unacct: tasks dispatched but not trained, over-stale or dead (in flight at the end included); "
        "lost: steps thrown away for an older checkpoint, steps or generated tasks missing; twice: groups "
        "trained, steps recorded or rows written twice; tandem resume: the job it left FAILED or CANCELLED "
        "resumed to SUCCEEDED; paid 2x: judge calls the provider admitted again; silent: the "
        "longest RUNNING stretch at one step after injection; total: submission to the end"
    )


def resumed_with_cli(row: dict) -> str:
    if "resumed_s" not in row:
        return "-"
    return f"{'yes' if row['resumed_to_succeeded'] else 'no'} (from {row['resumed_from_checkpoint']})"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}s"


NO_ANSWER = "API no answer"
COLORS = {
    "RUNNING": "#4c9be8",
    "PAUSED": "#f0a030",
    "FAILED": "#d62728",
    "SUCCEEDED": "#2ca02c",
    "CANCELLED": "#7f7f7f",
    NO_ANSWER: "#9467bd",
}


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    from matplotlib.patches import Patch

    runs = report["runs"]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(runs) + 1.5))
    for y, row in enumerate(reversed(runs)):
        t0 = row["injected_s"]
        if row["fault"] != "none":
            ax.broken_barh([(0, row["cleared_s"] - t0)], (y - 0.45, 0.9), color="#bbbbbb", alpha=0.5)
        samples = row["timeline"]
        for sample, following in zip(samples, samples[1:], strict=False):
            color = COLORS.get(sample[1] or NO_ANSWER, "#999999")
            ax.broken_barh([(sample[0] - t0, following[0] - sample[0])], (y - 0.3, 0.6), color=color)
            if following[2] > sample[2]:  # a step: progress the record shows
                ax.vlines(following[0] - t0, y - 0.3, y + 0.3, color="black", linewidth=0.6)
    ax.set_yticks(range(len(runs)), [row["fault"] for row in reversed(runs)])
    ax.set_xlabel("seconds since the fault was injected (grey: the fault held; ticks: RL steps)")
    handles = [Patch(color=c, label=s) for s, c in COLORS.items()]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.set_title(f"The job's status under each fault ({report['steps']} RL steps, hold {report['hold_s']:.0f} s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def kept_runs(args: argparse.Namespace, names: list[str]) -> dict:
    """--out's report less the runs of `names`, each run summarized again (by this code)."""
    kept = args.out / f"{NAME}.json"
    report = json.loads(kept.read_text())
    if (report["steps"], report["hold_s"], report["settings"]) != (args.steps, args.hold_s, ENV):
        raise SystemExit(f"{kept} was made with other settings: run without --add")
    report["runs"] = [row | summarize(row) for row in report["runs"] if row["fault"] not in names]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"of {', '.join(FAULTS)}")
    parser.add_argument("--hold-s", type=float, default=150.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--add", action="store_true", help="keep --out's runs of other faults (same settings)")
    common_args(parser, NAME, seeds=None)
    args = parser.parse_args()
    names = args.faults.split(",")
    unknown = set(names) - FAULTS.keys()
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    args.out = out_folder(args)
    report = {"steps": args.steps, "hold_s": args.hold_s, "settings": ENV, "cpu_cores": os.cpu_count(), "runs": []}
    if args.add:
        report = kept_runs(args, names)
    for name in names:
        print(f"{name}: {FAULTS[name].rollout_servers} rollout server(s)", flush=True)
        result = run_fault(FAULTS[name], args, args.out / name)
        report["runs"].append(result | summarize(result))
        report["runs"].sort(key=lambda row: list(FAULTS).index(row["fault"]))
        write_report(NAME, report, args)  # kept as runs finish: a run takes minutes
    print_report(report)
    write_report(NAME, report, args, plot)


if __name__ == "__main__":
    main()
