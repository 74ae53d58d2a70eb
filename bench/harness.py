"""What the benchmarks share, so each keeps only what it measures.

- **Flags** (`common_args`): `--seeds 0,1,2` (always a list), `--out DIR` (always a folder,
  `bench/results/<name>` by default, which git ignores), `--publish` (copy the report into
  `docs/results/` and its figure into `docs/img/`, where the results pages cite them).
- **The system**: `StandIn`, the repo's stand-in provider (`devtools.provider`) as a process
  with its limits and latency, and the judge proxy's upstreams file for it; `Rig`, a whole
  local system (`tandem.launcher.Stack`) with the stand-in as its LLM provider and a job API
  client; `run_job`, a job submitted, followed to its end and checked SUCCEEDED.
- **Held-out evaluation**: `evaluate_policies`, exported policies played on the same held-out
  conversations of a job's task, one engine reloaded from each folder.
- **Reports**: `spread` (min, mean and max over seeds, and how many runs had no value),
  `moving_average`, `pyplot` (matplotlib without a display), `write_report` (the JSON and the
  figure, and `--publish`).

Run a benchmark as `python -m bench.<name>`; `bench/README.md` lists them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tandem.client import ApiClient, follow
from tandem.launcher import Ports, Stack
from tandem.redis_embed import free_port

REPO = Path(__file__).resolve().parent.parent
PUBLISHED = REPO / "docs" / "results"
"""Where `--publish` copies a report's JSON, beside the results pages that cite it."""
PUBLISHED_FIGURES = REPO / "docs" / "img"
"""Where `--publish` copies a report's figure, with the docs' other pictures."""
UPSTREAM = "stand-in"
"""The stand-in's name in the proxy's upstreams file: the key of its shared budget."""
EXAMPLE_PRICES = {"input_per_mtok": 0.15, "output_per_mtok": 0.6, "cached_input_per_mtok": 0.075}
"""USD per million tokens put on the stand-in, as an example (a small hosted model's list
price in 2025): what the runs' bills are counted in. Not a measurement of any provider."""


# ---- flags --------------------------------------------------------------------------------


def seed_list(text: str) -> list[int]:
    """`--seeds`: comma-separated seeds (`0,1,2`)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are comma-separated integers, not {text!r}") from None


def common_args(parser: argparse.ArgumentParser, name: str, seeds: str | None = "0") -> None:
    """The flags every benchmark takes: `--out` and `--publish`, and `--seeds` unless it runs
    nothing seeded (`seeds` None)."""
    if seeds is not None:
        parser.add_argument(
            "--seeds", type=seed_list, default=seed_list(seeds), help=f"comma-separated (default {seeds})"
        )
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / name, help="the folder the runs and report go to"
    )
    parser.add_argument(
        "--publish", action="store_true", help="copy the report into docs/results/ (its figure into docs/img/) as well"
    )


def out_folder(args: argparse.Namespace) -> Path:
    """`--out`, made and resolved (the processes a benchmark starts have other working folders)."""
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out


# ---- reports ------------------------------------------------------------------------------


def spread(values: list[float | None]) -> dict:
    """min, mean and max of the values that exist, and how many did not (a run that never
    reached a target has no time to it)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"min": None, "mean": None, "max": None, "missing": len(values)}
    return {
        "min": min(present),
        "mean": sum(present) / len(present),
        "max": max(present),
        "missing": len(values) - len(present),
    }


def moving_average(values: list[float], window: int) -> list[float]:
    """Each value's mean with the `window - 1` before it (fewer at the start)."""
    return [
        sum(values[max(0, i + 1 - window) : i + 1]) / len(values[max(0, i + 1 - window) : i + 1])
        for i in range(len(values))
    ]


def pyplot():
    """matplotlib's pyplot, drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(
    name: str,
    report: dict,
    args: argparse.Namespace,
    plot: Callable[[dict, Path], None] | None = None,
) -> Path:
    """`<out>/<name>.json` and, with `plot`, `<out>/<name>.png`; with `--publish` the JSON is
    copied into docs/results/ and the figure into docs/img/. Returns the JSON's path."""
    out = out_folder(args)
    written = [out / f"{name}.json"]
    written[0].write_text(json.dumps(report, indent=2))
    if plot is not None:
        written.append(out / f"{name}.png")
        plot(report, written[1])
    if getattr(args, "publish", False):
        for path, folder in zip(written, (PUBLISHED, PUBLISHED_FIGURES), strict=False):
            shutil.copy(path, folder / path.name)
            written.append(folder / path.name)
    print("wrote " + ", ".join(str(path) for path in written))
    return written[0]


# ---- the system ---------------------------------------------------------------------------


