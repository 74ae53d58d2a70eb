"""Judge-bound CollabLLM training: synchronous vs asynchronous, end to end.

The clarify task with the multiturn-aware reward where every LLM call is real HTTP through
the judge proxy: the user simulator plays the user in each forward-sampled future, and the
judge scores each future on the interactivity rubric (R* = success - token penalty
+ 0.5 * interactivity). The provider is the repo's stand-in (`devtools.provider`
with its latency model: lognormal time to first token, median 0.6 s, p99 5 s, then 80
tokens/s), with one TPM/RPM budget for the simulator and the judge together.

One warm start, then the same job and steps under each setting (`--settings`): `max_staleness`
0 (synchronous RL, same code), 1, 2 and 4, pause mode abort or keep, and what the learner does
about slow groups (`train.stragglers`: drop them when over-stale, wait for them, or admit them
late with the behaviour correction, `eta2-admit4` masking the tokens over 4 versions old).
Per seed (`--seeds`), the settings run one after another on one running system (alternating, so a slow
patch of the machine does not fall on one setting); the stand-in and the proxy's shared
budget start full for each run.

Quality is measured the way the speed claim is made: every run exports its policy every
`--export-every` steps, and after all runs each exported policy is evaluated on the same
held-out conversations (rule-based user, the same answers the simulator gives), so the
evaluation takes none of the runs' cores. Reported per run: the held-out curve against wall
time, the wall time at which it first reaches the held-out target (sync's final held-out
success on that seed less `--heldout-slack`, about one standard error), final held-out
success (on `--eval-final` conversations), wall time (from the first weight publish) to a
target training reward (a moving average over `--window` steps) and to the end, learner idle
ratio, rollout engine busy ratio, judge budget use (tokens per minute over the TPM, as the
dashboards show it; the provider's bucket starts full, so a short run may pass 1), upstream
429s, groups dropped as over-stale, staleness histogram, mismatch KL, the CPU seconds of
every process, what it trained against what it finished (`learner.mix`: mean length, asked
share, provider tokens thrown away and per trained sample), and what the learner's group
records say (`bench/async_groups.py`: asked share, rollout time and reward of dropped
against trained groups, late against fresh).
Per setting: min / mean / max over the seeds.

Run: python -m bench.async_speedup [--seeds 0,1,2,3,4] [--settings sync,eta2,eta2-wait] [--steps 40] [--lr 2.5e-4]
     [--warm-policy DIR] [--add]   (--add: keep the runs already in --out, run the missing settings)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

from bench import async_groups
from bench.harness import common_args, moving_average, out_folder, pyplot, rig, spread, write_report
from bench.judge_bound import (
    FIRST_LR,
    base_spec,
    evaluate_once,
    first_reaching,
    fmt,
    fmt_spread,
    ratio,
    reached,
    run_judged,
    warm_start,
)
from learner import group_log

SETTINGS = (  # label, max_staleness, pause mode, stragglers, max_token_staleness (train.*)
    ("sync", 0, "abort", "drop", None),
    ("eta1", 1, "abort", "drop", None),
    ("eta2", 2, "abort", "drop", None),
    ("eta2-wait", 2, "abort", "wait", None),
    ("eta2-admit", 2, "abort", "admit", None),
    ("eta2-admit4", 2, "abort", "admit", 4),
    ("eta2-keep", 2, "keep", "drop", None),
    ("eta4", 4, "abort", "drop", None),
    ("eta4-wait", 4, "abort", "wait", None),
)
MIX_FIGURES = (
    "stale_masked_tokens",
    "trained_vs_generated_length_ratio",
    "asked_share_trained",
    "asked_share_generated",
    "wasted_llm_tokens",
    "llm_tokens_per_trained_sample",
)
"""What a run trained against what it finished, as its last step record says (learner.mix)."""
COST_FIGURES = ("cost_usd", "cost_usd_per_step", "cost_usd_per_sample")


def train(out: Path, args: argparse.Namespace) -> tuple[Path, dict[str, dict[int, dict]]]:
    """The warm start, then per seed one run per setting (settings alternate, so a slow
    patch of the machine does not fall on one setting); returns the warm policy and the
    runs (label -> seed -> run)."""
    base = base_spec(out, args.steps, args.lr)
    base["train"]["export_every"] = args.export_every
    if args.job_eval:  # held-out rounds inside each job, to measure what they take from it
        base["eval"] = {"every": args.job_eval, "examples": args.job_eval_examples}
    runs = kept_runs(out, args)
    env = {"TANDEM_MAX_CONCURRENT_TASKS": str(args.max_tasks)}
    with rig(out, stand_in=(args.tpm, args.rpm, args.seeds[0]), env=env) as system:
        policy = Path(args.warm_policy) if args.warm_policy else warm_start(system, base)
        for seed in args.seeds:
            for setting in (s for s in SETTINGS if s[0] in args.settings):
                label, eta, pause, stragglers, _ = setting
                if seed in runs.get(label, {}):
                    continue
                print(f"\n{label}, seed {seed}")
                runs.setdefault(label, {})[seed] = run_judged(system, setting_spec(base, policy, seed, setting)) | {
                    "max_staleness": eta,
                    "pause_mode": pause,
                    "stragglers": stragglers,
                    "lr": args.lr,
                }
                (out / "training.json").write_text(json.dumps(runs))
    return policy, runs


def setting_spec(base: dict, policy: Path, seed: int, setting: tuple) -> dict:
    """`base` from the warm policy under one of `SETTINGS`, for one seed."""
    label, eta, pause, stragglers, token_bound = setting
    spec = copy.deepcopy(base) | {"name": f"async-{label}-seed{seed}"}
    spec["model"]["path"] = str(policy)
    spec["warm_start"] = {"steps": 0}
    spec["train"] |= {"max_staleness": eta, "seed": seed, "stragglers": stragglers}
    if token_bound is not None:
        spec["train"]["max_token_staleness"] = token_bound
    spec["rollout"]["pause_mode"] = pause
    return spec


def kept_runs(out: Path, args: argparse.Namespace) -> dict[str, dict[int, dict]]:
    """With `--add`, the runs an earlier invocation made in `out` (label -> seed -> run);
    they must have the steps and step size of this one, or the settings would not compare."""
    path = out / "training.json"
    if not (args.add and path.exists()):
        return {}
    runs = {
        label: {int(seed): run for seed, run in by_seed.items()}
        for label, by_seed in json.loads(path.read_text()).items()
    }
    for label, by_seed in runs.items():
        for seed, run in by_seed.items():
            steps, lr = len(run["history"]), run.get("lr", FIRST_LR)
            if (steps, lr) != (args.steps, args.lr):
                raise SystemExit(
                    f"--add: {label} seed {seed} in {path} ran {steps} steps at lr {lr:g}; "
                    f"run again with --steps {steps} --lr {lr:g}"
                )
    return runs


def dropped_share(history: list[dict]) -> float:
    """Groups refused as stale over all groups decided (trained or refused) in the run."""
    dropped = history[-1].get("stale_dropped", 0)
    return dropped / (dropped + sum(h["groups"] for h in history))


def asked_gap_max(history: list[dict]) -> float | None:
    """The largest gap, over the run's steps, between the asked share of the groups trained
    so far and that of all groups finished so far (learner.mix); None without the figures."""
    gaps = [
        abs(h["asked_share_trained"] - h["asked_share_generated"])
        for h in history
        if h.get("asked_share_trained") is not None and h.get("asked_share_generated") is not None
    ]
    return max(gaps) if gaps else None


def plateau(curve: list[dict], steps: int) -> float:
    """Mean held-out success of the evaluations in the second half of the run."""
    late = [point["success"] for point in curve if point["step"] >= steps / 2]
    return sum(late) / len(late)


def summarize(run: dict, target: float, window: int, tpm: int) -> dict:
    """The figures of one run, from its step records and the provider's counters."""
    history = run["history"]
    seconds = [h["rl_seconds"] for h in history]
    average = moving_average([h["reward_mean"] for h in history], window)
    at = reached(average, window, target)
    wall = seconds[-1]
    staleness: dict[str, int] = {}
    for h in history:
        for value, count in h["staleness_counts"].items():
            staleness[value] = staleness.get(value, 0) + count
    return {
        "max_staleness": run["max_staleness"],
        "pause_mode": run["pause_mode"],
        "stragglers": run["stragglers"],
        "job_id": run["job_id"],
        "steps": len(history),
        "wall_s": wall,
        "steps_per_min": len(history) / wall * 60,
        "target_step": None if at is None else at + 1,
        "to_target_s": None if at is None else seconds[at],
        "final_reward_ma": average[-1],
        "learner_idle_ratio": history[-1]["idle_ratio"],
        "engine_busy_ratio": run["engine_busy_s"] / wall,
        "budget_use": run["provider"]["tokens_accepted"] / (tpm * wall / 60),
        "provider_calls": run["provider"]["accepted"],
        "upstream_429": run["provider"]["rejected_429"],
        "stale_dropped": history[-1].get("stale_dropped", 0),
        "dropped_share": dropped_share(history),
        "asked_gap_max": asked_gap_max(history),
        **{key: history[-1][key] for key in MIX_FIGURES if key in history[-1]},
        "cpu_s": run["cpu_s"],
        "provider_latency_mean_s": run["provider"]["latency_s_total"] / max(run["provider"]["accepted"], 1),
        "staleness_histogram": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "mismatch_kl_mean": sum(h.get("mismatch_kl", 0.0) for h in history) / len(history),
        **run_cost(run),
        "curve": {"seconds": seconds, "reward_ma": average, "reward": [h["reward_mean"] for h in history]},
    }


