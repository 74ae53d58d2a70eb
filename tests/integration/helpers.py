"""Shared by the integration tests that drive whole processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import redis
import redis.asyncio as aioredis
from polling import wait_for  # noqa: F401  (the integration tests import it from here)
from prometheus_client.parser import text_string_to_metric_families

from devtools.provider import LocalUpstreamConfig, serve_in_thread
from devtools.provider import create_app as create_provider
from rollout.rewards.advantage import group_advantages
from rollout.tasks import clarify
from services import jobs, protocol
from services.config import JobSpec
from services.queues import Keys, StreamConsumer, publish
from services.tokenization import ChatTokenizer
from tandem.demo import write_demonstrations
from tandem.launcher import Ports, Stack, learner_command, process_tree, served_model  # noqa: F401 (tests import served_model here)
from tandem.redis_embed import free_port


def create_job(redis_url: str, spec: JobSpec) -> str:
    """Submit `spec` as the API would (a record and an entry in its tenant's queue); its id."""

    async def create() -> str:
        client = aioredis.from_url(redis_url)
        job_id = await jobs.create_job(client, spec)
        await client.aclose()
        return job_id

    return asyncio.run(create())


def job_ended(api: httpx.Client, job_id: str, timeout_s: float = 300) -> dict:
    """The job's record once it has ended (through the API), polling every half second."""
    return wait_for(
        lambda: (r := api.get(f"/v1/jobs/{job_id}").json())["status"] in jobs.TERMINAL and r,
        timeout_s,
        "the job to end",
        interval_s=0.5,
    )


def engine_of(stack, api: httpx.Client, job_id: str, server: str) -> list:
    """`server`'s engine processes (its only children) once the job has trained a step and
    the server serves it ([] before: a wait_for condition, whose deadline also covers a
    server too busy to answer its health check within 2 s)."""
    port = stack.ports.rollout[int(server.rsplit("-", 1)[1])]
    try:
        serving = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json().get("job") == job_id
    except httpx.TransportError:
        return []
    if not serving or api.get(f"/v1/jobs/{job_id}").json()["step"] < 1:
        return []
    return process_tree(stack.processes[server].pid)[1:]


def rl_steps(client: redis.Redis, job_id: str) -> list[dict]:
    """The job's RL step records, oldest first."""
    return [r for r in map(json.loads, client.lrange(Keys.history(job_id), 0, -1)) if r["phase"] == "rl"]


class Producer(threading.Thread):
    """Answers tasks with groups that depend only on the task (tokens, logprobs, rewards),
    but only tasks below `gate`: the learner then provably waits at a known step."""

    def __init__(
        self,
        redis_url: str,
        job_id: str,
        tokenizer,
        gate: int,
        reward: Callable[[random.Random], float] = lambda rng: float(rng.random() < 0.5),
    ) -> None:
        super().__init__(daemon=True)
        self.redis_url, self.job_id, self.gate, self.reward = redis_url, job_id, gate, reward
        self.chat = ChatTokenizer(tokenizer)
        self.stop = threading.Event()

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        client = aioredis.from_url(self.redis_url)
        tasks = await StreamConsumer(
            client, Keys.tasks(self.job_id), "rollout", "producer", protocol.Task, Keys.dead(self.job_id)
        ).setup()
        held = []
        while not self.stop.is_set():
            held += await tasks.read(16, block_ms=100)
            ready = [d for d in held if d.message.task_id < self.gate]
            held = [d for d in held if d.message.task_id >= self.gate]
            for delivery in ready:
                await publish(client, Keys.trajectories(self.job_id), self.group(delivery.message))
                await tasks.ack(delivery.entry_id)
        await client.aclose()

    def group(self, task: protocol.Task) -> protocol.TrajectoryGroup:
        samples = []
        for i in range(task.group_size):
            rng = random.Random(task.task_id * 1000 + i)
            messages = clarify.demonstration(clarify.make_examples(1, seed=task.example)[0], rng.random() < 0.5, rng)
            tokens, mask = self.chat.encode_demonstration(messages)
            samples.append(
                protocol.Sample(
                    sample_id=f"{task.task_id}:{i}",
                    tokens=tokens,
                    mask=mask,
                    logprobs=[rng.uniform(-3.0, -0.2) if m else 0.0 for m in mask],
                    versions=[task.dispatched_version if m else -1 for m in mask],
                    reward=self.reward(rng),
                    advantage=0.0,
                    num_turns=1,
                )
            )
        for sample, advantage in zip(samples, group_advantages([s.reward for s in samples])):
            sample.advantage = advantage
        return protocol.TrajectoryGroup(
            job_id=self.job_id, task_id=task.task_id, samples=samples, server_id="producer", elapsed_s=0.0
        )


def start_learner(
    redis_url: str, runs: Path, log: Path, resume: bool, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """A learner (torchrun, 2 ranks) that trains on whatever arrives (no rollout server
    needed), with `env` over those settings."""
    env = (
        os.environ
        | {
            "TANDEM_REDIS_URL": redis_url,
            "TANDEM_RUNS_DIR": str(runs),
            "TANDEM_MIN_ROLLOUT_SERVERS": "0",
            "TANDEM_METRICS_PORT": str(free_port()),
            "PYTHONUNBUFFERED": "1",
        }
        | (env or {})
    )
    return subprocess.Popen(
        learner_command(2, resume=resume),
        env=env,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def metric_sum(text: str, *names: str, **labels: str) -> float:
    """The sum of the Prometheus samples called one of `names` whose labels include `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in names and labels.items() <= sample.labels.items()
    )


def vllm_counted(vllm_url: str) -> int:
    """Prompt plus generated tokens, as vLLM's own /metrics count them."""
    text = httpx.get(f"{vllm_url}/metrics").text
    return int(metric_sum(text, "vllm:prompt_tokens_total", "vllm:generation_tokens_total"))


@contextlib.contextmanager
def judge_bound_system(
    tmp_path: Path,
    stand_in: LocalUpstreamConfig,
    prices: dict | None = None,
    env: dict[str, str] | None = None,
    also: dict[str, dict] | None = None,
) -> Iterator[tuple[httpx.Client, str, str]]:
    """The whole system (API, learner, a rollout server, the judge proxy; `env` added to
    theirs) in front of a stand-in provider serving `judge`, with `prices` on it (and the
    models in `also`, each with its prices) and runs in `tmp_path/runs`: a client of its API,
    the stand-in's address and the judge proxy's."""
    with contextlib.ExitStack() as stack:
        stand_in_url = stack.enter_context(serve_in_thread(create_provider(stand_in), free_port()))
        upstreams = stand_in_upstreams(tmp_path / "upstreams.json", stand_in_url, 64, prices=prices, also=also)
        env = {"TANDEM_RUNS_DIR": str(tmp_path / "runs"), "TANDEM_UPSTREAMS": str(upstreams), **(env or {})}
        system = stack.enter_context(Stack(tmp_path / "logs", ports=Ports.free(), extra_env=env))
        yield httpx.Client(base_url=system.api_url, timeout=10), stand_in_url, system.judge_url


def judge_bound_spec(tmp_path: Path, model: Path, name: str, steps: int, group_size: int = 2, **reward) -> dict:
    """A clarify job whose user simulator and judge are the proxy's `judge`, warm-started
    (demonstrations written in `tmp_path`) so that its replies are well formed from the
    start and futures are played and judged every step; `reward` adds to its reward."""
    warm_start = tmp_path / "warm.jsonl"
    write_demonstrations(warm_start, num=1000, share=0.5)
    return {
        "name": name,
        "model": {"path": str(model), "max_model_len": 512},
        "task": {"name": "clarify", "user": "llm", "num_examples": 64},
        "rollout": {"group_size": group_size, "max_new_tokens": 24, "max_turns": 2, "max_total_tokens": 256},
        "reward": {"mode": "multiturn", "window": 1, "num_futures": 2, "judge_rubric": "interactivity",
                   "judge_weight": 0.5, "judge_model": "judge", "user_model": "judge", **reward},
        "train": {"num_steps": steps, "batch_size": 2, "max_staleness": 1, "lr": 1e-4},
        "warm_start": {"steps": 150, "batch_size": 32, "lr": 3e-3, "data": str(warm_start)},
    }  # fmt: skip


def stand_in_upstreams(
    path: Path, url: str, max_concurrency: int = 256, prices: dict | None = None, also: dict[str, dict] | None = None
) -> Path:
    """The judge proxy's upstreams file for one stand-in provider at `url` serving `judge`,
    with a budget no test reaches (and `prices`, USD per million tokens, if given), and the
    models in `also` (name -> prices) from the same stand-in."""
    upstreams = []
    for model, priced in {"judge": prices, **(also or {})}.items():
        upstream = {
            "name": "stand-in" if model == "judge" else f"stand-in-{model}",
            "model": model,
            "base_url": f"{url}/v1",
            "tpm": 50_000_000,
            "rpm": 500_000,
            "max_concurrency": max_concurrency,
        }
        upstreams.append(upstream | ({"prices": priced} if priced else {}))
    path.write_text(json.dumps({"upstreams": upstreams}))
    return path
