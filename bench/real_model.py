"""SmolLM2-135M-Instruct, a real pretrained model, on this machine: learner speed, rollout
speed, and RL on the clarify task.

(a) learner: the learner's own SFT and RL steps (`learner.trainer`, FSDP2 on one gloo
    rank, fp32) on two batches of about 2048 tokens, `uniform` (8 x 256) and `mixed`
    (1 x 1024 + 16 of 32 to 92 tokens, where padding wastes work), with each
    `train.packing` (`varlen`, `mask`, `padded`), and a plain transformers step (forward,
    backward, AdamW; a padded row per sequence, rows grouped into micro-batches as the
    learner's padded path groups them) on the same batches. FLOPs by the 6N rule plus
    causal attention, 6 N s + 6 L d s^2 per sequence of s tokens (N parameters, the tied
    embedding once; L layers of width d); the RL step (one minibatch) makes no forward
    besides: its proximal logprobs are its own forward's, and kl_coef is 0, so no
    reference forward (each would add 2 N s + 2 L d s^2). Shares
    are of the best fp32 2048 x 2048 matmul measured in the same process. One process per
    batch holds every variant and times them in rounds, each round one step of each in a
    rotated order, so a slow minute of this shared machine falls on all of them: seconds
    are medians over rounds, `vs plain` the median of each round's ratio. Each step also
    reports its peak memory above the loaded models and optimizer state, per token of its
    largest micro-batch; the `full-vocab logprobs` rows
    repeat the varlen steps with the learner's former logprob path
    (`full_vocab_token_logprobs`: the whole [T, V] logits in fp32) for the before/after of
    the chunked logprobs (`learner.logprobs`).
(b) rollout: generation tokens/s of Tandem's engine (`rollout.engine.Engine`: token ids in
    and out, each token's logprob and weight version) against vLLM's offline
    `LLM.generate`, same engine settings, same prompts (chat-rendered clarify requests),
    64 sampled tokens each; every run in a fresh process, alternating.
(c) clarify: per seed, a warm start (SFT on the task's demonstrations) then RL through the
    whole system (API, rollout server, learner); held-out success of the warm start and of
    the final policy on the same conversations, and the wall time.

Needs the model: `tandem model get smollm2-135m-instruct models/smollm2-135m-instruct`
(done here if missing). Run: python -m bench.real_model [--parts a,b,c] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from bench.harness import (
    REPO,
    common_args,
    evaluate_policies,
    out_folder,
    pyplot,
    rig,
    rl_steps,
    run_job,
    spread,
    write_report,
)
from tandem.demo import write_demonstrations
from tandem.models import get
from tandem.redis_embed import free_port

MODEL = REPO / "models" / "smollm2-135m-instruct"
SHAPES = {"uniform": [256] * 8, "mixed": [1024] + [32 + 4 * i for i in range(16)]}
"""Part (a)'s batches: sequence lengths, about 2048 tokens each (`mixed`: 1024 and sixteen
of 32 to 92 tokens, which padding pads to 92)."""
MAX_TOKENS_PER_RANK = 4096
"""Each batch is one packed micro-batch; padded, `mixed` is two (the long sequence alone,
the short ones together)."""
LEARNER_RUNS = [
    ("plain", "full"),
    ("varlen", "chunked"),
    ("mask", "chunked"),
    ("padded", "chunked"),
    ("varlen", "full"),
]
"""(packing, logprob path) of each process part (a) runs per batch; `plain` is plain
transformers, the rest the learner with that `train.packing`."""
RL_FORWARDS_WITHOUT_GRAD = 0
"""Forwards without gradients an RL step makes here: one minibatch takes its proximal
logprobs from its own forward (`Trainer.rl_step`), and kl_coef 0 needs no reference."""
PROMPTS, NEW_TOKENS = 32, 64
# Clarify with SmolLM2: a short warm start teaches the reply format (well-formed after six
# SFT steps in the tests), RL then has to teach asking when the request is vague.
WARM_START = {"steps": 12, "batch_size": 8, "lr": 1e-4}
TRAIN = {"batch_size": 2, "lr": 2e-5, "max_staleness": 1}
ROLLOUT = {"group_size": 8, "temperature": 1.0, "max_new_tokens": 48, "max_turns": 3, "max_total_tokens": 512}


# ---- (a) learner ---------------------------------------------------------------------


def learner_speed(out: Path, rounds: int) -> dict:
    """Part (a): each batch of `SHAPES` in a fresh process (`learner_worker`) that times
    every one of `LEARNER_RUNS` for `rounds` rounds."""
    shape = model_shape()
    results = {}
    for name in SHAPES:
        results[name] = run_learner_worker(out, {"shape": name, "rounds": rounds})
        for run, steps in results[name]["steps"].items():
            seconds = ", ".join(f"{step} {statistics.median(m['seconds']):.2f} s" for step, m in steps.items())
            print(f"  {name} {run}: {seconds}", flush=True)
    tables = {name: learner_rows(SHAPES[name], shape, results[name]) for name in SHAPES}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return shape | {
        "commit": commit,
        "shapes": SHAPES,
        "max_tokens_per_rank": MAX_TOKENS_PER_RANK,
        "rounds": rounds,
        "rl_forwards_without_grad": RL_FORWARDS_WITHOUT_GRAD,
        "matmul_flops": {name: max(r["matmul_flops"]) for name, r in results.items()},
        "matmul_flops_measured": {name: r["matmul_flops"] for name, r in results.items()},
        "rows": tables,
        "targets": {name: targets(rows) for name, rows in tables.items()},
    }


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


def model_shape() -> dict:
    """N (parameters, the tied embedding once), L (layers) and d (width) of the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(MODEL)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    return {"parameters": parameters, "layers": config.num_hidden_layers, "hidden": config.hidden_size}


