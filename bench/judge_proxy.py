"""Judge proxy: the latency it adds under budget, and budget use under overload, against a
provider whose limits match the proxy's model and against one whose limits do not.

Real processes on loopback: an embedded Redis, two local upstreams (`devtools.provider`:
OpenAI-compatible, enforcing their own TPM/RPM with 429 + retry-after, 2 ms service time)
and proxy replicas (`python -m tandem.cli judge-proxy`) sharing the Redis.

  latency     200 requests/s, open loop, to the upstream whose budget is far away: directly
              (the baseline) and through the replicas (alternating between them), in
              alternating 5 s blocks so both meet the same machine load. The proxy's added
              latency per request = round trip - queue wait - upstream call, both as the
              proxy reports them in `Server-Timing`.
  saturation  64 concurrent clients (8 jobs, a quarter at judge priority, spread over the
              replicas) ask the rate-limited upstream for far more than its budget; `--seconds`
              are measured once the warm-up has passed and the upstream's first full budget is
              spent (its level below 2% of TPM). Clients honour `Retry-After`. Reported:
              utilization = tokens the upstream accepted / (TPM x minutes) over the measured
              window, the upstream's own 429 count, and every request accounted for
              (answered, or refused with Retry-After; lost = neither). Three scenarios:
    bucket    2 replicas; the upstream refills a bucket continuously and the proxy is told so
              (`limit_model: bucket`): the limits match.
    strict    3 replicas; the upstream enforces a strict trailing 60 s window and counts
              prompts at 3 characters a token, a third denser than the proxy's chars/4
              estimate; the proxy is told `limit_model: window` and learns the ratio from
              `usage`. The warm-up is the first minute (`--strict-warmup`): 429s while the
              ratio is learned are counted apart from the measured window's.
    mismatch  (only with `--scenarios ... mismatch`) the strict provider behind a proxy told
              `limit_model: bucket`: what a wrong limit model costs.

Everything shares the machine's cores (the JSON keeps how many, and the load average), so
the load generator is aiohttp, which costs about a third of httpx's CPU per request.
Run: python -m bench.judge_proxy [--seconds 180] [--warmup 10] [--strict-warmup 60]
[--latency-seconds 30] [--scenarios bucket strict]. Writes judge_proxy.json in `--out`
(bench/results/judge_proxy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from bench.harness import common_args, write_report
from tandem.progress import Progress
from tandem.redis_embed import EmbeddedRedis, free_port

TPM, RPM = 240_000, 1800
NUM_CLIENTS, NUM_JOBS = 64, 8
MAX_TOKENS = 256
DRAINED_TOKENS = TPM // 50
"""The upstream's bucket counts as spent below 2% of a minute's tokens."""
LATENCY_RATE = 200
WORDS = (
    "budget token minute replica upstream judge rubric verdict score queue deadline "
    "refill reserve settle window limit provider request answer conversation"
).split()


@dataclass
class Tally:
    sent: int = 0
    refused: int = 0
    answered: Counter = field(default_factory=Counter)
    """Answered requests by priority."""
    errors: Counter = field(default_factory=Counter)
    queue_ms: list[tuple[float, float]] = field(default_factory=list)
    """(time answered, queue wait in ms) of answered requests."""


@dataclass(frozen=True)
class Scenario:
    """A provider, and what the proxy is told about it."""

    name: str
    replicas: int
    provider: tuple[str, ...]
    """The limited upstream's options (how it enforces and counts)."""
    told: dict
    """The proxy's config entry for it, beyond the limits."""
    about: str


STRICT_PROVIDER = ("--limit-model", "window", "--window-s", "60", "--prompt-chars-per-token", "3")
SCENARIOS = {
    "bucket": Scenario(
        "bucket", 2, ("--limit-model", "bucket"), {"limit_model": "bucket"}, "bucket upstream, proxy told bucket"
    ),
    "strict": Scenario(
        "strict",
        3,
        STRICT_PROVIDER,
        {"limit_model": "window"},
        "trailing 60 s window, prompts 1/3 denser; proxy told window",
    ),
    "mismatch": Scenario(
        "mismatch", 3, STRICT_PROVIDER, {"limit_model": "bucket"}, "the strict upstream; proxy told bucket"
    ),
}


