"""Dashboards and Prometheus against the running system.

One `tandem up` stack (the judge proxy in front of the local OpenAI-compatible upstream)
trains a short job and serves some judge traffic. Then: every metric any Grafana dashboard
queries is exported by some process, and a real Prometheus (Debian's package) scraping the
stack on loopback sees every target up and has samples of the reward series.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from helpers import wait_for
from prometheus_client.parser import text_string_to_metric_families

from tandem.launcher import Ports, Stack
from tandem.redis_embed import free_port

pytestmark = pytest.mark.slow
DASHBOARDS = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards"
METRIC = re.compile(r"\b(tandem_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("observed")
    upstream_port = free_port()
    upstream = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "devtools.provider",
            "--port",
            str(upstream_port),
            "--model",
            "judge",
            "--tpm",
            "200000",
            "--rpm",
            "2000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    upstreams = tmp / "upstreams.yaml"
    upstreams.write_text(
        yaml.safe_dump(
            {
                "upstreams": [
                    {
                        "name": "local",
                        "model": "judge",
                        "base_url": f"http://127.0.0.1:{upstream_port}/v1",
                        "tpm": 200000,
                        "rpm": 2000,
                        "max_concurrency": 8,
                    }
                ]
            }
        )
    )
    env = {"TANDEM_UPSTREAMS": str(upstreams), "TANDEM_RUNS_DIR": str(tmp / "runs")}
    try:
        with Stack(tmp / "logs", ports=Ports.free(), extra_env=env) as running:
            running.job_id = run_a_job(running.api_url, tiny_model)
            for _ in range(5):
                reply = httpx.post(
                    f"{running.judge_url}/v1/chat/completions",
                    timeout=30,
                    json={"model": "judge", "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]},
                )
                assert reply.status_code == 200, reply.text
            yield running
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)


def run_a_job(api_url: str, model: Path) -> str:
    spec = {
        "name": "observed",
        "model": {"path": str(model), "max_model_len": 512},
        "rollout": {"group_size": 4, "max_new_tokens": 8, "max_turns": 2, "max_total_tokens": 128},
        "train": {"num_steps": 3, "batch_size": 2, "lr": 1e-4},
    }
    api = httpx.Client(base_url=api_url, timeout=10)
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    status = wait_for(
        lambda: (s := api.get(f"/v1/jobs/{job_id}").json()["status"]) in ("SUCCEEDED", "FAILED", "CANCELLED") and s,
        240,
        "the job to end",
    )
    assert status == "SUCCEEDED"
    return job_id


# The sample names a metric type exports, for a family declared but not yet observed (a
# labelled metric has no series until its first label set; rejections need not happen here).
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum"),
}


def exported_names(stack: Stack) -> set[str]:
    """Sample names each process exports. A family with samples counts by the samples it has
    (a histogram with a negative bucket has no _sum, and a dashboard must not rely on one)."""
    names = set()
    for url in stack.health_urls().values():
        text = httpx.get(url.replace("/healthz", "/metrics"), timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.samples:
                names |= {sample.name for sample in family.samples}
            else:
                names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def dashboard_metrics() -> dict[str, set[str]]:
    """Metric names in the PromQL expressions of each dashboard."""
    found = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        expressions = re.findall(r'"expr"\s*:\s*"((?:[^"\\]|\\.)*)"', path.read_text())
        found[path.name] = {name for expr in expressions for name in METRIC.findall(expr)}
    return found


def test_every_metric_a_dashboard_queries_is_exported(stack):
    dashboards = dashboard_metrics()
    assert set(dashboards) >= {"training.json", "rollout.json", "judge.json", "queues.json"}
    exported = exported_names(stack)
    missing = {name: sorted(m - exported) for name, m in dashboards.items() if m - exported}
    assert not missing, f"dashboards query metrics no process exports: {missing}"
    assert all(dashboards.values()), "a dashboard without any Tandem metric"


def prometheus_binary() -> str | None:
    found = shutil.which("prometheus")
    if found is None and os.environ.get("TANDEM_REQUIRE_PROMETHEUS"):
        pytest.fail("TANDEM_REQUIRE_PROMETHEUS is set but no prometheus binary is on PATH")
    return found


def test_prometheus_scrapes_every_process_and_records_the_reward(stack, tmp_path):
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("Debian's prometheus is not installed (.ci/run installs it)")
    targets = {
        "api": stack.ports.api,
        "judge-proxy": stack.ports.judge_proxy,
        "rollout": stack.ports.rollout[0],
        "learner": stack.ports.learner,
    }
    # honor_labels: Tandem's `job` label (the training job's id) is kept, not renamed to
    # exported_job; the scrape job name survives on series without one.
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": name, "honor_labels": True, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for name, port in targets.items()
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    server = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api/v1"
    try:

        def all_up():
            try:
                reply = httpx.get(f"{api}/targets", timeout=5)
            except httpx.HTTPError:
                return False
            if reply.status_code != 200:  # 503 "Service Unavailable" while Prometheus starts
                return False
            active = reply.json()["data"]["activeTargets"]
            return len(active) == 4 and all(t["health"] == "up" for t in active) and active

        active = wait_for(all_up, 60, "every target to be up")
        reward = wait_for(
            lambda: httpx.get(f"{api}/query", params={"query": "tandem_learner_reward_mean"}, timeout=5).json()["data"][
                "result"
            ],
            30,
            "reward samples",
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert {t["labels"]["job"] for t in active} == set(targets)
    assert reward[0]["metric"]["job"] == stack.job_id
    assert reward[0]["metric"]["instance"] == f"127.0.0.1:{stack.ports.learner}"
    assert 0.0 <= float(reward[0]["value"][1]) <= 1.0


def sample_values(url: str, name: str) -> dict[tuple, float]:
    """Every sample of metric `name` at `url`, by its label values."""
    text = httpx.get(url, timeout=10).text
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_who_waits_is_exported_learner_idle_engine_busy_judge_budget_used(stack):
    """The three figures a user tuning max_staleness reads, from the running processes: the
    learner's idle share, the rollout engine's busy share (and its busy seconds), and the
    judge budget's use, here after the five judge calls above."""
    job = (("job", stack.job_id),)
    learner = f"http://127.0.0.1:{stack.ports.learner}/metrics"
    rollout = f"http://127.0.0.1:{stack.ports.rollout[0]}/metrics"
    idle = sample_values(learner, "tandem_learner_idle_ratio")[job]
    assert 0.0 < idle < 1.0
    busy_s = sample_values(rollout, "tandem_rollout_engine_busy_seconds_total")[job]
    assert busy_s > 0.0
    assert 0.0 < sample_values(rollout, "tandem_rollout_engine_busy_ratio")[job] <= 1.0
    used = wait_for(
        lambda: sample_values(f"{stack.judge_url}/metrics", "tandem_judge_budget_utilization").get(
            (("upstream", "local"),)
        ),
        30,
        "the budget utilization gauge to see the calls",
    )
    assert 0.0 < used < 0.01  # five short calls against 200,000 tokens a minute


def test_each_step_records_its_wait_idle_share_and_staleness(stack):
    history = httpx.get(f"{stack.api_url}/v1/jobs/{stack.job_id}/history", timeout=10).json()
    rl = [h for h in history if h.get("phase") == "rl"]
    assert len(rl) == 3
    for record in rl:
        assert sum(record["staleness_counts"].values()) == record["groups"]
        assert 0.0 <= record["batch_wait_seconds"] <= record["rl_seconds"]
        assert 0.0 < record["idle_ratio"] < 1.0
    assert [r["rl_seconds"] for r in rl] == sorted(r["rl_seconds"] for r in rl)