def step_flops(lengths: list[int], shape: dict, forwards_without_grad: int) -> float:
    """FLOPs of a forward and backward over sequences of `lengths` (a forward is 2 N s +
    2 L d s^2 per sequence, causal attention; backward twice that) and of
    `forwards_without_grad` more forwards."""
    forward = sum(2 * shape["parameters"] * s + 2 * shape["layers"] * shape["hidden"] * s * s for s in lengths)
    return (3 + forwards_without_grad) * forward


def micro_batch_tokens(lengths: list[int], padded: bool) -> int:
    """Real tokens in the largest micro-batch the learner (or plain, padded) forms."""
    from learner import batching

    parts = batching.partition(lengths, 1, MAX_TOKENS_PER_RANK, padded=padded)[0]
    return max(sum(lengths[i] for i in part) for part in parts)


def learner_rows(lengths: list[int], shape: dict, result: dict) -> dict[str, dict]:
    """Table rows of one batch: plain, then the SFT rows, then the RL rows; shares of the
    best matmul its process measured."""
    rows, peak = {}, max(result["matmul_flops"])
    plain = result["steps"]["plain/full"]["plain"]["seconds"]
    for kind in ("plain", "sft", "rl"):
        for run, steps in result["steps"].items():
            if kind not in steps:
                continue
            packing, path = run.split("/")
            measured = steps[kind]
            name = "plain transformers" if kind == "plain" else f"{kind.upper()} {packing}"
            name += ", full-vocab logprobs" if path == "full" and kind != "plain" else ""
            seconds = statistics.median(measured["seconds"])
            flops = step_flops(lengths, shape, forwards_without_grad=RL_FORWARDS_WITHOUT_GRAD if kind == "rl" else 0)
            padded = packing in ("plain", "padded") or not result["packed"][run]
            micro = micro_batch_tokens(lengths, padded)
            rows[name] = {
                "step": kind,
                "packing": packing,
                "logprobs": path,
                "packed": not padded,
                "seconds": seconds,
                "seconds_per_round": measured["seconds"],
                "tokens_per_s": sum(lengths) / seconds,
                "flops": flops,
                "flops_per_s": flops / seconds,
                "share_of_matmul": flops / seconds / peak,
                "over_plain": statistics.median(p / x for p, x in zip(plain, measured["seconds"])),
                "step_peak_bytes": max(measured["peak_bytes"]),
                "micro_batch_tokens": micro,
                "peak_bytes_per_token": max(measured["peak_bytes"]) / micro,
            }
    return rows