class StandIn:
    """The stand-in provider as its own process (`devtools.provider`: limits, usage, a
    latency model and a prompt cache), and the judge proxy's upstreams file for it."""

    def __init__(self, out: Path, tpm: int, rpm: int, seed: int, latency: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tpm, self.rpm = tpm, rpm
        self.upstreams_file = out / "upstreams.yaml"
        self.upstreams_file.write_text(
            f"upstreams:\n  - name: {UPSTREAM}\n    model: judge\n    base_url: {self.url}/v1\n"
            f"    tpm: {tpm}\n    rpm: {rpm}\n    max_concurrency: 256\n    timeout_s: 60\n"
            "    limit_model: bucket\n"  # the stand-in's own rule
            f"    prices: {json.dumps(EXAMPLE_PRICES)}\n"
        )
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self.log = open(out / "logs" / "stand-in.log", "wb")  # noqa: SIM115 (closed in stop)
        command = [sys.executable, "-m", "devtools.provider", "--port", str(self.port), "--tpm", str(tpm)]
        command += ["--rpm", str(rpm), "--model", "judge", "--seed", str(seed), "--prompt-cache"]
        command += ["--latency"] if latency else []
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_up(out / "logs" / "stand-in.log")

    def _wait_up(self, log: Path, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.stats()
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"the stand-in did not start (see {log})") from None
                time.sleep(0.2)

    def stats(self) -> dict:
        """Its counters: requests, accepted, rejected_429, tokens_accepted, latency_s_total, ..."""
        return httpx.get(f"{self.url}/admin/stats", timeout=5).json()

    def reset(self) -> None:
        """Its bucket back to full and its counters to 0."""
        httpx.post(f"{self.url}/admin/reset", timeout=5).raise_for_status()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.log.close()


@dataclass
class Rig:
    """A whole local system a benchmark submits jobs to: the stack, its API client and, when
    the jobs call LLMs, the stand-in provider behind the judge proxy."""

    stack: Stack
    client: ApiClient
    stand_in: StandIn | None
    out: Path

    @property
    def runs(self) -> Path:
        """Where the jobs' checkpoints, policies and records go."""
        return self.out / "runs"


@contextlib.contextmanager
def rig(
    out: Path,
    stand_in: tuple[int, int, int] | None = None,
    env: dict[str, str] | None = None,
    ports: Ports | None = None,
    **stack_options: Any,
) -> Iterator[Rig]:
    """A `Rig` in `out` (logs in `out/logs`, jobs in `out/runs`), with a stand-in provider of
    (tpm, rpm, seed) when given; `env` adds to the processes' environment and
    `stack_options` to `Stack`'s. Everything is stopped on the way out."""
    provider = StandIn(out, *stand_in) if stand_in is not None else None
    env = {"TANDEM_RUNS_DIR": str(out / "runs")} | (env or {})
    if provider is not None:
        env["TANDEM_UPSTREAMS"] = str(provider.upstreams_file)
    try:
        with Stack(out / "logs", ports=ports or Ports.free(), extra_env=env, **stack_options) as stack:
            yield Rig(stack, ApiClient(stack.api_url), provider, out)
    finally:
        if provider is not None:
            provider.stop()


def run_job(rig: Rig, spec: dict) -> dict:
    """Submit `spec` and follow it to its end: its id, seconds, final record and whole
    history. RuntimeError naming the logs unless it SUCCEEDED."""
    job_id = rig.client.submit(spec)["id"]
    started = time.monotonic()
    record = follow(rig.client, job_id)
    if record["status"] != "SUCCEEDED":
        raise RuntimeError(
            f"{spec.get('name', job_id)}: {record['status']} {record.get('error')} (logs in {rig.stack.log_dir})"
        )
    return {
        "job_id": job_id,
        "seconds": time.monotonic() - started,
        "record": record,
        "history": rig.client.history(job_id),
    }


def rl_steps(history: list[dict]) -> list[dict]:
    """A job's RL step records (its history also holds warm-start and held-out records)."""
    return [h for h in history if h.get("phase") == "rl"]


# ---- held-out evaluation ------------------------------------------------------------------


async def evaluate_policies(
    policies: dict[Hashable, Path],
    job: dict,
    examples: int,
    seed: int,
    without_tools: Callable[[Hashable], bool] = lambda key: False,
    kv_cache_gib: float = 1.0,
) -> dict[Hashable, dict]:
    """Each policy folder on the same `examples` held-out conversations of `job`'s task with
    its defaults (examples generated from `seed`, its own openings, its rule-based user,
    which answers as the LLM simulator is told to), played with `job`'s model length,
    rollout settings and tools, one engine reloaded from each folder: key ->
    `rollout.evaluate.evaluate`'s means. A key for which `without_tools` holds plays without
    the job's tools."""
    from transformers import AutoTokenizer

    from rollout.engine import Engine
    from rollout.episode import EpisodeRunner
    from rollout.evaluate import evaluate
    from rollout.tasks import load_task
    from rollout.tools.box import ToolBox
    from services.config import ModelSpec, parse_job_spec
    from services.tokenization import ChatTokenizer

    spec = parse_job_spec(job)
    first = next(iter(policies.values()))
    task = load_task(type(spec.task).model_validate({"num_examples": examples}), seed)
    if task.rule_user is None:
        raise ValueError(f"task {spec.task.name!r} has no rule-based user: evaluate it inside a job (eval section)")
    engine = Engine.start(ModelSpec(path=str(first), max_model_len=spec.model.max_model_len), kv_cache_gib=kv_cache_gib)
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(first), spec.rollout.tokenization_check)
    box = await ToolBox.open(spec.tools) if spec.tools is not None else None
    plain = EpisodeRunner(engine, chat, task.rule_user, spec.rollout)
    tooled = (
        plain
        if box is None
        else EpisodeRunner(engine, chat.with_tools(box.schemas()), task.rule_user, spec.rollout, box)
    )
    results = {}
    try:
        for key, path in policies.items():
            await engine.reload_from_disk(str(path))
            runner = plain if without_tools(key) else tooled
            results[key] = await evaluate(runner, task, list(range(examples)))
            print(f"  held-out {key}: success {results[key]['success']:.3f}", flush=True)
    finally:
        if box is not None:
            await box.close()
        engine.shutdown()
    return results
