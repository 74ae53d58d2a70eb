"""Elastic rollout servers on a running job: throughput as servers join, a kill, a drain.

One judge-bound job (the clarify task with the multiturn-aware reward, user simulator and
judge on the repo's stand-in provider with its latency model: bench/judge_bound.py's job)
runs on one running system while its rollout servers change:

  1 server  ->  a second joins  ->  a third joins  ->  one is SIGKILLed (with its engine)
  as a weight update that names it begins  ->  another is drained by SIGTERM.

Each phase is measured for `--phase-s` seconds once the learner counts its servers: the
policy tokens the servers generated per second (their `tandem_rollout_generated_tokens_total`,
scraped every second) and the RL steps per minute. The baseline is the first phase, one
server, of the same run: the table gives each phase's ratio to it. Each server takes at most
`--tasks-per-server` tasks at once, as a GPU server's batch would bound it; on these 2-core
machines the engines share the CPU, so what a server adds is concurrency against the
provider's latency, not compute.

Also reported: the membership the learner recorded (joins, the loss, the drain), weight
broadcasts that failed and the longest publish, tasks the drain handed back, groups trained
twice (0 expected: the learner refuses a second group for a task).

Run: python -m bench.elastic [--phase-s 60] [--tasks-per-server 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import httpx

from bench.harness import common_args, out_folder, rig, write_report
from bench.judge_bound import base_spec, scrape
from services import protocol
from services.queues import Keys
from tandem.launcher import Ports, Stack, kill_all, process_tree
from tandem.progress import Progress

TOKENS = "tandem_rollout_generated_tokens_total"


def generated_tokens(port: int, job_id: str) -> float | None:
    """A server's generated-token count for the job; None when it does not answer."""
    try:
        return scrape(f"http://127.0.0.1:{port}/metrics", TOKENS, job_id)
    except httpx.HTTPError:
        return None


class Watch:
    """The job seen from outside: servers' token counters and the learner's step."""

    def __init__(self, stack: Stack, api: httpx.Client, job_id: str) -> None:
        self.stack, self.api, self.job_id = stack, api, job_id

    def servers_on_job(self) -> list[str]:
        records = self.api.get(f"/v1/jobs/{self.job_id}/servers").json()
        return records[-1]["servers"] if records else []

    def step(self) -> int:
        return self.api.get(f"/v1/jobs/{self.job_id}").json()["step"]

    def measure(self, label: str, seconds: float) -> dict:
        """Tokens per second summed over the servers alive through the phase (each one's own
        counter difference, so a server that leaves takes only its own count with it)."""
        ports = {
            name: self.stack.ports.rollout[int(name.rsplit("-", 1)[1])]
            for name in self.stack.processes
            if name.startswith("rollout-")
        }
        first = {name: generated_tokens(port, self.job_id) for name, port in ports.items()}
        step0, started = self.step(), time.monotonic()
        with Progress(round(seconds), f"  {label}", "s", file=sys.stdout) as progress:
            while time.monotonic() - started < seconds:
                time.sleep(1.0)
                progress.update(round(time.monotonic() - started))
        elapsed = time.monotonic() - started
        last = {name: generated_tokens(port, self.job_id) for name, port in ports.items()}
        tokens = sum(last[n] - first[n] for n in ports if first[n] is not None and last[n] is not None)
        steps = self.step() - step0
        print(f"  {label}: {tokens / elapsed:.0f} tokens/s, {steps} steps")
        return {
            "phase": label,
            "servers": len(self.servers_on_job()),
            "seconds": elapsed,
            "tokens_per_s": tokens / elapsed,
            "steps_per_min": 60 * steps / elapsed,
        }

    def wait_servers(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.servers_on_job()) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the learner did not count {count} servers within {timeout_s:.0f}s")
            time.sleep(0.5)


def kill_in_update(stack: Stack, job_id: str, victim: str, timeout_s: float = 300) -> int:
    """SIGKILL `victim` and its engine the moment a plan for a new version names it; that version."""
    import redis

    client = redis.Redis.from_url(stack.redis_url)

    def named() -> int:
        raw = client.hget(Keys.weights(job_id), "plan")
        plan = protocol.decode(raw, protocol.WeightPlan) if raw else None
        return plan.version if plan and victim in plan.ranks else -1

    current, deadline = named(), time.monotonic() + timeout_s
    while (version := named()) <= current:
        if time.monotonic() > deadline:
            raise TimeoutError("no weight update named the victim")
        time.sleep(0.002)
    kill_all(process_tree(stack.processes.pop(victim).pid))
    return version