def targets(rows: dict[str, dict]) -> dict:
    """The learner's goals on one batch, with the figures they are judged on."""
    sft, rl = rows["SFT varlen"], rows["RL varlen"]
    return {
        "sft_share_of_matmul": sft["share_of_matmul"],
        "sft_over_plain": sft["over_plain"],
        "rl_share_of_matmul": rl["share_of_matmul"],
        "sft_varlen_over_padded": rows["SFT padded"]["seconds"] / sft["seconds"],
        "rl_varlen_over_padded": rows["RL padded"]["seconds"] / rl["seconds"],
        "sft_met": sft["share_of_matmul"] >= 0.6 and sft["over_plain"] >= 1.0,
        "rl_met": rl["share_of_matmul"] >= 0.5,
        "packed_beats_padded": sft["seconds"] < rows["SFT padded"]["seconds"]
        and rl["seconds"] < rows["RL padded"]["seconds"],
    }


def run_learner_worker(out: Path, run: dict) -> dict:
    """`learner_worker` for `run` in a fresh process, its output in a log beside the result."""
    stem = out / f"learner-{run['shape']}"
    result = stem.with_suffix(".json")
    with stem.with_suffix(".log").open("w") as log:
        command = [sys.executable, "-m", __spec__.name, "--learner-worker", json.dumps(run), str(result)]
        subprocess.run(command, cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(result.read_text())


def learner_worker(run_json: str, out: str) -> None:
    """One process of part (a): every one of `LEARNER_RUNS` on the batch `shape`, an
    untimed step of each kind first (it also allocates gradients and optimizer state),
    then `rounds` rounds of one timed step of each, the order rotated each round, a matmul
    measured before and after every round; the result as JSON in `out`."""
    run = json.loads(run_json)
    lengths = SHAPES[run["shape"]]
    batches = token_batches(lengths, run["rounds"] + 1)
    samples = [as_samples(batch) for batch in batches]
    steps, packed = {}, {}
    trainers = {}
    for packing, path in LEARNER_RUNS:
        key = f"{packing}/{path}"
        if packing == "plain":
            steps[key] = {"plain": plain_step(lengths)}
            continue
        trainers[packing] = trainers.get(packing) or learner_trainer(packing)
        trainer, full = trainers[packing], path == "full"
        packed[key] = trainer.can_pack
        steps[key] = {kind: with_logprobs(trainer, getattr(trainer, f"{kind}_step"), full) for kind in ("sft", "rl")}
    data = {"plain": batches, "sft": samples, "rl": samples}
    timed = {key: {kind: {"seconds": [], "peak_bytes": []} for kind in kinds} for key, kinds in steps.items()}
    for kinds in steps.values():
        for kind, step in kinds.items():
            step(data[kind][0])
    flops = [matmul_flops(repeats=5)]
    calls = [(key, kind) for key, kinds in steps.items() for kind in kinds]
    for r in range(run["rounds"]):
        for key, kind in calls[r % len(calls) :] + calls[: r % len(calls)]:
            seconds, peak = measured(steps[key][kind], data[kind][r + 1])
            timed[key][kind]["seconds"].append(seconds)
            timed[key][kind]["peak_bytes"].append(peak)
        flops.append(matmul_flops(repeats=5))
        print(f"round {r + 1} of {run['rounds']} done", flush=True)
    Path(out).write_text(json.dumps({"matmul_flops": flops, "packed": packed, "steps": timed}))


def with_logprobs(trainer, step, full: bool):
    """`step` of `trainer`, run with the former full-vocabulary logprob path when `full`."""
    if not full:
        return step

    def former(batch):
        trainer.token_logprobs = types.MethodType(full_vocab_token_logprobs, trainer)
        try:
            return step(batch)
        finally:
            del trainer.token_logprobs  # back to the class's method

    return former


def token_batches(lengths: list[int], count: int) -> list[list[list[int]]]:
    """`count` batches of random token ids, sequences of `lengths`; the same in every process."""
    import random

    from learner.policy import vocab_size

    rng, vocab = random.Random(0), vocab_size(str(MODEL))
    return [[[rng.randrange(vocab) for _ in range(n)] for n in lengths] for _ in range(count)]


def as_samples(batch: list[list[int]]):
    """Every token but each sequence's first trained, advantages alternating -1 and 1."""
    from services.protocol import Sample

    return [
        Sample(
            sample_id=str(i),
            tokens=tokens,
            mask=[0] + [1] * (len(tokens) - 1),
            logprobs=[-3.0] * len(tokens),
            versions=[0] * len(tokens),
            reward=0.0,
            advantage=1.0 if i % 2 else -1.0,
            num_turns=1,
        )
        for i, tokens in enumerate(batch)
    ]


def measured(step, batch) -> tuple[float, int]:
    """Seconds of one call of `step` on `batch`, and the most resident memory it held above
    what the process held before it."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand back what earlier calls freed
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak, to VmRSS
    started = time.perf_counter()
    step(batch)
    return time.perf_counter() - started, status_bytes("VmHWM") - before


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def plain_step(lengths: list[int]):
    """A plain transformers training step (forward, backward, AdamW) on batches of
    sequences of `lengths`: a row per sequence, padded to the longest of its micro-batch,
    the micro-batches those of the learner's padded path; the labels loss, a mean over
    every predicted token of the batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner import batching

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)  # transformers' Trainer's default optimizer
    groups = batching.partition(lengths, 1, MAX_TOKENS_PER_RANK, padded=True)[0]
    predicted = sum(lengths) - len(lengths)

    def step(batch: list[list[int]]) -> None:
        for group in groups:
            rows = [batch[i] for i in group]
            width = max(map(len, rows))
            ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
            real = torch.tensor([[j < len(row) for j in range(width)] for row in rows])
            out = model(input_ids=ids, attention_mask=real.long(), labels=ids.masked_fill(~real, -100))
            (out.loss * (int(real.sum()) - len(rows)) / predicted).backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)

    return step


