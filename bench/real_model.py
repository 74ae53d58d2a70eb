"""SmolLM2-135M-Instruct, a real pretrained model, on this machine: learner speed, rollout
speed, and RL on the clarify task.

(a) learner: trained tokens/s of the learner's own RL and SFT steps (`learner.trainer`,
    FSDP2 on one gloo rank, fp32) on 8 x 128-token sequences, packed into one row (the
    learner's choice) and padded, and FLOP/s by the 6N rule, against the FLOP/s of a
    2048 x 2048 fp32 matmul and of a plain transformers training step (forward, backward,
    AdamW; one padded row per sequence) measured in the same run. The RL step also runs a
    forward without gradients for the proximal logprobs, which 6N does not count.
(b) rollout: generation tokens/s of Tandem's engine (`rollout.engine.Engine`: token ids in
    and out, each token's logprob and weight version) against vLLM's offline
    `LLM.generate`, same engine settings, same prompts (chat-rendered clarify requests),
    64 sampled tokens each; every run in a fresh process, alternating.
(c) clarify: per seed, a warm start (SFT on the task's demonstrations) then RL through the
    whole system (API, rollout server, learner); held-out success of the warm start and of
    the final policy on the same conversations, and the wall time.

Needs the model: `tandem model get smollm2-135m-instruct models/smollm2-135m-instruct`
(done here if missing). Run: python bench/real_model.py [--parts a,b,c] [--seeds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tandem.client import ApiClient, follow  # noqa: E402
from tandem.demo import write_demonstrations  # noqa: E402
from tandem.launcher import Ports, Stack  # noqa: E402
from tandem.models import get  # noqa: E402
from tandem.redis_embed import free_port  # noqa: E402

MODEL = REPO / "models" / "smollm2-135m-instruct"
SEQUENCES, SEQUENCE_TOKENS = 8, 128
PROMPTS, NEW_TOKENS = 32, 64
# Clarify with SmolLM2: a short warm start teaches the reply format (well-formed after six
# SFT steps in the tests), RL then has to teach asking when the request is vague.
WARM_START = {"steps": 12, "batch_size": 8, "lr": 1e-4}
TRAIN = {"batch_size": 2, "lr": 2e-5, "max_staleness": 1}
ROLLOUT = {"group_size": 8, "temperature": 1.0, "max_new_tokens": 48, "max_turns": 3, "max_total_tokens": 512}


# ---- (a) learner ---------------------------------------------------------------------


def matmul_flops(n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of an n x n fp32 matmul on this machine's cores: best of three rounds."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - started))
    return best


def plain_step_seconds(token_batches: list) -> tuple[float, int]:
    """`timed` on plain transformers (forward, backward, AdamW), and the model's parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-5)

    def step(batch: list[list[int]]) -> None:
        ids = torch.tensor(batch)
        plain(input_ids=ids, labels=ids).loss.backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)

    return timed(step, token_batches), sum(p.numel() for p in plain.parameters())


def timed(step, batches: list) -> float:
    """Seconds per call of `step` over `batches` after one untimed call."""
    step(batches[0])
    started = time.perf_counter()
    for batch in batches[1:]:
        step(batch)
    return (time.perf_counter() - started) / (len(batches) - 1)