def run_cost(run: dict) -> dict:
    """What the run's LLM calls cost at the stand-in's `EXAMPLE_PRICES`, as the proxy charged its job: in
    all, per step and per trained sample, and by role (none for runs kept from before)."""
    spend, history = run.get("spend") or {}, run["history"]
    if "usd" not in spend:
        return {}
    samples = sum(h["samples"] for h in history)
    return {
        "cost_usd": spend["usd"],
        "cost_usd_per_step": spend["usd"] / len(history),
        "cost_usd_per_sample": spend["usd"] / max(samples, 1),
        "cost_usd_by_role": {role: part["usd"] for role, part in spend["by_role"].items()},
        "cost_cached_share": spend["cached"] / max(spend["tokens"], 1),
    }


def held_out_curve(run: dict, held_out: dict, label: str, seed: int) -> list[dict]:
    """Held-out success at each exported step: [{step, seconds, success, asked}], step 0
    being the warm start (at 0 s)."""
    seconds = run["curve"]["seconds"]
    points = [{"step": 0, "seconds": 0.0} | held_out[("warm start", 0, 0)]]
    for (key_label, key_seed, step), result in sorted(held_out.items(), key=lambda kv: kv[0][2]):
        if key_label == label and key_seed == seed and step > 0:
            points.append({"step": step, "seconds": seconds[step - 1]} | result)
    return points


