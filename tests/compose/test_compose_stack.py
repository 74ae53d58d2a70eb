"""`docker compose up` on a real Docker engine, as a user runs it (`make test-compose`).

One scenario, phase by phase, each timed: the stack comes up healthy; the demo job,
submitted and followed with the CLI from the host, trains while Prometheus scrapes every
process; the rollout container crashes mid-job and the learner is restarted mid-job, and
the job still succeeds with no task trained twice; `down` then `up` keeps the jobs and
Redis's data; a second job runs; `down -v` leaves nothing behind.

The stack runs as its own compose project with its own ports, secrets and models folder,
set through COMPOSE_PROJECT_NAME and COMPOSE_ENV_FILES, so a user's `.env` and stack are
never touched; the commands are the README's quick start. `scripts/test_compose.sh`
builds the images first (pulled, or built from Debian's packages where no registry
answers) and names them in TANDEM_COMPOSE_IMAGES_ENV.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from polling import wait_for

from tandem.redis_embed import free_port

pytestmark = [pytest.mark.compose, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "tandem-test"
TANDEM = str(Path(sys.executable).with_name("tandem"))
SERVICES = ["redis", "api", "judge-proxy", "rollout-cpu", "learner-cpu", "prometheus", "grafana"]
TARGETS = {"api", "judge-proxy", "rollout", "learner"}
"""Prometheus's scrape jobs (deploy/prometheus.yml): one per Tandem process."""
STEPS = 60
"""The demo job's RL steps here: room for two faults before it ends."""
UP_TIMEOUT_S = 900
POLL_S = 1.0
"""Between polls: each one runs docker or queries the stack."""


def image_present(image: str) -> bool:
    """Here or pullable. Without a registry Grafana is neither: no Debian package builds it."""
    present = subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0
    return present or subprocess.run(["docker", "pull", "-q", image], capture_output=True).returncode == 0


