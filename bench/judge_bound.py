"""The judge-bound clarify job that several benchmarks run, and what they measure of it.

The clarify task on the tiny model with the multiturn-aware reward, every LLM call real
HTTP through the judge proxy to the stand-in provider: the user simulator plays the user in
each forward-sampled future and the judge scores each future on the interactivity rubric,
one TPM/RPM budget for both (deploy/configs/clarify-judge.yaml at tiny scale).

- **The job**: `base_spec`, its warm start (`warm_start`) and a run of it (`run_judged`:
  the provider and the proxy's budget full at the start; what the provider counted, the
  CPU seconds of every process and the engine's busy time).
- **Held-out**: `evaluate_once`, exported policies evaluated once per output folder.
- **Figures**: `reached`, `first_reaching`, `ratio`, and `fmt` / `fmt_spread` for tables.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from pathlib import Path

import httpx

from bench.harness import UPSTREAM, Rig, evaluate_policies, rl_steps, run_job
from services.queues import Keys
from tandem.client import load_spec_file
from tandem.demo import DEMO_SPEC, prepare

REWARD = {
    "mode": "multiturn",
    "window": 2,
    "num_futures": 3,
    "token_penalty": 5e-4,
    "extrinsic_weight": 1.0,
    "judge_rubric": "interactivity",
    "judge_weight": 0.5,
    "judge_model": "judge",
    "user_model": "judge",
    "scale_advantage_by_std": False,
}
WARM_START_STEPS = 400
FIRST_LR = 5e-4
"""The step size of async_speedup's first measurements (runs kept from before its `--lr`
were made at it), and still that of the benches taking `base_spec`'s default."""
PROVIDER_COUNTERS = ("requests", "accepted", "rejected_429", "recognised", "tokens_accepted", "latency_s_total")
"""The stand-in's counters a run reports, as differences over the run."""
HELD_OUT_SEED = 10_000
"""The held-out conversations' seed: examples no training run draws."""


# ---- the job ------------------------------------------------------------------------------


def base_spec(out: Path, steps: int, lr: float = FIRST_LR) -> dict:
    """The judge-bound job on the tiny model (deploy/configs/clarify-judge.yaml at tiny scale)."""
    spec = prepare(out, load_spec_file(DEMO_SPEC))
    spec["task"] |= {"user": "llm", "followup_share": 0.5}
    spec["rollout"] |= {"group_size": 4}
    spec["reward"] = dict(REWARD)
    spec["train"] |= {"num_steps": steps, "batch_size": 8, "lr": lr, "kl_coef": 0.02}
    spec["warm_start"]["steps"] = WARM_START_STEPS
    return spec


def fresh_budget(rig: Rig) -> None:
    """The provider's bucket and the proxy's shared budget back to full."""
    import redis

    rig.stand_in.reset()
    budget = Keys.judge_budget(UPSTREAM)
    redis.Redis.from_url(rig.stack.redis_url).delete(budget, budget + ":leases")


def provider_counters(rig: Rig) -> dict[str, float]:
    """The stand-in's counters now, those a run reports."""
    stats = rig.stand_in.stats()
    return {key: stats[key] for key in PROVIDER_COUNTERS}


def cpu_seconds(rig: Rig) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process and its children (the
    learner's ranks, the rollout server's engine processes): where the cores go."""
    import psutil

    from tandem.launcher import process_tree

    roots = {name: process.pid for name, process in rig.stack.processes.items()}
    roots["stand-in"] = rig.stand_in.process.pid
    used: dict[str, float] = {}
    for name, pid in roots.items():
        for process in process_tree(pid):
            try:
                times = process.cpu_times()
                part = name if process.pid == pid or name == "learner" else f"{name} {process.name()}"
            except psutil.NoSuchProcess:
                continue
            used[part] = used.get(part, 0.0) + times.user + times.system
    return used


def used_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """`after - before` per key of `after` (a process started since counts from 0)."""
    return {name: after[name] - before.get(name, 0.0) for name in after}


def scrape(url: str, metric: str, job_id: str) -> float:
    """The sample of a Prometheus metric labelled with `job_id` (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(url, timeout=5).text)
    return next(
        (
            sample.value
            for family in families
            for sample in family.samples
            if sample.name == metric and sample.labels.get("job") == job_id
        ),
        0.0,
    )