def make_report(
    args: argparse.Namespace, out: Path, runs: dict[str, dict[int, dict]], held_out: dict, total_s: float
) -> dict:
    """Per run: its figures, its held-out curve and its groups; per setting: the spread over
    seeds. The held-out target of a seed is sync's final held-out success on that seed less
    `--heldout-slack` (about one standard error of the evaluation)."""
    rows: dict[str, dict[int, dict]] = {}
    for label, by_seed in runs.items():
        for seed, run in by_seed.items():
            row = summarize(run, args.target, args.window, args.tpm)
            row["held_out_curve"] = held_out_curve(row, held_out, label, seed)
            row["held_out"] = row["held_out_curve"][-1]
            row["held_out_plateau"] = plateau(row["held_out_curve"], row["steps"])
            groups_file = out / "runs" / run["job_id"] / "groups.jsonl"
            row["groups"] = async_groups.summarize(group_log.read(groups_file)) if groups_file.exists() else None
            last_round = (run.get("job_eval") or [{}])[-1]  # its shares are the job's, so far
            for share in ("eval_share_rollout_seconds", "eval_share_llm_tokens"):
                row[f"job_{share}"] = last_round.get(share)
            rows.setdefault(label, {})[seed] = row
    sync_label = SETTINGS[0][0]
    for by_seed in rows.values():
        for seed, row in by_seed.items():
            sync = rows[sync_label][seed]
            heldout_target = sync["held_out"]["success"] - args.heldout_slack
            row["heldout_target"] = heldout_target
            row["to_heldout_target_s"] = first_reaching(row["held_out_curve"], heldout_target)
            sync_time = first_reaching(sync["held_out_curve"], heldout_target)
            row["speedup_to_heldout_target"] = ratio(sync_time, row["to_heldout_target_s"])
            row["speedup_to_target"] = ratio(sync["to_target_s"], row["to_target_s"])
            row["speedup_to_end"] = sync["wall_s"] / row["wall_s"]
            row["held_out_vs_sync"] = row["held_out"]["success"] - sync["held_out"]["success"]
            row["plateau_vs_sync"] = row["held_out_plateau"] - sync["held_out_plateau"]
            row["llm_tokens_per_sample_vs_sync"] = ratio(
                row.get("llm_tokens_per_trained_sample"), sync.get("llm_tokens_per_trained_sample")
            )
    settings = {}
    for label, by_seed in rows.items():
        pick = lambda key: spread([row[key] for row in by_seed.values()])  # noqa: E731
        sync_times = [rows[sync_label][seed]["to_heldout_target_s"] for seed in by_seed]
        times = [row["to_heldout_target_s"] for row in by_seed.values()]
        settings[label] = {
            "seeds": sorted(by_seed),
            "held_out": spread([row["held_out"]["success"] for row in by_seed.values()]),
            "asked": spread([row["held_out"].get("asked") for row in by_seed.values()]),
            "held_out_vs_sync": pick("held_out_vs_sync"),
            "to_heldout_target_s": pick("to_heldout_target_s"),
            "speedup_to_heldout_target": pick("speedup_to_heldout_target"),
            "speedup_to_heldout_target_of_means": (
                sum(sync_times) / sum(times) if None not in sync_times + times else None
            ),
            "wall_s": pick("wall_s"),
            "speedup_to_end": pick("speedup_to_end"),
            "to_target_s": pick("to_target_s"),
            "speedup_to_target": pick("speedup_to_target"),
            "held_out_plateau": pick("held_out_plateau"),
            "plateau_vs_sync": pick("plateau_vs_sync"),
            "stale_dropped": pick("stale_dropped"),
            "dropped_share": pick("dropped_share"),
            "asked_gap_max": pick("asked_gap_max"),
            "llm_tokens_per_sample_vs_sync": pick("llm_tokens_per_sample_vs_sync"),
            "mismatch_kl_mean": pick("mismatch_kl_mean"),
            "learner_idle_ratio": pick("learner_idle_ratio"),
            "budget_use": pick("budget_use"),
            "job_eval_share_rollout_seconds": pick("job_eval_share_rollout_seconds"),
            "job_eval_share_llm_tokens": pick("job_eval_share_llm_tokens"),
            "cost_usd_per_step": spread(
                [row.get("cost_usd_per_step") for row in by_seed.values()]
            ),  # none in runs kept from before
            "cost_usd_per_sample": spread(
                [row.get("cost_usd_per_sample") for row in by_seed.values()]
            ),  # none in runs kept from before
            **{key: spread([row.get(key) for row in by_seed.values()]) for key in MIX_FIGURES},
            **{key: spread([row.get(key) for row in by_seed.values()]) for key in COST_FIGURES},  # not in old runs
        }
    return {
        "steps": args.steps,
        "lr": args.lr,
        "seeds": args.seeds,
        "target_reward": args.target,
        "window": args.window,
        "heldout_slack": args.heldout_slack,
        "export_every": args.export_every,
        "tpm": args.tpm,
        "rpm": args.rpm,
        "max_concurrent_tasks": args.max_tasks,
        "eval_conversations": args.eval,
        "eval_final_conversations": args.eval_final,
        "cpu_cores": os.cpu_count(),
        "total_seconds": total_s,
        "held_out_warm_start": held_out[("warm start", 0, 0)],
        "settings": settings,
        "runs": rows,
    }


