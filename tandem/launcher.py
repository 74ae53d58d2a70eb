"""`tandem up`: every process of the system, started locally, each a separate OS process.

Redis (embedded, with a fresh password, unless `TANDEM_REDIS_URL` is set), the API, the
judge proxy, rollout servers (one by default) and the learner under torchrun. Each gets its
settings through `TANDEM_*` environment variables, logs to `<log_dir>/<name>.log`, and must
answer `/healthz` before `up` returns. `stop` sends SIGTERM to every process group, then SIGKILL to stragglers.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.placement import Placement, this_machine
from tandem.redis_embed import EmbeddedRedis, free_port


@dataclass
class Ports:
    api: int = 8000
    judge_proxy: int = 8001
    learner: int = 8003
    rollout: list[int] = field(default_factory=lambda: [8002])
    """Metrics ports of the rollout servers, one per server."""

    @classmethod
    def free(cls, rollout_servers: int = 1) -> Ports:
        return cls(free_port(), free_port(), free_port(), [free_port() for _ in range(rollout_servers)])


@dataclass
class Stack:
    log_dir: Path
    ports: Ports = field(default_factory=Ports)
    placement: Placement = field(default_factory=this_machine)
    """Learner ranks, each process's threads and GPUs (`tandem.placement`); each rollout
    server gets the engine's share."""
    learner_ranks: int | None = None
    """None: the placement's."""
    extra_env: dict[str, str] = field(default_factory=dict)
    env_for: dict[str, dict[str, str]] = field(default_factory=dict)
    """Environment of one process by name (`learner`, `rollout-0`), over `extra_env` and
    over the placement's."""
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    redis: EmbeddedRedis | None = None
    redis_url: str = ""

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.api}"

    @property
    def judge_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.judge_proxy}"

    def health_urls(self) -> dict[str, str]:
        urls = {
            "api": f"{self.api_url}/healthz",
            "judge-proxy": f"{self.judge_url}/healthz",
            "learner": f"http://127.0.0.1:{self.ports.learner}/healthz",
        }
        for i, port in enumerate(self.ports.rollout):
            urls[f"rollout-{i}"] = f"http://127.0.0.1:{port}/healthz"
        return urls

    def start(self, timeout_s: float = 180.0) -> Stack:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis_url = os.environ.get("TANDEM_REDIS_URL", "")
        if not self.redis_url:
            # Loopback is open to every user of this machine: only our processes get the password.
            self.redis = EmbeddedRedis(password=secrets.token_hex(16)).start()
            self.redis_url = self.redis.url
        python = sys.executable
        p = self.ports
        self.spawn("api", [python, "-m", "tandem.cli", "api"], TANDEM_PORT=str(p.api))
        self.spawn("judge-proxy", [python, "-m", "tandem.cli", "judge-proxy"], TANDEM_PORT=str(p.judge_proxy))
        for i, port in enumerate(p.rollout):
            self.spawn_rollout(i, port)
        self.spawn("learner", self.learner_args(), TANDEM_METRICS_PORT=str(p.learner))
        self.wait_healthy(timeout_s)
        return self

    def learner_args(self) -> list[str]:
        return learner_command(self.learner_ranks or self.placement.learner_ranks)

    def spawn_rollout(self, index: int, port: int) -> str:
        name = f"rollout-{index}"
        self.spawn(
            name,
            [sys.executable, "-m", "tandem.cli", "rollout"],
            TANDEM_METRICS_PORT=str(port),
            TANDEM_JUDGE_URL=self.judge_url,
            TANDEM_SERVER_ID=name,
        )
        return name

    def add_rollout_server(self) -> str:
        """Start one more rollout server while the stack runs (it joins the running job by
        itself); its name, which is also its server id."""
        port = free_port()
        self.ports.rollout.append(port)
        return self.spawn_rollout(len(self.ports.rollout) - 1, port)

    def spawn(self, name: str, args: list[str], **env: str) -> None:
        environment = os.environ | {"TANDEM_REDIS_URL": self.redis_url, "PYTHONUNBUFFERED": "1"}
        environment |= self.placed_env(name) | self.extra_env | self.env_for.get(name, {}) | env
        log = open(self.log_dir / f"{name}.log", "wb")
        self.processes[name] = subprocess.Popen(
            args, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def placed_env(self, name: str) -> dict[str, str]:
        """What the placement gives process `name`: the learner's threads and GPUs, or a
        rollout server's engine's; nothing for the others (they compute nothing)."""
        if name == "learner":
            return self.placement.learner_env()
        if name.startswith("rollout-"):
            return self.placement.engine_env(servers=len(self.ports.rollout))
        return {}

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = dict(self.health_urls())
        while pending:
            for name, url in list(pending.items()):
                self.check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url, timeout=1.0).status_code == 200:
                        del pending[name]
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout_s:.0f}s: {sorted(pending)} (logs in {self.log_dir})")
            time.sleep(0.3)

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; see {self.log_dir / (name + '.log')}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM each process (torchrun forwards it to its ranks, which checkpoint), then
        SIGKILL whatever is left of each process tree after `grace_s`."""
        trees = {name: process_tree(process.pid) for name, process in self.processes.items()}
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, process in self.processes.items():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            kill_all(trees[name] + process_tree(process.pid))
        self.processes.clear()
        if self.redis:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> Stack:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def process_tree(pid: int) -> list:
    """A process and all its descendants (torchrun's ranks and vLLM's engine processes live
    in sessions of their own, out of reach of a process-group signal)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_all(processes: list) -> None:
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=10)