def run(args: argparse.Namespace, out: Path) -> dict:
    """The job through its phases on one system; the phases' figures and what happened."""
    env = {
        "TANDEM_MAX_CONCURRENT_TASKS": str(args.tasks_per_server),
        "TANDEM_MIN_ROLLOUT_SERVERS": "1",
        "TANDEM_SERVER_TIMEOUT_S": "6",
        "TANDEM_WEIGHT_TIMEOUT_S": "15",
        "TANDEM_TASK_RECLAIM_IDLE_S": "5",
        "TANDEM_DRAIN_TIMEOUT_S": str(args.drain_timeout_s),
    }
    spec = base_spec(out, steps=100_000)  # cancelled after the last phase
    spec["warm_start"]["steps"] = 20  # throughput, not learning: a short warm start
    spec["train"]["max_staleness"] = 4
    started = time.monotonic()
    stand_in = (args.tpm, args.rpm, args.seeds[0])
    with rig(out, stand_in=stand_in, env=env, ports=Ports.free(rollout_servers=1)) as system:
        phases, events, history, drain_log = through_phases(system.stack, spec, args)
    rl = [r for r in history if r["phase"] == "rl"]
    trained = [task_id for r in rl for task_id in r["task_ids"]]
    handed = [line for line in drain_log.splitlines() if "tasks handed back" in line]
    return {
        "phases": phases,
        "events": events,
        "steps": len(rl),
        "groups_trained": len(trained),
        "groups_trained_twice": len(trained) - len(set(trained)),
        "sync_failures": rl[-1].get("sync_failures", 0) if rl else 0,
        "max_sync_s": max((r["sync_seconds"] for r in rl), default=0.0),
        "drain_line": handed[-1].split("rollout.server: ")[-1] if handed else "",
        "tasks_per_server": args.tasks_per_server,
        "phase_s": args.phase_s,
        "cpu_cores": os.cpu_count(),
        "total_s": time.monotonic() - started,
    }


def through_phases(stack: Stack, spec: dict, args: argparse.Namespace) -> tuple[list[dict], dict, list[dict], str]:
    """Submit `spec`, measure each phase as servers join, one dies and one drains, then
    cancel the job: the phases, the events, the job's history and the drained server's log."""
    api = httpx.Client(base_url=stack.api_url, timeout=10)
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    watch = Watch(stack, api, job_id)
    phases, events = [], {}
    while watch.step() < 2:
        time.sleep(1.0)
    phases.append(watch.measure("1 server", args.phase_s))
    second = stack.add_rollout_server()
    watch.wait_servers(2, 600)
    phases.append(watch.measure("2 servers", args.phase_s))
    third = stack.add_rollout_server()
    watch.wait_servers(3, 600)
    phases.append(watch.measure("3 servers", args.phase_s))
    events["killed_at_version"] = kill_in_update(stack, job_id, second)
    watch.wait_servers(2, 120)
    phases.append(watch.measure("2 servers after the kill", args.phase_s))
    draining = stack.processes.pop(third)
    os.kill(draining.pid, signal.SIGTERM)
    drain_started = time.monotonic()
    events["drain_exit_code"] = draining.wait(timeout=args.drain_timeout_s + 120)
    events["drain_s"] = time.monotonic() - drain_started
    watch.wait_servers(1, 60)
    phases.append(watch.measure("1 server after the drain", args.phase_s))
    api.post(f"/v1/jobs/{job_id}/cancel")
    while api.get(f"/v1/jobs/{job_id}").json()["status"] == "RUNNING":
        time.sleep(1.0)
    history = api.get(f"/v1/jobs/{job_id}/history").json()
    events["membership"] = api.get(f"/v1/jobs/{job_id}/servers").json()
    return phases, events, history, (stack.log_dir / f"{third}.log").read_text()


def print_report(report: dict) -> None:
    base = report["phases"][0]["tokens_per_s"]
    print(
        f"\nelastic rollout servers: judge-bound clarify job, {report['tasks_per_server']} tasks per server, "
        f"{report['phase_s']:.0f} s per phase, {report['cpu_cores']} CPU cores"
    )
    print(f"{'phase':>26} {'servers':>8} {'tokens/s':>9} {'vs 1 server':>12} {'steps/min':>10}")
    for phase in report["phases"]:
        print(
            f"{phase['phase']:>26} {phase['servers']:>8} {phase['tokens_per_s']:>9.0f} "
            f"{phase['tokens_per_s'] / base:>11.2f}x {phase['steps_per_min']:>10.1f}"
        )
    print(
        f"membership: {len(report['events']['membership'])} changes; broadcasts failed: {report['sync_failures']}; "
        f"longest publish: {report['max_sync_s']:.1f} s"
    )
    print(
        f"drain: exit {report['events']['drain_exit_code']} after {report['events']['drain_s']:.1f} s "
        f"({report['drain_line']}); groups trained: {report['groups_trained']}, "
        f"twice: {report['groups_trained_twice']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--tasks-per-server", type=int, default=2)
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument("--tpm", type=int, default=1_500_000)
    parser.add_argument("--rpm", type=int, default=10_000)
    common_args(parser, "elastic")  # --seeds: one, the stand-in's (argparse reads `--seed` as short for it)
    args = parser.parse_args()
    if len(args.seeds) != 1:
        parser.error("one job, one seed")
    out = out_folder(args)  # the system's logs and the job's runs, beside the report
    report = run(args, out)
    print_report(report)
    write_report("elastic", report, args)


if __name__ == "__main__":
    main()