@contextlib.contextmanager
def processes(log_dir: Path, queue_deadline_s: float, scenario: Scenario):
    """Redis, the two local upstreams and the proxy replicas, all fresh; yields their URLs."""
    log_dir = log_dir / scenario.name
    log_dir.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis() as redis, contextlib.ExitStack() as stack:
        limited, fast = free_port(), free_port()
        proxy_ports = [free_port() for _ in range(scenario.replicas)]
        upstream = [sys.executable, "-m", "devtools.provider", "--service-ms", "2"]
        stack.enter_context(
            spawn(
                log_dir / "upstream-limited.log",
                upstream + ["--port", str(limited), "--tpm", str(TPM), "--rpm", str(RPM), *scenario.provider],
            )
        )
        stack.enter_context(
            spawn(
                log_dir / "upstream-fast.log",
                upstream + ["--port", str(fast), "--tpm", str(10**10), "--rpm", str(10**8)],
            )
        )
        config = log_dir / "upstreams.json"
        config.write_text(
            json.dumps(
                {
                    "upstreams": [
                        {**upstream_entry("limited", "judge", limited, TPM, RPM, max_concurrency=64), **scenario.told},
                        upstream_entry("fast", "fast", fast, 10**10, 10**8, max_concurrency=512),
                    ]
                }
            )
        )
        for i, port in enumerate(proxy_ports):
            env = {
                "TANDEM_REDIS_URL": redis.url,
                "TANDEM_PORT": str(port),
                "TANDEM_UPSTREAMS": str(config),
                "TANDEM_QUEUE_DEADLINE_S": str(queue_deadline_s),
                "TANDEM_LOG_LEVEL": "WARNING",
            }
            stack.enter_context(
                spawn(log_dir / f"proxy-{i}.log", [sys.executable, "-m", "tandem.cli", "judge-proxy"], env)
            )
        urls = {
            "limited": f"http://127.0.0.1:{limited}",
            "fast": f"http://127.0.0.1:{fast}",
            "proxies": [f"http://127.0.0.1:{p}" for p in proxy_ports],
        }
        for url in [
            urls["limited"] + "/admin/stats",
            urls["fast"] + "/admin/stats",
            *(p + "/healthz" for p in urls["proxies"]),
        ]:
            wait_until_up(url)
        yield urls


def upstream_entry(name: str, model: str, port: int, tpm: int, rpm: int, max_concurrency: int) -> dict:
    return {
        "name": name,
        "model": model,
        "upstream_model": "local-model",
        "base_url": f"http://127.0.0.1:{port}/v1",
        "tpm": tpm,
        "rpm": rpm,
        "max_concurrency": max_concurrency,
    }


@contextlib.contextmanager
def spawn(log: Path, command: list[str], env: dict | None = None):
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_until_up(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def prompt(rng: random.Random) -> list[dict]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 100)))
    return [{"role": "system", "content": "You simulate a user."}, {"role": "user", "content": words}]


@dataclass
class Answer:
    status: int
    headers: Mapping[str, str]


def session(max_connections: int) -> aiohttp.ClientSession:
    # The load generator must cost less than what it measures: on this machine aiohttp
    # spends about 0.2 ms of CPU per request where httpx spends 0.7 ms.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections), timeout=aiohttp.ClientTimeout(total=120)
    )


async def post(http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> Answer:
    async with http.post(url, json=body, headers=headers) as response:
        await response.read()
        return Answer(response.status, response.headers)


def server_timing(answer: Answer) -> dict[str, float]:
    """`Server-Timing: queue;dur=1.2, upstream;dur=3.4` -> {"queue": 1.2, "upstream": 3.4} (ms)."""
    timings = {}
    for part in answer.headers.get("server-timing", "").split(","):
        name, _, duration = part.strip().partition(";dur=")
        if duration:
            timings[name] = float(duration)
    return timings


async def saturating_client(
    http: aiohttp.ClientSession, url: str, index: int, stop: asyncio.Event, tally: Tally
) -> None:
    rng = random.Random(index)
    priority = "judge" if index % 4 == 0 else "simulator"
    headers = {"x-tandem-job": f"job-{index % NUM_JOBS}", "x-tandem-priority": priority}
    while not stop.is_set():
        tally.sent += 1
        body = {"model": "judge", "messages": prompt(rng), "max_tokens": MAX_TOKENS}
        try:
            answer = await post(http, f"{url}/v1/chat/completions", body, headers)
        except (aiohttp.ClientError, TimeoutError) as err:
            tally.errors[type(err).__name__] += 1
            continue
        if answer.status == 200:
            tally.answered[priority] += 1
            tally.queue_ms.append((time.monotonic(), server_timing(answer)["queue"]))
        elif answer.status == 429 and "retry-after" in answer.headers:
            tally.refused += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), float(answer.headers["retry-after"]))
        else:
            tally.errors[f"HTTP {answer.status}"] += 1