def learner_command(
    ranks: int, resume: bool = True, nodes: int = 1, rdzv_endpoint: str = "", rdzv_id: str = "tandem-learner"
) -> list[str]:
    """torchrun with `ranks` processes per node (`rendezvous_args` says how nodes meet),
    keeping how its ranks ended for the restarted learner (`learner.torchrun`); locally a
    restarted learner resumes its job."""
    return [
        sys.executable,
        "-m",
        "learner.torchrun",
        *rendezvous_args(nodes, rdzv_endpoint, rdzv_id),
        f"--nproc-per-node={ranks}",
        "-m",
        "learner",
        *(["--resume"] if resume else []),
    ]


def rendezvous_args(nodes: int, rdzv_endpoint: str, rdzv_id: str) -> list[str]:
    """One node runs standalone (a rendezvous of its own on a free port). Several nodes meet
    at `rdzv_endpoint` (host:port of torch's c10d rendezvous, served by the first node to
    come up there) under `rdzv_id`, and wait for all `nodes` before training starts."""
    if nodes == 1 and not rdzv_endpoint:
        return ["--standalone"]
    if not rdzv_endpoint:
        raise ValueError(f"a learner on {nodes} nodes needs a rendezvous endpoint (host:port)")
    return [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]


def local_upstream_file(path: Path, name: str, model: str, base_url: str, tokenizer: Path, **extra) -> Path:
    """A judge-proxy upstreams file with one local provider at `base_url` (no /v1) serving
    `model`, under a budget no local run reaches; `extra` adds upstream fields."""
    import yaml

    path.write_text(
        yaml.safe_dump(
            {
                "upstreams": [
                    {
                        "name": name,
                        "model": model,
                        "base_url": f"{base_url}/v1",
                        "tpm": 10_000_000,
                        "rpm": 100_000,
                        "max_concurrency": 16,
                        "timeout_s": 600,
                        "tokenizer": str(tokenizer),
                        **extra,
                    }
                ]
            }
        )
    )
    return path


@contextlib.contextmanager
def served_model(
    folder: Path,
    name: str,
    log_path: Path,
    max_model_len: int = 2048,
    timeout_s: float = 240,
    threads: int = 0,
    env: dict[str, str] | None = None,
):
    """`tandem serve-model` (vLLM's OpenAI server) on `folder` as `name`, on a free loopback
    port, with `threads` CPU compute threads (0: all cores) and `env` added to this process's
    environment; its base URL (no /v1). Stops its whole process tree afterwards."""
    port = free_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "serve-model",
                str(folder),
                "--name",
                name,
                "--port",
                str(port),
                "--max-model-len",
                str(max_model_len),
                "--threads",
                str(threads),
            ],
            env=os.environ | (env or {}),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _serving(url, server, log_path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tandem serve-model did not become healthy in {timeout_s:.0f} s ({log_path})")
            time.sleep(0.5)
        yield url
    finally:  # vLLM's engine may run in a child process: stop the whole tree
        tree = process_tree(server.pid)
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=30)
        kill_all(tree)


def _serving(url: str, server: subprocess.Popen, log_path: Path) -> bool:
    if server.poll() is not None:
        raise RuntimeError(f"tandem serve-model exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