def learner_speed(steps: int) -> dict:
    import random

    import torch
    import torch.distributed as dist

    from learner.micro_batch import Collator
    from learner.trainer import Trainer
    from services.config import parse_job_spec
    from services.protocol import Sample

    peak = matmul_flops()
    rng = random.Random(0)
    vocab = 49152
    token_batches = [
        [[rng.randrange(vocab) for _ in range(SEQUENCE_TOKENS)] for _ in range(SEQUENCES)] for _ in range(steps + 1)
    ]
    trained = SEQUENCES * (SEQUENCE_TOKENS - 1)

    seconds, params = plain_step_seconds(token_batches)  # its model is freed before the learner's loads
    rows = {"plain transformers step": seconds}

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    spec = parse_job_spec({"model": {"path": str(MODEL)}, "train": {"lr": 1e-5, "max_tokens_per_rank": 4096}})
    trainer = Trainer(spec, torch.device("cpu"))

    def samples(batch: list[list[int]]) -> list[Sample]:
        return [
            Sample(
                sample_id=str(i),
                tokens=t,
                mask=[0] + [1] * (len(t) - 1),
                logprobs=[-3.0] * len(t),
                versions=[0] * len(t),
                reward=0.0,
                advantage=rng.choice([-1.0, 1.0]),
                num_turns=1,
            )
            for i, t in enumerate(batch)
        ]

    sample_batches = [samples(b) for b in token_batches]
    rows["Tandem SFT step"] = timed(trainer.sft_step, sample_batches)
    rows["Tandem RL step"] = timed(trainer.rl_step, sample_batches)
    # The same steps with each sequence in a padded row of its own instead of all of them
    # packed into one: what packing's attention over one long row costs on CPU, where the
    # packed path is a dense block-diagonal mask over the whole row.
    trainer.batches = Collator(trainer.rank, trainer.world_size, spec.train.max_tokens_per_rank, False, trainer.device)
    rows["Tandem SFT step, padded rows"] = timed(trainer.sft_step, sample_batches)
    rows["Tandem RL step, padded rows"] = timed(trainer.rl_step, sample_batches)
    dist.destroy_process_group()
    table = {
        name: {
            "seconds": s,
            "tokens_per_s": trained / s,
            "flops_6n": 6 * params * trained / s,
            "share_of_matmul": 6 * params * trained / s / peak,
        }
        for name, s in rows.items()
    }
    return {
        "parameters": params,
        "sequences": SEQUENCES,
        "sequence_tokens": SEQUENCE_TOKENS,
        "timed_steps": steps,
        "matmul_flops": peak,
        "steps": table,
        "rl_over_plain": table["Tandem RL step"]["tokens_per_s"] / table["plain transformers step"]["tokens_per_s"],
        "sft_over_plain": table["Tandem SFT step"]["tokens_per_s"] / table["plain transformers step"]["tokens_per_s"],
    }


# ---- (b) rollout ---------------------------------------------------------------------


