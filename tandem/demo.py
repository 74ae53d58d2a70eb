"""`tandem demo`: the whole system on one machine, on the built-in clarify task.

Builds the tiny model and the warm-start dialogues, starts every process, submits
`deploy/configs/demo.yaml` through the REST API, follows it, and writes
`<out>/<job>/summary.json` and `<out>/<job>/reward_curve.png`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.client import ApiClient, follow, load_spec_file
from tandem.launcher import Ports, Stack
from tandem.placement import Placement, this_machine

REPO = Path(__file__).resolve().parent.parent
DEMO_SPEC = REPO / "deploy" / "configs" / "demo.yaml"


def write_demonstrations(path: Path, task: str = "clarify", num: int = 2000, share: float = 0.3, seed: int = 1) -> int:
    """A task's own demonstrations as warm-start data (`rollout.tasks.demonstrations`).
    Returns the number of rows."""
    from rollout.tasks import demonstrations

    rows = demonstrations(task, num, share, seed)
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def prepare(out: Path, spec: dict, seen_as: str | None = None) -> dict:
    """Tiny model + warm-start data under `out`; returns the spec pointing at them, by the
    path the processes see `out` at (`seen_as`, e.g. a container's mount; default: `out`)."""
    from devtools.tiny_model import make_tiny_model
    from rollout.tasks import clarify

    model_dir = out / "tiny-model"
    if not (model_dir / "model.safetensors").exists():
        make_tiny_model(model_dir, clarify.corpus())
    data = out / "warm_start.jsonl"
    write_demonstrations(data, share=spec["task"]["ask_share"])
    base = seen_as.rstrip("/") if seen_as else str(out.resolve())
    spec["model"]["path"] = f"{base}/{model_dir.name}"
    spec["warm_start"]["data"] = f"{base}/{data.name}"
    return spec


def write_demo_files(out: Path, seen_as: str | None = None, steps: int | None = None) -> Path:
    """The demo job for a stack started some other way (`docker compose up`): the model, the
    warm-start data and the spec, `out/demo.yaml`, naming them as that stack sees `out`."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    spec = prepare(out, load_spec_file(DEMO_SPEC), seen_as)
    if steps:
        spec["train"]["num_steps"] = steps
    path = out / "demo.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_demo(out: Path, steps: int | None = None, placement: Placement | None = None) -> dict:
    """The demo job on a stack placed by `placement` (default: the plan for this machine)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = prepare(out, load_spec_file(DEMO_SPEC))
    if steps:
        spec["train"]["num_steps"] = steps
    placement = placement or this_machine()
    with Stack(out / "logs", ports=Ports.free(), placement=placement, extra_env={"TANDEM_RUNS_DIR": str(out)}) as stack:
        client = ApiClient(stack.api_url)
        job_id = client.submit(spec)["id"]
        print(f"submitted {job_id}; logs in {out / 'logs'}; its page: {stack.api_url}/jobs/{job_id}")
        record = follow(client, job_id)
        history = client.history(job_id)
    summary = summarize(record, history)
    job_dir = out / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_rewards(history, job_dir / "reward_curve.png")
    print(json.dumps(summary, indent=2))
    print(f"wrote {job_dir / 'summary.json'} and {job_dir / 'reward_curve.png'}")
    return summary


def summarize(record: dict, history: list[dict]) -> dict:
    """The figures that show the run learned, stayed on-policy enough, and kept its books."""
    rl = [h for h in history if h.get("phase") == "rl"]
    window = min(10, len(rl) // 2) or 1
    mean = lambda rows, key: sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1)  # noqa: E731
    last = rl[-1] if rl else {}
    eta = record["spec"]["train"]["max_staleness"]
    return {
        "job_id": record["id"],
        "status": record["status"],
        "error": record.get("error"),
        "rl_steps": len(rl),
        "wall_seconds": (record.get("finished") or 0) - (record.get("started") or 0),
        "reward_first10": mean(rl[:window], "reward_mean"),
        "reward_last10": mean(rl[-window:], "reward_mean"),
        "reward_gain": mean(rl[-window:], "reward_mean") - mean(rl[:window], "reward_mean"),
        "success_first10": mean(rl[:window], "success"),
        "success_last10": mean(rl[-window:], "success"),
        "asked_first10": mean(rl[:window], "asked"),
        "asked_last10": mean(rl[-window:], "asked"),
        "weight_updates": last.get("weight_updates", 0),
        "weight_updates_per_step": (last.get("weight_updates", 1) - 1) / max(len(rl), 1),
        "unversioned_trained_tokens": sum(r["unversioned_tokens"] for r in rl),
        "max_staleness": eta,
        "max_staleness_trained": max((r["staleness_max"] for r in rl), default=0),
        "over_stale_groups_trained": sum(1 for r in rl if r["staleness_max"] > eta),
        "stale_groups_dropped": last.get("stale_dropped", 0),
        "duplicate_groups_skipped": last.get("duplicates", 0),
        "trained_tokens": sum(r["trained_tokens"] for r in rl),
        # What its LLM calls cost (the judge proxy's bill; the demo's user and reward are
        # rule-based, so none): in all and per step.
        "cost_usd": last.get("cost_usd", 0.0),
        "cost_usd_per_step": mean(rl, "cost_usd_step"),
        **held_out_summary(history),
    }


def held_out_summary(history: list[dict]) -> dict:
    """The held-out curve (step -> success) and what evaluating cost: its share of the
    rollout servers' task time and of the judge and simulator tokens, job so far."""
    rounds = [h for h in history if h.get("phase") == "eval"]
    if not rounds:
        return {}
    last = rounds[-1]
    return {
        "held_out_first": rounds[0]["success"],
        "held_out_final": last["success"],
        "held_out_curve": {str(r["step"]): round(r["success"], 4) for r in rounds},
        "held_out_conversations": last["episodes"],
        "eval_share_rollout_seconds": last.get("eval_share_rollout_seconds", 0.0),
        "eval_share_llm_tokens": last.get("eval_share_llm_tokens", 0.0),
    }


def plot_rewards(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl = [h for h in history if h.get("phase") == "rl"]
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rl]
    ax.plot(steps, [r["reward_mean"] for r in rl], label="mean reward (training)", marker=".")
    if rl and "asked" in rl[0]:
        ax.plot(steps, [r.get("asked", 0) for r in rl], label="share of first turns that ask", alpha=0.7)
    rounds = [h for h in history if h.get("phase") == "eval"]
    if rounds:
        ax.plot(
            [r["step"] for r in rounds],
            [r["success"] for r in rounds],
            label=f"held-out success ({rounds[-1]['episodes']} conversations)",
            marker="o",
            color="black",
        )
    ax.set_xlabel("learner step (= policy version)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Tandem demo: clarify task, asynchronous GRPO")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