async def saturate(urls: dict, seconds: float, warmup: float, name: str) -> dict:
    """Overload from the start; measure `seconds` once the upstream's first full budget is spent."""
    tally, stop = Tally(), asyncio.Event()
    proxies = urls["proxies"]
    async with session(2 * NUM_CLIENTS) as http:
        start = await upstream_stats(http, urls["limited"])
        clients = [
            asyncio.create_task(saturating_client(http, proxies[i % len(proxies)], i, stop, tally))
            for i in range(NUM_CLIENTS)
        ]
        with Progress(round(warmup + seconds), name, "s") as progress:
            first = await drained(http, urls["limited"], warmup, progress)
            for second in range(round(seconds)):
                await asyncio.sleep(max(0.0, first["at"] + second + 1 - time.monotonic()))
                postfix = {"answered": str(sum(tally.answered.values())), "refused": str(tally.refused)}
                progress.update(progress.n + 1, postfix=postfix)
        last = await upstream_stats(http, urls["limited"])
        stop.set()
        await asyncio.gather(*clients)
        final = await upstream_stats(http, urls["limited"])
    return saturation_report(tally, start, first, last, final)


async def drained(http: aiohttp.ClientSession, url: str, warmup: float, progress: Progress) -> dict:
    """The upstream's stats once `warmup` seconds have passed and its bucket is nearly empty."""
    started = time.monotonic()
    while True:
        await asyncio.sleep(1.0)
        progress.advance()
        stats = await upstream_stats(http, url)
        if stats["at"] - started >= warmup and stats["tokens_level"] < DRAINED_TOKENS:
            return stats


async def upstream_stats(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/admin/stats") as response:
        return {**(await response.json()), "at": time.monotonic()}


def saturation_report(tally: Tally, start: dict, first: dict, last: dict, final: dict) -> dict:
    """`start`: the upstream's stats when the clients start; `first`/`last`: the measured
    window; `final`: once every client has its last answer."""
    window_s = last["at"] - first["at"]
    budget = TPM / 60 * window_s
    accepted = last["tokens_accepted"] - first["tokens_accepted"]
    # The most the upstream could accept over the whole run: its bucket then, and the refill.
    whole_run_budget = start["tokens_level"] + TPM / 60 * (final["at"] - start["at"])
    whole_run_accepted = final["tokens_accepted"] - start["tokens_accepted"]
    answered = sum(tally.answered.values())
    return {
        "tpm": TPM,
        "rpm": RPM,
        "clients": NUM_CLIENTS,
        "window_s": round(window_s, 1),
        "warmup_s": round(first["at"] - start["at"], 1),
        "budget_tokens": round(budget),
        "accepted_tokens": accepted,
        "utilization": accepted / budget,
        "upstream_level_at_window_start": round(first["tokens_level"]),
        "whole_run_utilization": whole_run_accepted / whole_run_budget,
        "upstream_requests_per_s": (last["accepted"] - first["accepted"]) / window_s,
        "upstream_429": final["rejected_429"] - first["rejected_429"],
        "upstream_429_in_warmup": first["rejected_429"] - start["rejected_429"],
        "requests_sent": tally.sent,
        "answered": answered,
        "answered_by_priority": dict(tally.answered),
        "refused_with_retry_after": tally.refused,
        "errors": dict(tally.errors),
        "lost": tally.sent - answered - tally.refused,
        "upstream_accepted_matches_answered": final["accepted"] - start["accepted"] == answered,
        "queue_wait_ms_in_window": percentiles([ms for at, ms in tally.queue_ms if first["at"] <= at <= last["at"]]),
    }


async def open_loop(
    http: aiohttp.ClientSession, targets: list[str], body: dict, seconds: float, rate: float = LATENCY_RATE
) -> tuple[list[dict], int]:
    """Requests at a fixed rate whatever the replies do; returns timings and the error count."""
    samples: list[dict] = []
    errors = 0

    async def one(url: str) -> None:
        nonlocal errors
        started = time.perf_counter()
        try:
            answer = await post(http, url, body)
        except (aiohttp.ClientError, TimeoutError):
            errors += 1
            return
        round_trip_ms = (time.perf_counter() - started) * 1e3
        if answer.status != 200:
            errors += 1
            return
        samples.append({"round_trip": round_trip_ms, **server_timing(answer)})

    tasks = []
    total = int(rate * seconds)
    started = time.perf_counter()
    for i in range(total):
        await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one(targets[i % len(targets)])))
    await asyncio.gather(*tasks)
    return samples, errors


