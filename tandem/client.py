"""A small client of the job API, and `follow`: a job's progress as a progress bar."""

from __future__ import annotations

import builtins
import json
import time
from pathlib import Path

import httpx

from services.config import parse_job_spec
from services.jobs import TERMINAL
from tandem.progress import Progress

HISTORY_SHOWN = 200
"""Records `follow` holds: the progress bar's rates are over the last this many."""


class ApiError(RuntimeError):
    pass


class ApiClient:
    def __init__(self, base_url: str, token: str = "", timeout_s: float = 10.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)

    def _call(self, method: str, path: str, **kwargs):
        return self._request(method, path, **kwargs).json()

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ApiError(f"{method} {path}: {response.status_code} {response.text}")
        return response

    def submit(self, spec: dict) -> dict:
        return self._call("POST", "/v1/jobs", json=spec)

    def get(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")

    # This method hides the builtin `list` from the rest of the class: annotations there
    # spell it `builtins.list`.
    def list(self) -> builtins.list[dict]:
        return self._call("GET", "/v1/jobs")

    def history(self, job_id: str, start: int = 0) -> builtins.list[dict]:
        return self.history_page(job_id, start)[1]

    def history_page(self, job_id: str, start: int = 0) -> tuple[int, builtins.list[dict]]:
        """The records from index `start` of the job's history on, and the index of the first
        one returned (later than `start` when the API no longer keeps those)."""
        response = self._request("GET", f"/v1/jobs/{job_id}/history", params={"start": start})
        return int(response.headers.get("x-tandem-history-start", start)), response.json()

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def resume(self, job_id: str, budget: dict | None = None) -> dict:
        """Queue an ended job again; `budget` (`{usd, tokens}`) replaces its caps."""
        return self._call("POST", f"/v1/jobs/{job_id}/resume", json={"budget": budget} if budget else None)

    def checkpoints(self, job_id: str) -> builtins.list[dict]:
        return self._call("GET", f"/v1/jobs/{job_id}/checkpoints")

    def groups(self, job_id: str) -> builtins.list[dict]:
        """Every training group the job keeps as text (`protocol.GroupView`), newest first."""
        from services.queues import GROUPS_KEPT

        return self._call("GET", f"/v1/jobs/{job_id}/groups", params={"limit": GROUPS_KEPT})

    def datasets(self, job_id: str) -> builtins.list[dict]:
        return self._call("GET", f"/v1/jobs/{job_id}/datasets")

    def servers(self) -> builtins.list[dict]:
        return self._call("GET", "/v1/rollout-servers")

    def drain(self, server_id: str, lift: bool = False) -> dict:
        return self._call("DELETE" if lift else "POST", f"/v1/rollout-servers/{server_id}/drain")


def load_spec_file(path: str | Path) -> dict:
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        return yaml.safe_load(text)
    return json.loads(text)


def follow(client: ApiClient, job_id: str, poll_s: float = 0.5) -> dict:
    """Show a job's progress until it ends, printing each health alert as it fires;
    returns the final record."""
    record = client.get(job_id)
    total, unit = parse_job_spec(record["spec"]).progress()
    history: list[dict] = []
    cursor = 0
    with Progress(total, f"{job_id} {record['status'].lower()}", unit) as progress:
        while True:
            record = client.get(job_id)
            first, new = client.history_page(job_id, start=cursor)
            cursor = first + len(new)
            history = (history + new)[-HISTORY_SHOWN:]
            for message in (m for h in new for m in h.get("health", [])):
                progress.write(f"{job_id}: {message}")
            for evaluation in (h for h in new if h.get("phase") == "eval"):
                progress.write(f"{job_id}: {held_out_line(evaluation)}")
            steps = [h for h in history if h.get("phase") in ("rl", "offline", "generate")]
            phase = _phase(record, history)
            if record["status"] == "RUNNING" and steps and steps[-1]["step"] >= total and record["spec"].get("eval"):
                phase = "final held-out evaluation"
            progress.update(
                steps[-1]["step"] if steps else None,
                desc=f"{job_id} {phase}",
                postfix=_postfix(steps) | _held_out_postfix(record) | _cost_postfix(steps[-1]) if steps else None,
            )
            if record["status"] in TERMINAL:
                return record
            time.sleep(poll_s)


def _phase(record: dict, history: list[dict]) -> str:
    if record.get("warning"):
        return record["warning"]
    if record["status"] == "PAUSED":
        return f"paused: {record.get('paused_reason', '')}"
    if record["status"] != "RUNNING":
        return record["status"].lower()
    steps = [h for h in history if h.get("phase") != "eval"]  # an evaluation is no phase of training
    if steps and steps[-1].get("phase") == "sft":
        return f"warm start {steps[-1]['sft_step']}"
    return steps[-1]["phase"] if steps else "starting"


def held_out_line(record: dict) -> str:
    """One held-out evaluation's record as a line: success, the task's metrics, its size."""
    shown = [f"success {record.get('success', 0.0):.3f}"]
    shown += [f"{name} {record[name]:.3f}" for name in ("asked", "judge", "pass^2") if name in record]
    shown.append(f"{record.get('tokens', 0.0):.0f} tokens")
    incomplete = "" if record.get("complete", True) else ", incomplete"
    return f"held-out at step {record['step']}: {', '.join(shown)} ({record['episodes']} conversations{incomplete})"


def _cost_postfix(last: dict) -> dict[str, str]:
    """What the job's LLM calls cost so far, and at this rate by its end (when any did)."""
    if not last.get("cost_usd"):
        return {}
    return {"cost": f"${last['cost_usd']:.4g} of ~${last.get('cost_usd_projected', last['cost_usd']):.4g}"}


def _held_out_postfix(record: dict) -> dict[str, str]:
    held = record.get("held_out") or {}
    return {"held-out": f"{held['success']:.2f}@{held['step']}"} if "success" in held else {}


def _postfix(rl: list[dict]) -> dict[str, str]:
    last = rl[-1]
    if last["phase"] == "generate":
        return {
            "sft rows": str(last["sft_rows"]),
            "pairs": str(last["pairs"]),
            "success": f"{last.get('success', 0.0):.2f}",
        }
    if last["phase"] == "offline":
        return {
            "loss": f"{last['loss']:.3f}",
            "accuracy": f"{last['preference_accuracy']:.2f}",
            "margin": f"{last['reward_margin']:.2f}",
            "epoch": f"{last['epoch']:.1f}",
        }
    span = rl[-1]["time"] - rl[0]["time"]
    tokens = sum(h["trained_tokens"] for h in rl[1:])
    return {
        "reward": f"{last['reward_mean']:.2f}",
        "zero-spread": f"{last.get('zero_spread_share', 0.0):.2f}",
        "malformed": f"{1.0 - last.get('well_formed', 1.0):.2f}",
        "entropy": f"{last.get('entropy', 0.0):.2f}",
        "staleness": f"{last['staleness_mean']:.2f}",
        "tok/s": f"{tokens / span:.0f}" if span > 0 else "-",
    }