class Stack:
    """The compose project under test: commands, its API and Prometheus, phase timings."""

    def __init__(self, workdir: Path) -> None:
        self.token = secrets.token_hex(16)
        self.ports = {name: free_port() for name in ("api", "judge", "prometheus", "grafana")}
        self.models = workdir / "models"
        self.models.mkdir()
        variables = self.variables()
        self.env_file = workdir / "compose.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in variables.items()))
        self.env = os.environ | {"COMPOSE_PROJECT_NAME": PROJECT, "COMPOSE_ENV_FILES": str(self.env_file)}
        self.api = httpx.Client(
            base_url=f"http://127.0.0.1:{self.ports['api']}",
            timeout=10,
            headers={"Authorization": f"Bearer {self.token}"},
        )
        grafana = image_present(variables.get("GRAFANA_IMAGE", "grafana/grafana:12.1.0"))
        self.services = [s for s in SERVICES if s != "grafana" or grafana]
        self.phases: list[dict] = []

    def variables(self) -> dict[str, str]:
        """.env as a user fills it in, with this test's ports and models folder, plus the
        images the offline build made (if any)."""
        images = os.environ.get("TANDEM_COMPOSE_IMAGES_ENV")
        chosen = {}
        if images:
            for line in Path(images).read_text().splitlines():
                if line.strip() and not line.startswith("#"):
                    name, value = line.split("=", 1)
                    chosen[name] = value
        return {
            "COMPOSE_PROFILES": "cpu",
            "REDIS_PASSWORD": secrets.token_hex(12),
            "TANDEM_API_TOKENS": f"{self.token}:ci",
            "TANDEM_JUDGE_TOKEN": secrets.token_hex(12),
            "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(12),
            "TANDEM_MODELS_DIR": str(self.models),
            "TANDEM_API_PORT": str(self.ports["api"]),
            "TANDEM_JUDGE_PROXY_PORT": str(self.ports["judge"]),
            "PROMETHEUS_PORT": str(self.ports["prometheus"]),
            "GRAFANA_PORT": str(self.ports["grafana"]),
            **chosen,
        }

    # ---- commands --------------------------------------------------------------------

    def compose(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["docker", "compose", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if check and result.returncode:
            pytest.fail(
                f"docker compose {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n"
                f"{result.stderr}\n{self.diagnosis()}"
            )
        return result

    def cli(self, *args: str, timeout_s: float = 900) -> str:
        """The host's `tandem` CLI against this stack's API."""
        env = os.environ | {"TANDEM_API_URL": str(self.api.base_url), "TANDEM_API_TOKEN": self.token}
        result = subprocess.run([TANDEM, *args], env=env, capture_output=True, text=True, timeout=timeout_s)
        assert result.returncode == 0, f"tandem {' '.join(args)}:\n{result.stdout}\n{result.stderr}\n{self.diagnosis()}"
        return result.stdout

    def up(self) -> None:
        """The quick start's `up`: every service started and healthy, or the logs of those
        that are not."""
        self.compose(
            "--profile",
            "cpu",
            "up",
            "-d",
            "--wait",
            "--wait-timeout",
            str(UP_TIMEOUT_S),
            *self.services,
            timeout_s=UP_TIMEOUT_S + 60,
        )
        states = self.states()
        unhealthy = {name: s for name, s in states.items() if s != "running/healthy"}
        assert sorted(states) == sorted(self.services) and not unhealthy, f"{states}\n{self.diagnosis()}"

    def states(self) -> dict[str, str]:
        """service -> 'State/Health' of its container."""
        out = self.compose("ps", "--all", "--format", "json").stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return {r["Service"]: f"{r['State']}/{r.get('Health') or '-'}" for r in rows}

    def container(self, service: str) -> str:
        return self.compose("ps", "--all", "-q", service).stdout.strip()

    def inspect(self, container: str, template: str) -> str:
        return subprocess.run(
            ["docker", "inspect", "-f", template, container], check=True, capture_output=True, text=True
        ).stdout.strip()

    def diagnosis(self) -> str:
        """What a person debugging a failed phase looks at first: states and recent logs."""
        ps = subprocess.run(
            ["docker", "compose", "ps", "--all"], cwd=ROOT, env=self.env, capture_output=True, text=True
        ).stdout
        logs = subprocess.run(
            ["docker", "compose", "logs", "--no-color", "--tail", "40"],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
        ).stdout
        return f"--- docker compose ps\n{ps}\n--- docker compose logs --tail 40\n{logs}"

    @contextmanager
    def phase(self, name: str):
        started = time.monotonic()
        print(f"\n== {name}", flush=True)
        yield
        self.phases.append({"phase": name, "seconds": round(time.monotonic() - started, 1)})

    # ---- the job API and Prometheus ----------------------------------------------------

    def job(self, job_id: str) -> dict:
        return self.api.get(f"/v1/jobs/{job_id}").raise_for_status().json()

    def rl_steps(self, job_id: str) -> int:
        history = self.api.get(f"/v1/jobs/{job_id}/history").raise_for_status().json()
        return max((h["step"] for h in history if h.get("phase") == "rl"), default=0)

    def wait_for_step(self, job_id: str, step: int, timeout_s: float = 600) -> int:
        def reached():
            # PAUSED is a live state: a job whose only rollout server is restarting pauses,
            # naming why, and goes on when the server is back.
            live = ("PENDING", "RUNNING", "PAUSED")
            assert self.job(job_id)["status"] in live, f"{self.job(job_id)}\n{self.diagnosis()}"
            return (done := self.rl_steps(job_id)) >= step and done

        return wait_for(reached, timeout_s, f"job {job_id} to reach RL step {step}", POLL_S)

    def prometheus(self, query: str) -> list[dict]:
        reply = (
            httpx.get(f"http://127.0.0.1:{self.ports['prometheus']}/api/v1/query", params={"query": query}, timeout=10)
            .raise_for_status()
            .json()
        )
        return reply["data"]["result"]

    def targets(self) -> dict[str, str]:
        reply = (
            httpx.get(f"http://127.0.0.1:{self.ports['prometheus']}/api/v1/targets", timeout=10)
            .raise_for_status()
            .json()
        )
        return {t["labels"].get("process", t["scrapePool"]): t["health"] for t in reply["data"]["activeTargets"]}

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={PROJECT}"
        found = []
        for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
            out = subprocess.run(["docker", *kind, "-q", "--filter", label], capture_output=True, text=True).stdout
            found += [f"{kind[0]} {name}" for name in out.split()]
        return found


@pytest.fixture
def stack(tmp_path):
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode:
        pytest.fail("make test-compose needs a running Docker engine (`docker info` failed)")
    built = Stack(tmp_path)
    built.compose("down", "-v", "--remove-orphans", check=False)  # what an interrupted run left
    try:
        yield built
    finally:
        built.compose("--profile", "cpu", "down", "-v", "--remove-orphans", "--timeout", "30", check=False)
        report = ROOT / "runs" / "compose" / "phases.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps({"services": built.services, "phases": built.phases}, indent=2) + "\n")
        print("\n" + "\n".join(f"{p['phase']:<58} {p['seconds']:>7.1f} s" for p in built.phases))
        assert built.leftovers() == [], "docker compose down -v left these behind"


@pytest.mark.timeout(3600)  # every phase has its own deadline; this bounds their sum
def test_compose_stack_trains_survives_faults_and_restarts_and_leaves_nothing(stack: Stack):
    if not os.environ.get("TANDEM_COMPOSE_IMAGES_ENV"):
        with stack.phase("build: docker compose --profile cpu build"):
            stack.compose("--profile", "cpu", "build", timeout_s=3600)

    with stack.phase("up: build-free start, every service healthy"):
        stack.up()

    with stack.phase("demo job: prepared and submitted from the host"):
        spec = stack.models / "demo" / "demo.yaml"
        stack.cli("prepare-demo", str(spec.parent), "--seen-as", "/models/demo", "--steps", str(STEPS))
        job_id = stack.cli("submit", str(spec)).strip()
        stack.wait_for_step(job_id, 3)

    with stack.phase("prometheus: every Tandem target up, a training metric moving"):
        wait_for(
            lambda: TARGETS <= {p for p, h in stack.targets().items() if h == "up"},
            60,
            f"Prometheus to scrape {sorted(TARGETS)}: {stack.targets()}",
            POLL_S,
        )
        query = f'tandem_learner_step{{job="{job_id}"}}'
        first = wait_for(lambda: stack.prometheus(query), 60, f"{query} in Prometheus", POLL_S)
        before = float(first[0]["value"][1])
        wait_for(
            lambda: float(stack.prometheus(query)[0]["value"][1]) > before,
            120,
            f"{query} to rise past {before}",
            POLL_S,
        )

    with stack.phase("rollout crashes mid-job: restarted, the job goes on"):
        # SIGKILL to the container's process, as the kernel's OOM killer sends it. (`docker
        # kill` is a manual stop to Docker: no restart policy brings that back.)
        rollout = stack.container("rollout-cpu")
        restarts = stack.inspect(rollout, "{{.RestartCount}}")
        os.kill(int(stack.inspect(rollout, "{{.State.Pid}}")), signal.SIGKILL)
        wait_for(
            lambda: (
                stack.inspect(rollout, "{{.RestartCount}}") != restarts
                and stack.states().get("rollout-cpu") == "running/healthy"
            ),
            300,
            "the restart policy to start the crashed rollout container again, healthy",
            POLL_S,
        )
        stack.wait_for_step(job_id, stack.rl_steps(job_id) + 3)  # served by the new process alone
        # A pause for the missing server, if the watchdog saw one, ended with the server's return.
        assert stack.job(job_id)["paused_reason"] is None, stack.job(job_id)

    with stack.phase("compose restart learner mid-job: resumed from its checkpoint"):
        stack.compose("restart", "learner-cpu", timeout_s=300)
        # The old process may finish a step or two while it stops, so steps alone do not
        # prove the new one trains: first its resume line, then steps counted after it.
        resumed = f"resumed job {job_id}"
        wait_for(
            lambda: resumed in stack.compose("logs", "--no-color", "learner-cpu").stdout,
            300,
            f"the restarted learner to log {resumed!r}",
            POLL_S,
        )
        stack.wait_for_step(job_id, stack.rl_steps(job_id) + 2)

    with stack.phase("follow to the end with the host CLI"):
        stack.cli("follow", job_id)
        history = stack.api.get(f"/v1/jobs/{job_id}/history").json()
        trained = [t for h in history if h.get("phase") == "rl" for t in h["task_ids"]]
        assert stack.job(job_id)["status"] == "SUCCEEDED"
        assert stack.rl_steps(job_id) == STEPS
        assert len(trained) == len(set(trained)), "a task was trained twice"

    with stack.phase("down, then up: jobs and Redis data kept on volumes"):
        stack.compose("--profile", "cpu", "down", "--timeout", "60", timeout_s=300)
        assert not [c for c in stack.leftovers() if c.startswith("ps ")]
        stack.up()
        assert stack.job(job_id)["status"] == "SUCCEEDED"
        assert stack.api.get(f"/v1/jobs/{job_id}/history").json() == history

    with stack.phase("a second job on the restarted stack"):
        second = stack.cli("submit", str(spec)).strip()
        stack.cli("follow", second)
        assert second != job_id and stack.job(second)["status"] == "SUCCEEDED"

    with stack.phase("down -v: no container, network or volume left"):
        stack.compose("--profile", "cpu", "down", "-v", "--remove-orphans", "--timeout", "60", timeout_s=300)
        assert stack.leftovers() == []