async def latency(urls: dict, seconds: float, block_s: float = 5.0) -> dict:
    """Direct and proxied calls in alternating blocks, so both meet the same machine load."""
    body = {"messages": [{"role": "user", "content": "Rate this reply."}], "max_tokens": 16}
    phases = {
        "direct": ([f"{urls['fast']}/v1/chat/completions"], {**body, "model": "local-model"}),
        "proxied": ([f"{p}/v1/chat/completions" for p in urls["proxies"]], {**body, "model": "fast"}),
    }
    samples: dict[str, list[dict]] = {"direct": [], "proxied": []}
    errors = Counter()
    async with session(256) as http:
        for targets, phase_body in phases.values():  # warm the connection pools up
            await open_loop(http, targets, phase_body, 2)
        blocks = max(1, round(seconds / block_s))
        with Progress(blocks, "latency", "blocks") as progress:
            for _ in range(blocks):
                for name, (targets, phase_body) in phases.items():
                    got, failed = await open_loop(http, targets, phase_body, seconds / blocks)
                    samples[name] += got
                    errors[name] += failed
                progress.advance()
        upstream_429 = (await upstream_stats(http, urls["fast"]))["rejected_429"]
    proxied = samples["proxied"]
    direct_rt = percentiles([s["round_trip"] for s in samples["direct"]])
    proxied_rt = percentiles([s["round_trip"] for s in proxied])
    return {
        "rate_per_s": LATENCY_RATE,
        "seconds_each": seconds,
        "block_s": seconds / blocks,
        "direct_round_trip_ms": direct_rt,
        "proxied_round_trip_ms": proxied_rt,
        "proxy_added_ms": percentiles([s["round_trip"] - s["queue"] - s["upstream"] for s in proxied]),
        "proxy_queue_wait_ms": percentiles([s["queue"] for s in proxied]),
        "upstream_call_ms": percentiles([s["upstream"] for s in proxied]),
        "ratio_p50": proxied_rt["p50"] / direct_rt["p50"],
        "ratio_p99": proxied_rt["p99"] / direct_rt["p99"],
        "errors": dict(errors),
        "upstream_429": upstream_429,
    }


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "n": len(ordered),
        "p50": pick(0.5),
        "p99": pick(0.99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }


def p50_p99(stats: dict) -> str:
    return f"{stats['p50']:.0f} / {stats['p99']:.0f}" if stats["n"] else "none answered"