def learner_trainer(packing: str):
    """The learner's Trainer on the process's gloo rank with `train.packing` = `packing`."""
    import torch
    import torch.distributed as dist

    from learner.trainer import Trainer
    from services.config import parse_job_spec

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    train = {"lr": 1e-5, "max_tokens_per_rank": MAX_TOKENS_PER_RANK, "packing": packing}
    return Trainer(parse_job_spec({"model": {"path": str(MODEL)}, "train": train}), torch.device("cpu"))


def full_vocab_token_logprobs(trainer, micro, model=None, with_entropy: bool = False, scored=None):
    """`Trainer.token_logprobs` as it was before `learner.logprobs`: the model's whole
    [rows, W, V] logits, an fp32 copy divided by the temperature and its log-softmax (all
    kept for backward), at every position whether a loss reads it or not (`scored` is
    ignored). The same values to fp32 precision; here for the memory and time it costs."""
    import torch

    from learner import loss

    model = model or trainer.model
    logits = model(input_ids=micro.input_ids, position_ids=micro.position_ids, use_cache=False).logits
    logits = logits.float() / trainer.spec.rollout.temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = logp.gather(-1, micro.input_ids[:, 1:, None]).squeeze(-1)
    picked = torch.cat([picked.new_zeros(len(picked), 1), picked], dim=1).flatten()[micro.keep]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            ent = loss.entropy_from_logits(logits[:, :-1])
            entropy = torch.cat([ent.new_zeros(len(ent), 1), ent], dim=1).flatten()[micro.keep]
    return picked, entropy


# ---- (b) rollout ---------------------------------------------------------------------


def clarify_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from rollout.tasks.clarify.task import ClarifyTask
    from services.config import ClarifySpec

    task = ClarifyTask(ClarifySpec(num_examples=PROMPTS), seed=0)
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
                [sys.executable, "-m", __spec__.name, "--generation-worker", kind, str(prompts_file), str(result)],
                cwd=REPO,
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
    """Part (c)'s job for one seed: the warm start, then `steps` RL steps."""
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


def clarify_rl(out: Path, seeds: list[int], steps: int, conversations: int) -> dict:
    """Part (c): a job per seed, then its warm-start and final policies on the same held-out
    conversations."""
    runs = []
    with rig(out) as r:
        for seed in seeds:
            done = run_job(r, clarify_spec(out, seed, steps))
            runs.append(
                {
                    "seed": seed,
                    "job_id": done["job_id"],
                    "status": done["record"]["status"],
                    "seconds": done["seconds"],
                    "history": rl_steps(done["history"]),
                }
            )
            (out / "training.json").write_text(json.dumps(runs))
    policies = {}
    for run in runs:
        job_dir = out / "runs" / run["job_id"]
        policies[("warm start", run["seed"])] = job_dir / "policy-warm-start"
        policies[("after RL", run["seed"])] = job_dir / "policy"
    # Held-out examples of another seed than training's, played with the jobs' settings.
    results = asyncio.run(evaluate_policies(policies, clarify_spec(out, 0, steps), conversations, seed=10_000))
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