def clarify_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from rollout.tasks.clarify.task import ClarifyTask
    from services.config import TaskSpec

    task = ClarifyTask(TaskSpec(num_examples=PROMPTS), seed=0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    return [
        list(
            tokenizer.apply_chat_template(task.context(i), add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        for i in range(PROMPTS)
    ]


def generation_worker(kind: str, prompts_file: str, out: str) -> None:
    """One timed generation of every prompt at once, by `kind` (tandem | vllm), after a
    warm-up; the result as JSON in `out`."""
    prompts = json.loads(Path(prompts_file).read_text())
    tokens, seconds = asyncio.run(tandem_generation(prompts)) if kind == "tandem" else vllm_generation(prompts)
    Path(out).write_text(json.dumps({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}))
    os._exit(0)  # vLLM's engine threads would keep the process alive


async def tandem_generation(prompts: list[list[int]]) -> tuple[int, float]:
    from rollout.engine import Engine
    from services.config import ModelSpec

    engine = Engine.start(ModelSpec(path=str(MODEL), max_model_len=1024), kv_cache_gib=1.0)

    async def run(batch: list[list[int]], new_tokens: int) -> int:
        outs = await asyncio.gather(*(engine.generate(p, new_tokens, 1.0, stop_ids=[], ignore_eos=True) for p in batch))
        return sum(len(o.tokens) for o in outs)

    await run(prompts[:4], 8)
    started = time.perf_counter()
    tokens = await run(prompts, NEW_TOKENS)
    return tokens, time.perf_counter() - started


def vllm_generation(prompts: list[list[int]]) -> tuple[int, float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rollout.engine import engine_options
    from services.config import ModelSpec

    llm = LLM(**engine_options(ModelSpec(path=str(MODEL), max_model_len=1024), kv_cache_gib=1.0))

    def run(batch: list[list[int]], new_tokens: int) -> int:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in batch],
            SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True),
            use_tqdm=False,
        )
        return sum(len(o.outputs[0].token_ids) for o in outs)

    run(prompts[:4], 8)
    started = time.perf_counter()
    tokens = run(prompts, NEW_TOKENS)
    return tokens, time.perf_counter() - started


def rollout_speed(out: Path, rounds: int) -> dict:
    prompts_file = out / "prompts.json"
    prompts_file.write_text(json.dumps(clarify_prompts()))
    runs: dict[str, list[dict]] = {"vllm": [], "tandem": []}
    for index in range(rounds):
        for kind in runs:
            result = out / f"generation-{kind}-{index}.json"
            subprocess.run(
                [sys.executable, __file__, "--generation-worker", kind, str(prompts_file), str(result)],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            runs[kind].append(json.loads(result.read_text()))
            print(f"  {kind} round {index + 1}: {runs[kind][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    ratios = [t["tokens_per_s"] / v["tokens_per_s"] for t, v in zip(runs["tandem"], runs["vllm"])]
    return {
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "runs": runs,
        "ratios": ratios,
        "ratio_mean": statistics.mean(ratios),
    }


# ---- (c) clarify RL ------------------------------------------------------------------


def clarify_spec(out: Path, seed: int, steps: int) -> dict:
    data = out / "warm_start.jsonl"
    if not data.exists():
        write_demonstrations(data, share=0.3)
    return {
        "name": f"smollm2-clarify-s{seed}",
        "model": {"path": str(MODEL), "max_model_len": 1024},
        "task": {"name": "clarify", "num_examples": 512, "ask_share": 0.3},
        "rollout": ROLLOUT,
        "reward": {"mode": "episode"},
        "train": TRAIN | {"num_steps": steps, "seed": seed},
        "warm_start": WARM_START | {"data": str(data)},
    }


def clarify_rl(out: Path, seeds: int, steps: int, conversations: int) -> dict:
    runs = []
    with Stack(out / "logs", ports=Ports.free(), extra_env={"TANDEM_RUNS_DIR": str(out / "runs")}) as stack:
        client = ApiClient(stack.api_url)
        for seed in range(seeds):
            started = time.monotonic()
            job_id = client.submit(clarify_spec(out, seed, steps))["id"]
            record = follow(client, job_id)
            history = [h for h in client.history(job_id) if h.get("phase") == "rl"]
            runs.append(
                {
                    "seed": seed,
                    "job_id": job_id,
                    "status": record["status"],
                    "seconds": time.monotonic() - started,
                    "history": history,
                }
            )
            (out / "training.json").write_text(json.dumps(runs))
    policies = {}
    for run in runs:
        job_dir = out / "runs" / run["job_id"]
        policies[("warm start", run["seed"])] = job_dir / "policy-warm-start"
        policies[("after RL", run["seed"])] = job_dir / "policy"
    results = asyncio.run(evaluate_policies(policies, conversations))
    for run in runs:
        run["warm_start"] = results[("warm start", run["seed"])]
        run["after_rl"] = results[("after RL", run["seed"])]
        run["gain"] = run["after_rl"]["success"] - run["warm_start"]["success"]
    return {
        "settings": {
            "warm_start": WARM_START,
            "train": TRAIN | {"num_steps": steps},
            "rollout": ROLLOUT,
            "eval_conversations": conversations,
        },
        "runs": runs,
        "warm_start_success": spread([r["warm_start"]["success"] for r in runs]),
        "after_rl_success": spread([r["after_rl"]["success"] for r in runs]),
        "gain": spread([r["gain"] for r in runs]),
        "seconds": spread([r["seconds"] for r in runs]),
    }


async def evaluate_policies(policies: dict, conversations: int) -> dict:
    """Every policy on the same held-out clarify conversations (examples of another seed
    than training's), one engine reloaded from each folder."""
    from transformers import AutoTokenizer

    from rollout.engine import Engine
    from rollout.episode import EpisodeRunner
    from rollout.evaluate import evaluate
    from rollout.tasks.clarify.task import ClarifyTask
    from services.config import ModelSpec, RolloutSpec, TaskSpec
    from services.tokenization import ChatTokenizer

    engine = Engine.start(ModelSpec(path=str(MODEL), max_model_len=1024), kv_cache_gib=1.0)
    task = ClarifyTask(TaskSpec(num_examples=conversations), seed=10_000)
    runner = EpisodeRunner(
        engine, ChatTokenizer(AutoTokenizer.from_pretrained(MODEL)), task.rule_user, RolloutSpec(**ROLLOUT)
    )
    results = {}
    try:
        for key, path in policies.items():
            await engine.reload_from_disk(str(path))
            results[key] = await evaluate(runner, task, list(range(conversations)))
            print(f"  held-out {key}: success {results[key]['success']:.3f}", flush=True)
    finally:
        engine.shutdown()
    return results


def spread(values: list[float]) -> dict:
    return {"min": min(values), "mean": statistics.mean(values), "max": max(values)}


# ---- report --------------------------------------------------------------------------


def print_report(report: dict) -> None:
    if "learner" in report:
        a = report["learner"]
        print(
            f"\n(a) learner, {a['parameters'] / 1e6:.1f}M parameters, {a['sequences']} x {a['sequence_tokens']} "
            f"tokens, fp32, {os.cpu_count()} cores; matmul {a['matmul_flops'] / 1e9:.0f} GFLOP/s"
        )
        print(f"{'step':>30} {'s/step':>7} {'tokens/s':>9} {'GFLOP/s (6N)':>13} {'of matmul':>10}")
        for name, row in a["steps"].items():
            print(
                f"{name:>30} {row['seconds']:>7.2f} {row['tokens_per_s']:>9.0f} {row['flops_6n'] / 1e9:>13.0f} "
                f"{row['share_of_matmul']:>10.0%}"
            )
        print(f"Tandem/plain tokens/s: RL step {a['rl_over_plain']:.2f}, SFT step {a['sft_over_plain']:.2f}")
    if "rollout" in report:
        b = report["rollout"]
        print(f"\n(b) rollout, {b['prompts']} prompts x {b['new_tokens']} sampled tokens")
        for kind, runs in b["runs"].items():
            print(f"{kind:>8}: " + ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs) + " tokens/s")
        print(f"Tandem/vLLM: {', '.join(f'{r:.2f}' for r in b['ratios'])} (mean {b['ratio_mean']:.2f})")
    if "clarify" in report:
        c = report["clarify"]
        print(
            f"\n(c) clarify, {c['settings']['train']['num_steps']} RL steps after "
            f"{c['settings']['warm_start']['steps']} SFT steps, "
            f"{c['settings']['eval_conversations']} held-out conversations"
        )
        print(f"{'seed':>4} {'warm start':>11} {'after RL':>9} {'gain':>7} {'asks (after)':>13} {'minutes':>8}")
        for r in c["runs"]:
            print(
                f"{r['seed']:>4} {r['warm_start']['success']:>11.3f} {r['after_rl']['success']:>9.3f} "
                f"{r['gain']:>+7.3f} {r['after_rl'].get('asked', 0.0):>13.3f} {r['seconds'] / 60:>8.1f}"
            )
        for key in ("warm_start_success", "after_rl_success", "gain"):
            s = c[key]
            print(f"{key:>20}: min {s['min']:.3f} mean {s['mean']:.3f} max {s['max']:.3f}")


def plot(report: dict, path: Path) -> None:
    """Held-out success per seed before and after RL, and the RL reward curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["clarify"]["runs"]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(11, 4))
    seeds = [r["seed"] for r in runs]
    bars.bar([s - 0.2 for s in seeds], [r["warm_start"]["success"] for r in runs], 0.4, label="warm start")
    bars.bar([s + 0.2 for s in seeds], [r["after_rl"]["success"] for r in runs], 0.4, label="after RL")
    bars.set(xlabel="seed", ylabel="held-out success", xticks=seeds, title="SmolLM2-135M on clarify")
    bars.legend()
    for r in runs:
        curves.plot(
            [h["step"] for h in r["history"]], [h["reward_mean"] for h in r["history"]], label=f"seed {r['seed']}"
        )
    curves.set(xlabel="RL step", ylabel="mean training reward", title="RL through Tandem")
    curves.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b,c", help="which of a (learner), b (rollout), c (clarify RL)")
    parser.add_argument("--learner-steps", type=int, default=3, help="timed steps per learner row")
    parser.add_argument("--rounds", type=int, default=2, help="generation runs per engine, alternating")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24, help="RL steps per seed")
    parser.add_argument("--eval", type=int, default=128, help="held-out conversations per policy")
    parser.add_argument("--out", default="bench/results/real_model")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    get("smollm2-135m-instruct", MODEL)
    parts = set(args.parts.split(","))
    report_file = out / "real_model.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    if "a" in parts:
        report["learner"] = learner_speed(args.learner_steps)
    if "b" in parts:
        report["rollout"] = rollout_speed(out, args.rounds)
    if "c" in parts:
        report["clarify"] = clarify_rl(out, args.seeds, args.steps, args.eval)
        plot(report, out / "real_model.png")
    report["cpu_cores"] = os.cpu_count()
    print_report(report)
    report_file.write_text(json.dumps(report, indent=2))
    print(f"wrote {report_file}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--generation-worker":
        generation_worker(*sys.argv[2:5])
    else:
        main()