def run_judged(rig: Rig, spec: dict) -> dict:
    """Run `spec` with the provider and the shared budget fresh: its id, RL step records,
    in-job held-out rounds, the proxy's bill, the provider's counters, the first rollout
    server's engine busy seconds and every process's CPU seconds over the run."""
    fresh_budget(rig)
    provider_before, cpu_before = provider_counters(rig), cpu_seconds(rig)
    run = run_job(rig, spec)
    provider_after, cpu_after = provider_counters(rig), cpu_seconds(rig)
    job_id = run["job_id"]
    # Only the exported policies are evaluated later; the learner's resumable checkpoints
    # (parameters and optimizer state, several per job) would fill the disk over many runs.
    shutil.rmtree(rig.runs / job_id / "checkpoints", ignore_errors=True)
    rollout_metrics = f"http://127.0.0.1:{rig.stack.ports.rollout[0]}/metrics"
    return {
        "job_id": job_id,
        "history": rl_steps(run["history"]),
        "job_eval": [h for h in run["history"] if h.get("phase") == "eval"],
        "spend": rig.client.get(job_id).get("spend", {}),
        "provider": used_since(provider_before, provider_after),
        "engine_busy_s": scrape(rollout_metrics, "tandem_rollout_engine_busy_seconds_total", job_id),
        "cpu_s": used_since(cpu_before, cpu_after),
    }


def warm_start(rig: Rig, base: dict) -> Path:
    """The warm-start policy every run starts from: SFT in a job of one RL step."""
    warm = copy.deepcopy(base) | {"name": "warm-start"}
    warm["train"] |= {"num_steps": 1, "max_staleness": 0}
    print(f"warm start ({base['warm_start']['steps']} SFT steps)")
    return rig.runs / run_judged(rig, warm)["job_id"] / "policy-warm-start"


# ---- held-out -----------------------------------------------------------------------------


def evaluate_once(out: Path, policies: dict, conversations: int, job: dict | None = None) -> dict:
    """Held-out results of `policies` on `conversations` conversations (played with `job`'s
    rollout settings; default the demo's), each policy folder evaluated once in this output
    folder (`held_out.json` keeps the results)."""
    cache_file = out / "held_out.json"
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    key = lambda path: f"{path}:{conversations}"  # noqa: E731
    todo = {name: path for name, path in policies.items() if key(path) not in cache}
    if todo:
        job = job or load_spec_file(DEMO_SPEC)
        results = asyncio.run(evaluate_policies(todo, job, conversations, seed=HELD_OUT_SEED))
        for name, result in results.items():
            cache[key(todo[name])] = result
        cache_file.write_text(json.dumps(cache))
    return {name: cache[key(path)] for name, path in policies.items()}


# ---- figures ------------------------------------------------------------------------------


def reached(average: list[float], window: int, target: float) -> int | None:
    """The index of the first step whose moving average, over a full `window`, is >= `target`."""
    return next((i for i, value in enumerate(average) if i + 1 >= window and value >= target), None)


def first_reaching(curve: list[dict], target: float) -> float | None:
    """Wall seconds at the first held-out point whose success is >= `target`."""
    return next((point["seconds"] for point in curve if point["success"] >= target), None)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or zero (a target never reached)."""
    return numerator / denominator if numerator and denominator else None


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """`value` formatted, "-" when there is none."""
    return "-" if value is None else format(value, spec) + suffix


def fmt_spread(s: dict, spec: str, suffix: str = "") -> str:
    """min / mean / max (and how many seeds have no value)."""
    text = " / ".join(fmt(s[k], spec, suffix) for k in ("min", "mean", "max"))
    return text + (f" ({s['missing']} never)" if s["missing"] else "")