def print_report(report: dict) -> None:
    print(
        f"\njudge-bound clarify, {report['steps']} RL steps per run at lr {report['lr']:g}, seeds {report['seeds']}, "
        f"held-out every {report['export_every']} steps ({report['eval_conversations']} conversations; the final "
        f"policy {report['eval_final_conversations']}), "
        f"TPM {report['tpm']}, {report['cpu_cores']} CPU cores, {report['total_seconds'] / 60:.1f} min in all"
    )
    print(
        f"warm start held-out success {report['held_out_warm_start']['success']:.3f}; held-out target per seed: "
        f"sync's final less {report['heldout_slack']}. Each cell: min / mean / max over seeds."
    )
    columns = (
        ("final held-out", "held_out", ".3f", ""),
        ("vs sync", "held_out_vs_sync", "+.3f", ""),
        ("held-out plateau", "held_out_plateau", ".3f", ""),
        ("plateau vs sync", "plateau_vs_sync", "+.3f", ""),
        ("to held-out target", "to_heldout_target_s", ".0f", " s"),
        ("speedup to it", "speedup_to_heldout_target", ".2f", "x"),
        ("to end", "wall_s", ".0f", " s"),
        ("speedup to end", "speedup_to_end", ".2f", "x"),
        ("dropped", "stale_dropped", ".0f", ""),
        ("dropped share", "dropped_share", ".3f", ""),
        ("mismatch KL", "mismatch_kl_mean", ".1e", ""),
        ("tokens masked", "stale_masked_tokens", ".0f", ""),
        ("length trained/all", "trained_vs_generated_length_ratio", ".3f", ""),
        ("asked: trained", "asked_share_trained", ".3f", ""),
        ("asked: all finished", "asked_share_generated", ".3f", ""),
        ("asked gap, worst step", "asked_gap_max", ".3f", ""),
        ("LLM tokens wasted", "wasted_llm_tokens", ".0f", ""),
        ("LLM tokens/sample", "llm_tokens_per_trained_sample", ".0f", ""),
        ("  vs sync", "llm_tokens_per_sample_vs_sync", ".3f", "x"),
        ("in-job eval: time", "job_eval_share_rollout_seconds", ".3f", ""),
        ("in-job eval: LLM tok", "job_eval_share_llm_tokens", ".3f", ""),
        ("cost, example prices", "cost_usd", ".4f", " $"),
        ("  per step", "cost_usd_per_step", ".5f", " $"),
        ("  per trained sample", "cost_usd_per_sample", ".6f", " $"),
    )
    for label, s in report["settings"].items():
        print(
            f"\n{label} (seeds {s['seeds']}); speedup to the held-out target, mean time over mean time: "
            f"{fmt(s['speedup_to_heldout_target_of_means'], '.2f', 'x')}"
        )
        for name, key, spec, suffix in columns:
            print(f"  {name:>20}: {fmt_spread(s[key], spec, suffix)}")
    print(
        "\nper run: final held-out (asked), reached the held-out target at, to end, dropped, "
        "dropped groups' asked share vs trained"
    )
    for label, by_seed in report["runs"].items():
        for seed, r in by_seed.items():
            g = r["groups"] or {}
            asked = f"{fmt(g['dropped']['asked'], '.2f')} vs {fmt(g['trained']['asked'], '.2f')}" if g else "-"
            print(
                f"{label:>10} seed {seed}: {r['held_out']['success']:.3f} ({fmt(r['held_out'].get('asked'), '.2f')}), "
                f"{fmt(r['to_heldout_target_s'], '.0f', ' s')}, {r['wall_s']:.0f} s, {r['stale_dropped']}, {asked}"
            )
    print("\nCPU seconds per RL step, by process (2 cores), first seed:")
    for label, by_seed in report["runs"].items():
        r = next(iter(by_seed.values()))
        parts = ", ".join(
            f"{name} {seconds / r['steps']:.2f}"
            for name, seconds in sorted(r["cpu_s"].items(), key=lambda kv: -kv[1])
            if seconds >= 0.005 * r["steps"]
        )
        print(f"{label:>13}: {parts}")


