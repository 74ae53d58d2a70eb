"""The alert rules that ship in deploy/alerts.yml: promtool accepts them, each fires on made-up
series of the fault it names (and not on a healthy job's), and every metric they read is
one a Tandem process exports, so no alert silently watches a name that does not exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "alerts.yml"
PRODUCT = ("learner", "rollout", "judge_proxy", "services")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("TANDEM_REQUIRE_PROMETHEUS"):
            pytest.fail("TANDEM_REQUIRE_PROMETHEUS is set but no promtool is on PATH")
        pytest.skip("promtool (Prometheus's checker) is not installed")
    return found


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_every_metric_an_alert_reads_is_one_tandem_exports():
    exported = set()
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            exported |= set(re.findall(r'"(tandem_[a-z_]+)"', path.read_text()))
    read = {name for rule in rules() for name in re.findall(r"\btandem_[a-z_]+", rule["expr"])}
    assert read, "the alerts read Tandem's metrics"
    assert read <= exported, read - exported


def test_the_alert_rules_pass_promtool():
    result = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# Each case: series (promtool's expanding notation, one sample a minute), when to look, and
# the alerts expected then (none: a healthy job's series must not fire). Labels are checked;
# the annotations' text is left out of the copy promtool tests.
CASES = {
    "paused": (
        {'tandem_learner_job_paused{job="j"}': "0 1x10", 'tandem_learner_seconds_since_progress{job="j"}': "0+60x10"},
        "4m",
        [{"alertname": "TandemJobPaused", "job": "j", "severity": "warning"}],
    ),
    "stalled": (
        {'tandem_learner_job_paused{job="j"}': "0x20", 'tandem_learner_seconds_since_progress{job="j"}': "0+60x20"},
        "13m",
        [{"alertname": "TandemJobStalled", "job": "j", "severity": "warning"}],
    ),
    "progressing": (
        {'tandem_learner_job_paused{job="j"}': "0x20", 'tandem_learner_seconds_since_progress{job="j"}': "5x20"},
        "13m",
        [],
    ),
    "upstream down": (
        {
            'tandem_judge_upstream_state{upstream="a"}': "0 2x10",
            'tandem_judge_model_available{model="judge"}': "1 0x10",
        },
        "3m",
        [
            {"alertname": "TandemJudgeModelUnavailable", "model": "judge", "severity": "critical"},
            {"alertname": "TandemJudgeUpstreamDown", "upstream": "a", "severity": "warning"},
        ],
    ),
    "dead letters": (
        {'tandem_queue_dead_letters{job="j"}': "0+3x20"},
        "10m",
        [{"alertname": "TandemDeadLetters", "job": "j", "severity": "warning"}],
    ),
    "crash loop": (
        {'process_start_time_seconds{process="learner",instance="l:8003"}': "100 160 220 280 340 400 400"},
        "6m",
        [{"alertname": "TandemCrashLoop", "process": "learner", "instance": "l:8003", "severity": "critical"}],
    ),
}
ALERT_NAMES = sorted({rule["alert"] for rule in rules()})


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_alert_fires_on_the_fault_it_names_and_not_on_a_healthy_job(tmp_path, case):
    series, at, expected = CASES[case]
    unannotated = [{k: v for k, v in rule.items() if k != "annotations"} for rule in rules()]
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump({"groups": [{"name": "tandem", "rules": unannotated}]}))
    checks = [
        {
            "eval_time": at,
            "alertname": name,
            "exp_alerts": [
                {"exp_labels": {k: v for k, v in alert.items() if k != "alertname"}}
                for alert in expected
                if alert["alertname"] == name
            ],
        }
        for name in ALERT_NAMES
    ]
    test = {
        "rule_files": ["alerts.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": name, "values": values} for name, values in series.items()],
                "alert_rule_test": checks,
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    result = subprocess.run([promtool(), "test", "rules", "test.yml"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