def table(results: dict) -> str:
    runs, lat = results["saturation"], results["latency"]
    names = list(runs)

    def row(label: str, cell, target: str = "") -> tuple:
        return (label, *(cell(runs[n]) for n in names), target)

    rows = [
        row("proxy replicas", lambda s: str(s["replicas"])),
        row("warm-up before measuring (s)", lambda s: f"{s['warmup_s']:.0f}"),
        row(
            "budget utilization (accepted / TPM x minutes)",
            lambda s: f"{s['utilization']:.1%}",
            ">= 95% matched, >= 90% strict",
        ),
        row("  whole run incl. first full budget", lambda s: f"{s['whole_run_utilization']:.1%}"),
        row("upstream 429s, measured window", lambda s: str(s["upstream_429"]), "0"),
        row("upstream 429s, warm-up", lambda s: str(s["upstream_429_in_warmup"])),
        row("learned prompt ratio (upstream / chars/4)", lambda s: f"{s['prompt_ratio']:.3f}"),
        row(
            "requests sent / answered / refused",
            lambda s: f"{s['requests_sent']} / {s['answered']} / {s['refused_with_retry_after']}",
        ),
        row("lost / errored", lambda s: f"{s['lost']} / {sum(s['errors'].values())}", "0 / 0"),
        row("queue wait of answered p50 / p99 (ms)", lambda s: p50_p99(s["queue_wait_ms_in_window"])),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [
        f"{'':{width}}  " + "  ".join(f"{n:>18}" for n in names) + "  target",
        "-" * (width + 20 * len(names) + 30),
    ]
    lines += [f"{r[0]:{width}}  " + "  ".join(f"{c:>18}" for c in r[1:-1]) + f"  {r[-1]}" for r in rows]
    latency_rows = [
        (
            f"direct round trip p50 / p99 at {lat['rate_per_s']}/s (ms)",
            f"{lat['direct_round_trip_ms']['p50']:.2f} / {lat['direct_round_trip_ms']['p99']:.2f}",
            "baseline",
        ),
        (
            "proxied round trip p50 / p99 (ms)",
            f"{lat['proxied_round_trip_ms']['p50']:.2f} / {lat['proxied_round_trip_ms']['p99']:.2f}",
            f"x{lat['ratio_p50']:.2f} / x{lat['ratio_p99']:.2f}",
        ),
        (
            "proxy added latency p50 / p99 (ms, excl. queue)",
            f"{lat['proxy_added_ms']['p50']:.2f} / {lat['proxy_added_ms']['p99']:.2f}",
            "p99 <= 5",
        ),
    ]
    lines += ["", *(f"{name:{width}}  {value:>18}  {target}" for name, value, target in latency_rows)]
    return "\n".join(lines)


async def proxy_view(url: str) -> dict:
    async with session(1) as http, http.get(f"{url}/v1/budget") as response:
        return next(u for u in (await response.json())["upstreams"] if u["name"] == "limited")


def run_scenario(scenario: Scenario, log_dir: Path, args: argparse.Namespace) -> dict:
    warmup = args.warmup if scenario.name == "bucket" else args.strict_warmup
    with processes(log_dir, args.queue_deadline_s, scenario) as urls:
        report = asyncio.run(saturate(urls, args.seconds, warmup, scenario.name))
        view = asyncio.run(proxy_view(urls["proxies"][0]))
    return {
        "scenario": scenario.about,
        "replicas": scenario.replicas,
        "provider": list(scenario.provider),
        "proxy_told": scenario.told,
        "prompt_ratio": view["prompt_ratio"],
        **report,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="measured saturation window")
    parser.add_argument("--warmup", type=float, default=10.0, help="saturation before measuring (bucket)")
    parser.add_argument(
        "--strict-warmup",
        type=float,
        default=60.0,
        help="saturation before measuring (strict, mismatch): the first minute",
    )
    parser.add_argument("--latency-seconds", type=float, default=30.0, help="per latency phase")
    parser.add_argument("--queue-deadline-s", type=float, default=5.0)
    parser.add_argument(
        "--scenarios",
        nargs="*",
        choices=list(SCENARIOS),
        default=["bucket", "strict"],
        help="saturation scenarios to run (none: the latency phase only)",
    )
    common_args(parser, "judge_proxy", seeds=None)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-judge-bench-"))
    # The machine may be shared: the load average beside each phase says what else ran.
    load = {"before": os.getloadavg()}
    with processes(log_dir, args.queue_deadline_s, SCENARIOS["bucket"]) as urls:
        latency_results = asyncio.run(latency(urls, args.latency_seconds))
    load["after_latency"] = os.getloadavg()
    saturation = {}
    for name in args.scenarios:
        saturation[name] = run_scenario(SCENARIOS[name], log_dir, args)
        load[f"after_{name}"] = os.getloadavg()
    results = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "cores_available": len(os.sched_getaffinity(0)),
            "load_average_1_5_15m": load,
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "settings": {
            **vars(args),
            "out": str(args.out),
            "max_tokens": MAX_TOKENS,
            "upstream_service_ms": 2,
            "logs": str(log_dir),
        },
        "saturation": saturation,
        "latency": latency_results,
    }
    targets = {
        "added p99 <= 5 ms": latency_results["proxy_added_ms"]["p99"] <= 5.0,
        "latency phase without errors": not any(latency_results["errors"].values()),
    }
    for name, run in saturation.items():
        floor = 0.95 if name == "bucket" else 0.90
        targets[f"{name}: utilization >= {floor:.2f}"] = run["utilization"] >= floor
        targets[f"{name}: upstream 429s after warm-up == 0"] = run["upstream_429"] == 0
        targets[f"{name}: lost == 0 and no errors"] = run["lost"] == 0 and not run["errors"]
    results["targets_met"] = targets
    print(
        f"\njudge proxy: 1 Redis, local upstream at {TPM} TPM / {RPM} RPM, "
        f"{results['machine']['cores_available']} cores available, 1-minute load average "
        + ", ".join(f"{k.removeprefix('after_')} {v[0]:.1f}" for k, v in load.items() if k != "before")
    )
    print(table(results))
    print(f"targets met: {results['targets_met']}")
    write_report("judge_proxy", results, args)


if __name__ == "__main__":
    main()