# ---- report --------------------------------------------------------------------------


def print_report(report: dict) -> None:
    if "learner" in report:
        print_learner(report["learner"])
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


def print_learner(a: dict) -> None:
    print(
        f"\n(a) learner, {a['parameters'] / 1e6:.1f}M parameters, fp32, {os.cpu_count()} cores; "
        f"FLOPs 6Ns + 6Lds^2; medians of {a['rounds']} rounds"
    )
    for name, rows in a["rows"].items():
        lengths = a["shapes"][name]
        matmul = a["matmul_flops"][name] / 1e9
        print(f"\n{name}: {describe(lengths)} = {sum(lengths)} tokens; matmul {matmul:.0f} GFLOP/s (best in process)")
        print(
            f"{'step':>36} {'s/step':>7} {'tokens/s':>9} {'GFLOP/s':>8} {'of matmul':>10} {'vs plain':>9} "
            f"{'peak MB':>8} {'KB/token':>9}"
        )
        for row_name, row in rows.items():
            print(
                f"{row_name:>36} {row['seconds']:>7.2f} {row['tokens_per_s']:>9.0f} {row['flops_per_s'] / 1e9:>8.0f} "
                f"{row['share_of_matmul']:>10.0%} {row['over_plain']:>9.2f} {row['step_peak_bytes'] / 2**20:>8.0f} "
                f"{row['peak_bytes_per_token'] / 1024:>9.0f}"
            )
        t = a["targets"][name]
        print(
            f"SFT varlen {t['sft_share_of_matmul']:.0%} of matmul, {t['sft_over_plain']:.2f}x plain; "
            f"RL varlen {t['rl_share_of_matmul']:.0%}; varlen/padded SFT {t['sft_varlen_over_padded']:.2f}, "
            f"RL {t['rl_varlen_over_padded']:.2f}"
        )


def describe(lengths: list[int]) -> str:
    """Sequence lengths as counts: [1024, 64, 64] -> '1 x 1024 + 2 x 64'; the long one and
    a range when the others vary: '1 x 1024 + 16 of 32 to 92'."""
    counts = {n: lengths.count(n) for n in sorted(set(lengths), reverse=True)}
    if len(counts) <= 3:
        return " + ".join(f"{count} x {n}" for n, count in counts.items())
    rest = sorted(lengths)[:-1]
    return f"1 x {max(lengths)} + {len(rest)} of {rest[0]} to {rest[-1]}"


def plot(report: dict, path: Path) -> None:
    """Held-out success per seed before and after RL, and the RL reward curves."""
    plt = pyplot()
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
    common_args(parser, "real_model", seeds="0,1,2")
    parser.add_argument("--parts", default="a,b,c", help="which of a (learner), b (rollout), c (clarify RL)")
    parser.add_argument("--learner-rounds", type=int, default=3, help="timed steps per learner row, in rounds")
    parser.add_argument("--rounds", type=int, default=2, help="generation runs per engine, alternating")
    parser.add_argument("--steps", type=int, default=24, help="RL steps per seed")
    parser.add_argument("--eval", type=int, default=128, help="held-out conversations per policy")
    args = parser.parse_args()
    out = out_folder(args)
    get("smollm2-135m-instruct", MODEL)
    parts = set(args.parts.split(","))
    report_file = out / "real_model.json"  # parts not run this time keep their last results
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    if "a" in parts:
        report["learner"] = learner_speed(out, args.learner_rounds)
    if "b" in parts:
        report["rollout"] = rollout_speed(out, args.rounds)
    if "c" in parts:
        report["clarify"] = clarify_rl(out, args.seeds, args.steps, args.eval)
    report["cpu_cores"] = os.cpu_count()
    print_report(report)
    write_report("real_model", report, args, plot if "c" in parts else None)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--generation-worker":
        generation_worker(*sys.argv[2:5])
    elif len(sys.argv) > 1 and sys.argv[1] == "--learner-worker":
        learner_worker(*sys.argv[2:4])
    else:
        main()
