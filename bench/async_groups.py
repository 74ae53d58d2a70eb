"""Which groups an asynchronous run trains, which it drops, and what lateness has to do with content.

Reads the learner's per-group records (`runs/<job>/groups.jsonl`, `learner.group_log`) of
one or more jobs and compares: groups dropped as over-stale against groups trained (how long
their rollouts took, the share of first turns that ask, their reward), and among trained
groups the late ones (trained at staleness >= 1) against the fresh ones. Run on its own:

    python -m bench.async_groups runs/<job>/groups.jsonl [more ...] [--plot out.png]

Files of jobs named alike but for their seed (`async-eta2-seed3-<id>`) are pooled.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from bench.harness import pyplot
from bench.judge_bound import fmt
from learner.group_log import read


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def describe(records: list[dict]) -> dict:
    """Count, mean rollout seconds, asked share (over groups whose samples say), mean
    reward and mean success of `records`."""
    asked = [r["metrics"]["asked"] for r in records if "asked" in r["metrics"]]
    success = [r["metrics"]["success"] for r in records if "success" in r["metrics"]]
    return {
        "groups": len(records),
        "elapsed_s": mean([r["elapsed_s"] for r in records]),
        "asked": mean(asked),
        "asked_groups": len(asked),
        "reward": mean([r["reward_mean"] for r in records]),
        "success": mean(success),
    }


def summarize(records: list[dict]) -> dict:
    """Dropped against trained, late against fresh, and asked share by rollout-time quartile."""
    trained = [r for r in records if r["decision"] == "trained"]
    ordered = sorted(records, key=lambda r: r["elapsed_s"])
    quartiles = [ordered[i * len(ordered) // 4 : (i + 1) * len(ordered) // 4] for i in range(4)]
    return {
        "decisions": {d: sum(r["decision"] == d for r in records) for d in sorted({r["decision"] for r in records})},
        "trained": describe(trained),
        "dropped": describe([r for r in records if r["decision"] == "stale"]),
        "trained_fresh": describe([r for r in trained if r["staleness"] == 0]),
        "trained_late": describe([r for r in trained if (r["staleness"] or 0) >= 1]),
        "by_rollout_quartile": [describe(q) | {"elapsed_max_s": q[-1]["elapsed_s"] if q else None} for q in quartiles],
    }


def print_summary(label: str, summary: dict) -> None:
    print(f"\n{label}: {summary['decisions']}")
    print(f"{'groups':>22} {'n':>5} {'rollout s':>10} {'asked':>6} {'reward':>7} {'success':>8}")
    rows = [
        ("trained", summary["trained"]),
        ("dropped as stale", summary["dropped"]),
        ("trained fresh (0)", summary["trained_fresh"]),
        ("trained late (>=1)", summary["trained_late"]),
    ]
    rows += [(f"rollout quartile {i + 1}", q) for i, q in enumerate(summary["by_rollout_quartile"])]
    for name, d in rows:
        print(
            f"{name:>22} {d['groups']:>5} {fmt(d['elapsed_s'], '10.1f')} {fmt(d['asked'], '6.2f')} "
            f"{fmt(d['reward'], '7.3f')} {fmt(d['success'], '8.3f')}"
        )


def by_tenth(records: list[dict], value) -> list[tuple[float, float]]:
    """(mean rollout seconds, mean value) of each tenth of `records` ordered by rollout time."""
    ordered = sorted(records, key=lambda r: r["elapsed_s"])
    tenths = [ordered[i * len(ordered) // 10 : (i + 1) * len(ordered) // 10] for i in range(10)]
    return [(statistics.fmean(r["elapsed_s"] for r in t), statistics.fmean(value(r) for r in t)) for t in tenths if t]


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Per run (one colour each): rollout time of trained and dropped groups, and the group
    reward and the asked share of groups by rollout time."""
    plt = pyplot()
    fig, (times_ax, reward_ax, asked_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    bins = [i * 1.5 for i in range(17)]
    for colour, (label, records) in enumerate(runs.items()):
        for decision, style in (("trained", "-"), ("stale", ":")):
            times = [min(r["elapsed_s"], 24.0) for r in records if r["decision"] == decision]
            if times:
                times_ax.hist(
                    times,
                    bins=bins,
                    histtype="step",
                    ls=style,
                    lw=1.6,
                    color=f"C{colour}",
                    label=f"{label}: {'dropped as stale' if decision == 'stale' else decision}",
                )
        reward_ax.plot(
            *zip(*by_tenth(records, lambda r: r["reward_mean"])), marker="o", lw=1.2, color=f"C{colour}", label=label
        )
        first_turn = [r for r in records if "asked" in r["metrics"]]
        if first_turn:
            asked_ax.plot(
                *zip(*by_tenth(first_turn, lambda r: r["metrics"]["asked"])),
                marker="o",
                lw=1.2,
                color=f"C{colour}",
                label=label,
            )
    times_ax.set_xlabel("group rollout time (s, capped at 24)")
    times_ax.set_ylabel("groups")
    reward_ax.set_ylabel("mean reward of the group")
    asked_ax.set_ylabel("share of first-turn responses that ask")
    for ax in (reward_ax, asked_ax):
        ax.set_xlabel("group rollout time (s), mean of each tenth of the groups")
    for ax in (times_ax, reward_ax, asked_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Which groups come back late, and what they hold")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="groups.jsonl files (one per job)")
    parser.add_argument("--plot", type=Path, help="write the picture here")
    parser.add_argument("--json", type=Path, help="write the summaries here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {}
    for path in args.files:  # a job folder is <name>-<id>; seeds of one setting pool (async-eta2-seed3-...)
        label = re.sub(r"(-seed\d+)?-[0-9a-f]{8}$", "", path.parent.name)
        runs.setdefault(label, []).extend(read(path))
    summaries = {label: summarize(records) for label, records in runs.items()}
    for label, summary in summaries.items():
        print_summary(label, summary)
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