def plot(report: dict, path: Path) -> None:
    """Training reward (moving average) and held-out success against wall time, one colour
    per setting, one line per seed."""
    plt = pyplot()
    fig, (train_ax, held_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    first = report["window"] - 1  # from the first full window on
    for colour, (label, by_seed) in enumerate(report["runs"].items()):
        for n, run in enumerate(by_seed.values()):
            style = dict(
                color=f"C{colour}",
                lw=1.2,
                alpha=0.8,
                ls="--" if run["max_staleness"] == 0 else "-",
                label=label if n == 0 else None,
            )
            train_ax.plot(run["curve"]["seconds"][first:], run["curve"]["reward_ma"][first:], **style)
            curve = run["held_out_curve"]
            held_ax.plot([p["seconds"] for p in curve], [p["success"] for p in curve], marker=".", **style)
    train_ax.axhline(report["target_reward"], color="grey", lw=0.8, ls=":", label="target")
    train_ax.set_ylabel(f"training reward, moving average of {report['window']} steps")
    held_ax.set_ylabel("held-out success")
    for ax in (train_ax, held_ax):
        ax.set_xlabel("wall time since the first weight publish (s)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"Judge-bound clarify (LLM user + judge via the proxy), seeds {report['seeds']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def policies_to_evaluate(out: Path, runs: dict[str, dict[int, dict]]) -> tuple[dict, dict]:
    """(label, seed, step) -> policy folder: every exported step of every run before its
    last, and (separately, to be evaluated on more conversations) each run's final policy."""
    during, final = {}, {}
    for label, by_seed in runs.items():
        for seed, run in by_seed.items():
            steps = len(run["history"])
            final[(label, seed, steps)] = out / "runs" / run["job_id"] / "policy"
            for folder in sorted((out / "runs" / run["job_id"] / "policies").glob("step-*")):
                step = int(folder.name.removeprefix("step-"))
                if step < steps:
                    during[(label, seed, step)] = folder
    return during, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=2.5e-4, help="the learning rate of every run")
    parser.add_argument("--tpm", type=int, default=1_500_000, help="the provider's tokens per minute")
    parser.add_argument("--rpm", type=int, default=10_000, help="the provider's requests per minute")
    parser.add_argument("--max-tasks", type=int, default=32, help="rollout server: tasks in flight")
    parser.add_argument(
        "--target",
        type=float,
        default=1.2,
        help="training reward (moving average) to reach; R* is at most about 1.41 here",
    )
    parser.add_argument("--window", type=int, default=5, help="moving average window in steps")
    parser.add_argument("--eval", type=int, default=256, help="held-out conversations per policy")
    parser.add_argument("--eval-final", type=int, default=1024, help="held-out conversations per final policy")
    parser.add_argument("--export-every", type=int, default=5, help="steps between held-out evaluations")
    parser.add_argument(
        "--heldout-slack",
        type=float,
        default=0.02,
        help="the held-out target is sync's final held-out success less this",
    )
    parser.add_argument(
        "--settings",
        default="sync,eta2,eta2-wait",
        help=f"which runs, comma-separated, sync first (of {', '.join(s[0] for s in SETTINGS)})",
    )
    parser.add_argument(
        "--add",
        action="store_true",
        help="keep the runs already in --out (training.json) and run only the missing ones",
    )
    parser.add_argument("--warm-policy", help="start every run from this policy folder (skips the warm start)")
    parser.add_argument(
        "--job-eval",
        type=int,
        default=0,
        help="held-out rounds inside each job every N steps (its eval section), to measure their share of the "
        "rollout time and LLM tokens; 0: none (the held-out curves come from exported policies afterwards)",
    )
    parser.add_argument("--job-eval-examples", type=int, default=32, help="held-out conversations per in-job round")
    common_args(parser, "async_speedup", seeds="0")  # the seeds are the runs' train.seed
    args = parser.parse_args()
    args.settings = args.settings.split(",")
    if args.settings[0] != SETTINGS[0][0]:
        parser.error("the first setting must be sync: the others are compared with it")
    out = out_folder(args)
    started = time.monotonic()
    warm_policy, runs = train(out, args)
    during, final = policies_to_evaluate(out, runs)
    print(
        f"\nevaluating {len(during) + 1} policies on {args.eval} held-out conversations each "
        f"and {len(final)} final ones on {args.eval_final}"
    )
    held_out = evaluate_once(out, {("warm start", 0, 0): warm_policy} | during, args.eval)
    held_out |= evaluate_once(out, final, args.eval_final)
    report = make_report(args, out, runs, held_out, time.monotonic() - started)
    print_report(report)
    write_report("async_speedup", report, args, plot)


if __name__ == "__main__":
    main()
