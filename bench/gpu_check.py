"""One prepared command for a GPU machine: what Tandem's learner does on CUDA, in sections.

Each section runs in a subprocess of its own under its own timeout and appends one JSON
line to `<out>/gpu_check.jsonl` (section, status, seconds, summary, its figures), so a run
cut short still reports what it reached; the sections' output goes to `<out>/gpu_check.log`.
Status is ok, skip (with a reason), partial (some measurements failed: `failures` names
them), error or timeout (with whatever the section had recorded). In order of what they tell:

  versions   torch, CUDA, NCCL, transformers, the GPU; which SDPA kernels run (causal and
             with a bool mask); torch's varlen attention, flex attention, flash-attn,
             transformers' packed-sequence detection
  matmul     the bf16 matmul peak (8192^3 on CUDA), the denominator of MFU
  packing    the learner's packing probe (`policy.separates_packed_sequences`, run by the
             Trainer) per dtype, and per-token logprobs packed vs padded (and varlen) per
             dtype, each against fp32 padded rows
  steps      `Trainer.sft_step` and `rl_step` on packed, padded and varlen micro-batches,
             and a plain transformers step (forward, backward, AdamW) on the same batch:
             tokens/s, MFU, peak memory
  memory     one SFT step's peak memory as the row grows (packed, padded, varlen)
  weights    the weight group's buckets (`services.weight_group`, the learner's bucket
             sizes): a one-rank NCCL group, gloo between two processes with buffers on
             the device (what a learner and an engine sharing a GPU use), and CUDA IPC
             between two processes (measured beside gloo; Tandem does not use it yet)
  tests_gpu  `pytest tests/gpu`, when that folder exists

The model has random weights, built on the machine (its weights cannot travel there), in
the shape `--shape` names: SmolLM2-135M's (the default on CUDA), a Llama of 1.07B parameters
(`llama-1b`: GEMMs large enough to keep an H100 busy), or a tiny one (the default on CPU).
The shape also sets the workload: sequences, row lengths, timed steps, timeouts. MFU
counts 6N FLOPs per token for a training step (8N for the RL step, whose proximal forward
adds 2N) plus causal attention, 6 L d s^2 per sequence of s tokens (8 for RL), over trained
time, against the matmul section's measured peak. `varlen` is packed rows through the
learner's varlen attention (`learner/attention.py`: torch's varlen kernel on CUDA in 16-bit,
SDPA sequence by sequence elsewhere); `packed` is packed rows through transformers' dense
block-diagonal mask (`train.packing: mask`).

On CUDA each section has a process of its own, so a crash or a hung kernel costs one
section. On CPU all sections share one process (each still reports its own line): there,
importing torch and transformers costs more than the tiny shape's work.

`--device cpu` runs every section on the tiny shape: the dry run tests/unit/test_gpu_check.py
makes, so the command is known to work before a GPU sees it. docs/testing.md gives the call.

It imports nothing at module level beyond the standard library, and nothing of
`bench.harness` at all: the GPU machine has torch and transformers but not the Tandem
package's other dependencies. Run from the repo root, which puts the tree on the path.

Run: python -m bench.gpu_check [--device cuda|cpu] [--shape NAME] [--sections a,b] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repo root: the working folder of the processes this starts (`-m bench.gpu_check`,
pytest). Not `bench.harness.REPO`, which would bring the harness's imports."""

SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "max_position_embeddings": 16384,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
TINY = SMOLLM2_135M | {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
}
LLAMA_1B = SMOLLM2_135M | {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
}
"""Llama-3.2-1B's body on SmolLM2's vocabulary: 1.07B parameters, 0.1B of them the embedding."""
H100_BF16_DENSE_FLOPS = 989.4e12
"""NVIDIA's dense bf16 figure for the H100 SXM: MFU is also given against it."""


@dataclass(frozen=True)
class Shapes:
    """What each section runs for one model shape, and its timeout."""

    model: dict
    matmul_n: int
    parity_sequences: int
    parity_lengths: tuple[int, int]
    step_sequences: int
    step_lengths: tuple[int, int]
    max_tokens_per_rank: int
    warmup_steps: int
    timed_steps: int
    rows: tuple[int, ...]
    row_sequence_tokens: int
    bucket_mib: tuple[int, ...]
    timeouts_s: dict[str, float]
    budget_s: float
    """The whole run: a section gets what is left of it when its own timeout is longer."""


SMOLLM2_135M_SHAPES = Shapes(
    model=SMOLLM2_135M,
    matmul_n=8192,
    parity_sequences=8,
    parity_lengths=(100, 1000),
    step_sequences=32,
    step_lengths=(256, 2048),
    max_tokens_per_rank=16384,
    warmup_steps=1,
    timed_steps=3,
    rows=(2048, 4096, 8192, 16384),
    row_sequence_tokens=512,
    bucket_mib=(512, 64),
    timeouts_s={
        "versions": 45,
        "matmul": 40,
        "packing": 75,
        "steps": 150,
        "memory": 60,
        "weights": 60,
        "tests_gpu": 40,
    },
    budget_s=450,
)
LLAMA_1B_SHAPES = replace(
    SMOLLM2_135M_SHAPES,
    model=LLAMA_1B,
    max_tokens_per_rank=8192,  # at 16384, plain transformers' fp32 AdamW step runs out of 80 GB
    timed_steps=2,  # a step is about 8 times the 135M one's: the run must still fit its minutes
    timeouts_s=SMOLLM2_135M_SHAPES.timeouts_s | {"steps": 220, "memory": 120},
    budget_s=380,
)
TINY_SHAPES = Shapes(
    model=TINY,
    matmul_n=256,
    parity_sequences=3,
    parity_lengths=(8, 48),
    step_sequences=4,
    step_lengths=(8, 48),
    max_tokens_per_rank=128,
    warmup_steps=0,  # the dry run checks that every path runs, not how fast
    timed_steps=1,
    rows=(64, 128),
    row_sequence_tokens=32,
    bucket_mib=(1,),
    timeouts_s={name: 60 for name in ("versions", "matmul", "packing", "steps", "memory", "weights", "tests_gpu")},
    budget_s=150,
)
SHAPES = {"smollm2-135m": SMOLLM2_135M_SHAPES, "llama-1b": LLAMA_1B_SHAPES, "tiny": TINY_SHAPES}
DEFAULT_SHAPE = {"cuda": "smollm2-135m", "cpu": "tiny"}


class Skip(Exception):
    """A section that cannot run here; its message is the reason."""


@dataclass
class Context:
    device: str
    shapes: Shapes
    work: Path
    """Scratch shared by the sections (the model folder, the measured peak); removed at the end."""
    result_file: Path
    result: dict = field(default_factory=dict)

    def put(self, key: str, value) -> None:
        """Record a figure now: a section killed later still reports what it reached."""
        self.result[key] = value
        self.result_file.write_text(json.dumps(self.result, default=str))

    def attempt(self, key: str, measure) -> None:
        """Record `measure()` under `key`, or its failure (an out-of-memory is a figure too)."""
        try:
            self.put(key, measure())
        except Exception as error:  # noqa: BLE001 - every failure is a result to report
            self.put(key, {"error": f"{type(error).__name__}: {str(error)[:300]}"})
            self.put("failures", self.result.get("failures", []) + [key])
            traceback.print_exc()
            free_device_memory(self.device)


# ---- shared helpers --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_device_memory(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def start_memory(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def init_group(device: str) -> None:
    """A one-rank default group, as torchrun gives a single learner rank (nccl on CUDA)."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def model_folder(ctx: Context) -> Path:
    """A Hugging Face folder of the shape's Llama with random weights (seed 0), made once per run."""
    folder = ctx.work / "model"
    if not (folder / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        with torch.device(ctx.device):  # a 1B model's random init takes a CPU long
            LlamaForCausalLM(LlamaConfig(**ctx.shapes.model)).save_pretrained(folder)
    return folder


def make_trainer(ctx: Context, dtype: str, max_tokens_per_rank: int):
    """The learner's own Trainer on the model folder (its packing probe runs here)."""
    import torch

    from learner.trainer import Trainer
    from services.config import parse_job_spec

    spec = parse_job_spec(
        {
            "model": {"path": str(model_folder(ctx)), "dtype": dtype},
            "train": {"lr": 1e-5, "max_tokens_per_rank": max_tokens_per_rank},
        }
    )
    return Trainer(spec, torch.device(ctx.device))


def make_samples(rng: random.Random, count: int, lengths: tuple[int, int], vocab: int) -> list:
    from services.protocol import Sample

    uniform = -math.log(vocab)  # what a random-init policy gives any token, about

    def sample(i: int, n: int) -> Sample:
        return Sample(
            sample_id=str(i),
            tokens=[rng.randrange(vocab) for _ in range(n)],
            mask=[0] + [1] * (n - 1),
            logprobs=[uniform] * n,
            versions=[0] * n,
            reward=0.0,
            advantage=rng.choice([-1.0, 1.0]),
            num_turns=1,
        )

    return [sample(i, rng.randint(*lengths)) for i in range(count)]


def use_mode(trainer, mode: str, max_tokens_per_rank: int) -> None:
    """Micro-batches and attention for `mode`: packed (one row, transformers' dense mask:
    `train.packing: mask`), padded (a row per sequence), varlen (one row, the learner's
    varlen attention: `train.packing: varlen`)."""
    from learner import attention
    from learner.micro_batch import Collator

    trainer.batches = Collator(trainer.rank, trainer.world_size, max_tokens_per_rank, mode != "padded", trainer.device)
    trainer.model.config._attn_implementation = attention.implementation("varlen" if mode == "varlen" else "mask")


# ---- sections ----------------------------------------------------------------------------


def versions(ctx: Context) -> None:
    import importlib.util
    import platform

    import torch
    import transformers
    from transformers import masking_utils

    ctx.put("python", platform.python_version())
    ctx.put("torch", torch.__version__)
    ctx.put("transformers", transformers.__version__)
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        ctx.put("cuda", torch.version.cuda)
        ctx.put("cudnn", torch.backends.cudnn.version())
        nccl = torch.cuda.nccl.version()
        ctx.put("nccl", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
        ctx.put("gpu", props.name)
        ctx.put("capability", f"{props.major}.{props.minor}")
        ctx.put("sms", props.multi_processor_count)
        ctx.put("memory_gib", round(props.total_memory / 2**30, 1))
    ctx.put("sdpa", sdpa_kernels(ctx.device))
    ctx.put("varlen_attn", varlen_signature())
    ctx.put("flex_attention", importlib.util.find_spec("torch.nn.attention.flex_attention") is not None)
    ctx.put("flash_attn_package", importlib.util.find_spec("flash_attn") is not None)
    ctx.put("packed_sequence_detection", hasattr(masking_utils, "find_packed_sequence_indices"))
    runs = lambda case: "+".join(k for k, v in ctx.result["sdpa"].items() if v[case] == "ok") or "none"  # noqa: E731
    ctx.put(
        "summary",
        f"torch {torch.__version__}, transformers {transformers.__version__}, {ctx.result.get('gpu', 'cpu')}; "
        f"sdpa causal: {runs('causal')}, bool mask: {runs('bool_mask')}; "
        f"varlen_attn: {'yes' if ctx.result['varlen_attn'] else 'no'}",
    )


def sdpa_kernels(device: str) -> dict[str, dict[str, str]]:
    """Which SDPA backend runs a causal call and a bool-masked call (the packed rows' case)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 9, 256, 64, device=device, dtype=dtype) for _ in range(3))
    mask = torch.ones(256, 256, dtype=torch.bool, device=device).tril()
    out = {}
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        row = {}
        for case, kwargs in (("causal", {"is_causal": True}), ("bool_mask", {"attn_mask": mask})):
            try:
                with sdpa_kernel([getattr(SDPBackend, backend)]):
                    F.scaled_dot_product_attention(q, k, v, **kwargs)
                row[case] = "ok"
            except Exception as error:  # noqa: BLE001 - a refused kernel is the answer
                row[case] = f"no: {str(error).splitlines()[0][:120]}"
        out[backend.lower()] = row
    return out


def varlen_signature() -> str | None:
    import importlib.util
    import inspect

    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return None
    from torch.nn.attention.varlen import varlen_attn

    return str(inspect.signature(varlen_attn))


def matmul(ctx: Context) -> None:
    """Best of 3 rounds of 20 products (CUDA events); the peak MFU is measured against."""
    import torch

    n = ctx.shapes.matmul_n
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=ctx.device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    best_s = math.inf
    for _ in range(3):
        synchronize(ctx.device)
        started = time.perf_counter()
        for _ in range(20):
            a @ b
        synchronize(ctx.device)
        best_s = min(best_s, (time.perf_counter() - started) / 20)
    flops = 2 * n**3 / best_s
    (ctx.work / "peak.json").write_text(json.dumps({"flops": flops}))
    ctx.put("n", n)
    ctx.put("dtype", str(dtype).removeprefix("torch."))
    ctx.put("tflops", round(flops / 1e12, 2))
    ctx.put("summary", f"{str(dtype).removeprefix('torch.')} {n}^3: {flops / 1e12:.1f} TFLOP/s")


def packing(ctx: Context) -> None:
    import torch

    init_group(ctx.device)
    shapes = ctx.shapes
    samples = make_samples(random.Random(1), shapes.parity_sequences, shapes.parity_lengths, shapes.model["vocab_size"])
    reference = None
    line = []
    for dtype in ("float32", "bfloat16"):
        trainer = make_trainer(ctx, dtype, shapes.max_tokens_per_rank)
        ctx.put(f"{dtype}.probe_packs", trainer.can_pack)
        ctx.put(f"{dtype}.probe_max_abs_diff", probe_difference(trainer.model, trainer.device))
        padded = logprobs(trainer, samples, "padded")
        reference = padded if reference is None else reference
        ctx.put(f"{dtype}.max_abs_logit", max_abs_logit(trainer, samples))
        # The varlen kernel (flash) takes 16-bit inputs only; its CPU stand-in takes any.
        for mode in ("packed", "varlen") if dtype == "bfloat16" or ctx.device == "cpu" else ("packed",):
            compare = lambda: parity(logprobs(trainer, samples, mode), padded, reference)  # noqa: E731
            ctx.attempt(f"{dtype}.{mode}_vs_padded", compare)
        line.append(
            f"{dtype}: probe packs={trainer.can_pack} (diff {ctx.result[f'{dtype}.probe_max_abs_diff']:.1e}), "
            f"packed-padded max {ctx.result[f'{dtype}.packed_vs_padded'].get('max_abs', 'err')}"
        )
        trainer = None  # the next dtype's model loads into the memory this one frees
        free_device_memory(ctx.device)
    ctx.put("tokens", sum(len(s.tokens) for s in samples))
    ctx.put("summary", "; ".join(line))
    torch.distributed.destroy_process_group()


def probe_difference(model, device) -> float:
    """The largest logit difference the packing probe (`policy.separates_packed_sequences`)
    compares with its tolerance: the same two sequences, the second alone and packed after
    the first."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, model.config.vocab_size, (1, n), generator=generator).to(device) for n in (5, 4))
    with torch.no_grad():
        alone = model(input_ids=b, position_ids=torch.tensor([[0, 1, 2, 3]], device=device), use_cache=False).logits
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]], device=device)
        both = model(input_ids=torch.cat([a, b], 1), position_ids=positions, use_cache=False).logits
    model.reshard()
    return float((alone.float() - both[:, 5:].float()).abs().max())


def logprobs(trainer, samples: list, mode: str):
    """[tokens] the trainer's logprobs of every token of `samples`, in sample order, and the
    trained-token mask, with `mode`'s micro-batches and attention."""
    import torch

    use_mode(trainer, mode, trainer.batches.max_tokens_per_rank)
    by_sample = {}
    with torch.no_grad():
        # Padded and packed micro-batches group the samples differently: put them back in order.
        for mb in trainer.batches.micro_batches(samples):
            values = trainer.token_logprobs(mb)[0].float()
            by_sample |= dict(zip(mb.samples, values.split([len(samples[i].tokens) for i in mb.samples])))
    trainer.model.reshard()
    use_mode(trainer, "padded", trainer.batches.max_tokens_per_rank)
    values = torch.cat([by_sample[i] for i in range(len(samples))])
    mask = torch.tensor([m for s in samples for m in s.mask], device=values.device) > 0
    return values[mask]


def max_abs_logit(trainer, samples: list) -> float:
    """The scale of the logits the parity errors are made on."""
    import torch

    mb = trainer.batches.micro_batches(samples[:1])[0]
    with torch.no_grad():
        logits = trainer.model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
    trainer.model.reshard()
    return float(logits.float().abs().max())


def parity(values, padded, reference) -> dict[str, float]:
    return {
        "max_abs": float((values - padded).abs().max()),
        "mean_abs": float((values - padded).abs().mean()),
        "max_abs_vs_fp32_padded": float((values - reference).abs().max()),
        "padded_max_abs_vs_fp32_padded": float((padded - reference).abs().max()),
    }


def steps(ctx: Context) -> None:
    import torch

    init_group(ctx.device)
    shapes = ctx.shapes
    rng = random.Random(2)
    batch = make_samples(rng, shapes.step_sequences, shapes.step_lengths, shapes.model["vocab_size"])
    lengths = [len(s.tokens) for s in batch]
    ctx.put("sequences", len(batch))
    ctx.put("tokens", sum(lengths))
    ctx.put("max_tokens_per_rank", shapes.max_tokens_per_rank)
    ctx.put("peak_tflops", round(peak_flops(ctx) / 1e12, 2))
    ctx.attempt("plain_transformers", lambda: plain_step(ctx, batch))
    free_device_memory(ctx.device)  # its model goes before the learner's loads
    trainer = make_trainer(ctx, "bfloat16", shapes.max_tokens_per_rank)
    params = sum(p.numel() for p in trainer.model.parameters())
    ctx.put("parameters", params)
    for mode in ("packed", "padded", "varlen"):
        use_mode(trainer, mode, shapes.max_tokens_per_rank)
        for kind in ("sft", "rl"):
            step = trainer.sft_step if kind == "sft" else trainer.rl_step
            ctx.attempt(f"{mode}.{kind}", lambda: timed(ctx, step, batch, step_flops(ctx, params, lengths, kind)))
    ctx.put("summary", steps_summary(ctx.result))
    torch.distributed.destroy_process_group()


def peak_flops(ctx: Context) -> float:
    """The matmul section's peak, or a stand-in when it did not finish (then MFU is
    against that stand-in, as `peak_source` says)."""
    measured = ctx.work / "peak.json"
    if measured.exists():
        ctx.put("peak_source", "measured")
        return json.loads(measured.read_text())["flops"]
    ctx.put("peak_source", "H100 dense bf16 spec")
    return H100_BF16_DENSE_FLOPS


def step_flops(ctx: Context, params: int, lengths: list[int], kind: str) -> float:
    """Useful FLOPs of one step: 6N per token and 6 L d s^2 of causal attention per
    sequence (forward and backward), 8 of each for RL (its proximal forward adds 2)."""
    cfg = ctx.shapes.model
    per = 8 if kind == "rl" else 6
    attention = cfg["num_hidden_layers"] * cfg["hidden_size"] * sum(s * s for s in lengths)
    return per * (params * sum(lengths) + attention)


def timed(ctx: Context, step, batch: list, flops: float) -> dict:
    """The shape's warm-up steps, then its timed steps: seconds, tokens/s, MFU, peak memory."""
    for _ in range(ctx.shapes.warmup_steps):
        step(batch)
    start_memory(ctx.device)
    synchronize(ctx.device)
    started = time.perf_counter()
    for _ in range(ctx.shapes.timed_steps):
        step(batch)
    synchronize(ctx.device)
    seconds = (time.perf_counter() - started) / ctx.shapes.timed_steps
    return measured(ctx, seconds, sum(len(s.tokens) for s in batch), flops)


def measured(ctx: Context, seconds: float, tokens: int, flops: float) -> dict:
    peak = peak_flops(ctx)
    row = {
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds),
        "mfu": round(flops / seconds / peak, 4),
        "peak_memory_gib": peak_memory_gib(ctx.device),
    }
    if ctx.device == "cuda":
        row["mfu_vs_h100_spec"] = round(flops / seconds / H100_BF16_DENSE_FLOPS, 4)
    return row


def plain_step(ctx: Context, batch: list) -> dict:
    """transformers alone on the same batch: fp32 weights, bf16 autocast on CUDA, the
    learner's micro-batches as padded rows, labels -100 on padding, AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner import batching

    device = torch.device(ctx.device)
    model = AutoModelForCausalLM.from_pretrained(model_folder(ctx), dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)  # transformers' Trainer's default optimizer
    lengths = [len(s.tokens) for s in batch]
    parts = batching.partition(lengths, 1, ctx.shapes.max_tokens_per_rank)[0]
    rows = [padded_rows([batch[i].tokens for i in part], device) for part in parts]

    def step(_batch) -> None:
        for input_ids, labels in rows:
            with torch.autocast(ctx.device, dtype=torch.bfloat16, enabled=ctx.device == "cuda"):
                out = model(input_ids=input_ids, labels=labels, use_cache=False)
            out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in model.parameters())
    return timed(ctx, step, batch, step_flops(ctx, params, lengths, "sft"))


def padded_rows(sequences: list[list[int]], device):
    import torch

    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences], device=device)
    labels = torch.tensor([s + [-100] * (width - len(s)) for s in sequences], device=device)
    return ids, labels


def steps_summary(result: dict) -> str:
    def mfu(key: str) -> str:
        row = result.get(key, {})
        return f"{row['mfu']:.1%}" if "mfu" in row else "err"

    modes = ", ".join(f"{m} sft {mfu(m + '.sft')} rl {mfu(m + '.rl')}" for m in ("packed", "padded", "varlen"))
    return f"MFU: {modes}; plain transformers {mfu('plain_transformers')}"


def memory(ctx: Context) -> None:
    """One SFT step per row length and mode, sequences of `row_sequence_tokens` each."""
    import torch

    init_group(ctx.device)
    shapes = ctx.shapes
    trainer = make_trainer(ctx, "bfloat16", max(shapes.rows))
    params = sum(p.numel() for p in trainer.model.parameters())
    rng = random.Random(3)
    line = []
    for row_tokens in shapes.rows:
        n, s = row_tokens // shapes.row_sequence_tokens, shapes.row_sequence_tokens
        batch = make_samples(rng, n, (s, s), shapes.model["vocab_size"])
        for mode in ("packed", "padded", "varlen"):
            use_mode(trainer, mode, row_tokens)
            ctx.attempt(f"{row_tokens}.{mode}", lambda: one_step(ctx, trainer, batch, params))
        gib = [ctx.result[f"{row_tokens}.{m}"].get("peak_memory_gib") for m in ("packed", "padded", "varlen")]
        line.append(f"{row_tokens}: " + "/".join("-" if g is None else f"{g:.1f}" for g in gib))
    ctx.put("summary", "peak GiB packed/padded/varlen per row tokens: " + ", ".join(line))
    torch.distributed.destroy_process_group()


def one_step(ctx: Context, trainer, batch: list, params: int) -> dict:
    free_device_memory(ctx.device)
    start_memory(ctx.device)
    synchronize(ctx.device)
    started = time.perf_counter()
    trainer.sft_step(batch)
    synchronize(ctx.device)
    lengths = [len(s.tokens) for s in batch]
    return measured(ctx, time.perf_counter() - started, sum(lengths), step_flops(ctx, params, lengths, "sft"))


def weights(ctx: Context) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from learner import policy
    from services import weight_group

    dtype = "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(model_folder(ctx), dtype=torch.bfloat16).to(ctx.device)
    tensors = {name: p.detach() for name, p in model.named_parameters()}
    specs = policy.parameter_specs(model, dtype)
    ctx.put("bytes", sum(t.numel() * t.element_size() for t in tensors.values()))
    line = []
    for mib in ctx.shapes.bucket_mib:
        buckets = weight_group.plan_buckets(specs, mib << 20)
        if ctx.device == "cuda":
            ctx.attempt(f"nccl_one_rank.{mib}mib", lambda: nccl_one_rank(ctx, buckets, tensors))
            ctx.attempt(f"cuda_ipc_two_process.{mib}mib", lambda: cuda_ipc_two_process(buckets, tensors))
        ctx.attempt(f"gloo_two_process.{mib}mib", lambda: gloo_two_process(ctx, buckets, tensors))
        line += [f"{k}: {v.get('gb_per_s', 'err')} GB/s" for k, v in ctx.result.items() if k.endswith(f".{mib}mib")]
    if ctx.device != "cuda":
        ctx.put("nccl_one_rank", "skipped: NCCL needs CUDA")
        ctx.put("cuda_ipc_two_process", "skipped: CUDA IPC needs CUDA")
    ctx.put("summary", "; ".join(line))


def nccl_one_rank(ctx: Context, buckets: list, tensors: dict) -> dict:
    """The bare ProcessGroupNCCL the sender opens, alone: its options, broadcast and wait."""
    from services import weight_group

    store = weight_group.host_store(free_port(), 60)
    group = weight_group.open_group(store, "nccl", 1, 0, 1, 60)
    buffers: list = [None, None]
    fetch = lambda bucket: {t.name: tensors[t.name] for t in bucket.tensors}  # noqa: E731
    rounds = []
    for _ in range(3):  # the first round creates the communicator
        synchronize(ctx.device)
        started = time.perf_counter()
        sent = weight_group.send_buckets(group, buckets, fetch, 60, ctx.device, buffers)
        synchronize(ctx.device)
        rounds.append(time.perf_counter() - started)
    return {"buckets": len(buckets), "bytes": sent, "seconds": rounds, "gb_per_s": round(sent / min(rounds) / 1e9, 2)}


def gloo_two_process(ctx: Context, buckets: list, tensors: dict) -> dict:
    """Tandem's send_buckets/receive_buckets over gloo with buffers on the device, to a
    second process: a learner and an engine sharing a GPU would need this path. The
    receiver's checksum of what it got must equal the sender's of what it sent."""
    import torch.multiprocessing as mp

    from services import weight_group

    port = free_port()
    store = weight_group.host_store(port, 60)
    spawn = mp.get_context("spawn")
    sums = spawn.Queue()
    receiver = spawn.Process(target=gloo_receiver, args=(port, buckets, ctx.device, 2, sums))
    receiver.start()
    group = weight_group.open_group(store, "gloo", 1, 0, 2, 60)
    fetch = lambda bucket: {t.name: tensors[t.name] for t in bucket.tensors}  # noqa: E731
    buffers: list = [None, None]
    rounds, received = [], []
    for _ in range(2):
        started = time.perf_counter()
        sent = weight_group.send_buckets(group, buckets, fetch, 60, ctx.device, buffers)
        received.append(sums.get(timeout=60))
        rounds.append(time.perf_counter() - started)
    receiver.join(timeout=30)
    expected = checksum([(t.name, tensors[t.name]) for b in buckets for t in b.tensors])
    if not all(math.isclose(r, expected, rel_tol=1e-9) for r in received):
        raise AssertionError(f"receiver checksum {received} != sender's {expected}")
    return {"buckets": len(buckets), "bytes": sent, "seconds": rounds, "gb_per_s": round(sent / min(rounds) / 1e9, 2)}


def cuda_ipc_two_process(buckets: list, tensors: dict, rounds: int = 2) -> dict:
    """The same-GPU path Tandem does not take yet, measured against gloo's: each bucket
    packed into a GPU buffer whose CUDA IPC handle goes to a second process
    (torch.multiprocessing shares a CUDA tensor by handle), which copies it into buffers of
    its own. The sender keeps a round's buffers alive until the receiver's checksum is back."""
    import torch
    import torch.multiprocessing as mp

    spawn = mp.get_context("spawn")
    handles, sums = spawn.Queue(), spawn.Queue()
    receiver = spawn.Process(target=cuda_ipc_receiver, args=(buckets, rounds, handles, sums))
    receiver.start()
    seconds, received, sent = [], [], 0
    for _ in range(rounds):
        torch.cuda.synchronize()
        started = time.perf_counter()
        held = []
        for bucket in buckets:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device="cuda")
            for spec in bucket.tensors:
                data = tensors[spec.name].contiguous().view(-1).view(torch.uint8)
                buf[spec.offset : spec.offset + spec.nbytes].copy_(data)
            torch.cuda.synchronize()  # packed before the other process reads it
            handles.put(buf)
            held.append(buf)
        received.append(sums.get(timeout=60))
        seconds.append(time.perf_counter() - started)
        sent = sum(b.nbytes for b in buckets)
    receiver.join(timeout=30)
    expected = checksum([(t.name, tensors[t.name]) for b in buckets for t in b.tensors])
    if not all(math.isclose(r, expected, rel_tol=1e-9) for r in received):
        raise AssertionError(f"receiver checksum {received} != sender's {expected}")
    return {"buckets": len(buckets), "bytes": sent, "seconds": seconds, "gb_per_s": round(sent / min(seconds) / 1e9, 2)}


def cuda_ipc_receiver(buckets: list, rounds: int, handles, sums) -> None:
    import torch

    from services import weight_group

    torch.cuda.set_device(0)
    own: list = [None] * len(buckets)
    for _ in range(rounds):
        pairs = []
        for i, bucket in enumerate(buckets):
            shared = handles.get(timeout=60)
            if own[i] is None:
                own[i] = torch.empty_like(shared)
            own[i].copy_(shared)
            del shared
            pairs += weight_group.unpack(bucket, own[i])
        torch.cuda.synchronize()
        sums.put(checksum(pairs))


def gloo_receiver(port: int, buckets: list, device: str, rounds: int, sums) -> None:
    from services import weight_group

    if device == "cuda":
        import torch

        torch.cuda.set_device(0)
    store = weight_group.connect_store("127.0.0.1", port, 60)
    group = weight_group.open_group(store, "gloo", 1, 1, 2, 60)
    buffers: list = []
    for _ in range(rounds):
        sums.put(checksum(weight_group.receive_buckets(group, buckets, 60, device, buffers)))


def checksum(pairs: list) -> float:
    """Sum of every tensor's float64 sum, in order: equal on both sides iff the bytes came through."""
    return sum(float(t.double().sum()) for _, t in pairs)


def tests_gpu(ctx: Context) -> None:
    folder = ROOT / "tests" / "gpu"
    if not folder.is_dir():
        raise Skip("tests/gpu does not exist")
    # Only tests/gpu's own conftest: the root one imports redis, which the GPU machine lacks.
    cmd = [sys.executable, "-m", "pytest", str(folder), "-q", f"--confcutdir={folder}", "-p", "no:cacheprovider"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=ctx.shapes.timeouts_s["tests_gpu"] - 5)
    print(done.stdout, done.stderr, sep="\n")
    tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    ctx.put("returncode", done.returncode)
    ctx.put("summary", tail[0][:200])
    if done.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest tests/gpu exited {done.returncode}: {tail[0]}")


SECTIONS = {
    "versions": versions,
    "matmul": matmul,
    "packing": packing,
    "steps": steps,
    "memory": memory,
    "weights": weights,
    "tests_gpu": tests_gpu,
}


# ---- the two sides: a section process, and the run that starts them -------------------


def run_here(args: argparse.Namespace) -> int:
    """In a section process: run its sections in order, each leaving its figures, status
    and seconds in `<work>/<name>.json` (status `running` until it ends)."""
    for name in args.section:
        ctx = Context(args.device, SHAPES[args.shape], Path(args.work), Path(args.work) / f"{name}.json")
        run_section_here(ctx, name)
    return 0


def run_section_here(ctx: Context, name: str) -> None:
    ctx.put("status", "running")
    started = time.perf_counter()
    try:
        SECTIONS[name](ctx)
        ctx.put("status", "partial" if ctx.result.get("failures") else "ok")
    except Skip as reason:
        ctx.put("status", "skip")
        ctx.put("reason", str(reason))
    except Exception as error:  # noqa: BLE001 - the next section in this process still runs
        traceback.print_exc()
        ctx.put("status", "error")
        ctx.put("error", f"{type(error).__name__}: {str(error)[:300]}")
    finally:
        leave_group()
        ctx.put("seconds", round(time.perf_counter() - started, 1))


def leave_group() -> None:
    """A section that failed midway leaves its group; the next one in the process opens its own."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_all(args: argparse.Namespace) -> int:
    shapes = SHAPES[args.shape]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    deadline = time.monotonic() + shapes.budget_s
    groups = [args.sections] if args.device == "cpu" else [[name] for name in args.sections]
    rows = []
    try:
        with open(out / "gpu_check.log", "a") as log:
            for group in groups:
                timeout_s = min(sum(shapes.timeouts_s[name] for name in group), deadline - time.monotonic())
                for row in run_group(group, args, work, timeout_s, log):
                    with open(out / "gpu_check.jsonl", "a") as jsonl:
                        jsonl.write(json.dumps(row, default=str) + "\n")
                    rows.append(row)
                    print(f"{row['section']}: {row['status']} in {row['seconds']} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    return 0 if all(r["status"] in ("ok", "skip") for r in rows) else 1


def run_group(names: list[str], args: argparse.Namespace, work: Path, timeout_s: float, log) -> list[dict]:
    """Sections in one process of their own process group (killed whole at the timeout: a
    section's own children, the gloo receiver, go with it); a row per section. The section
    it was in when killed or crashed is a timeout or an error, with the log's tail; those
    after it were not reached."""
    base = {"device": args.device, "shape": args.shape}
    if timeout_s < 5:
        return [
            {"section": n} | base | {"status": "timeout", "seconds": 0.0, "reason": "no time left in the run's budget"}
            for n in names
        ]
    cmd = [sys.executable, "-m", "bench.gpu_check", "--section", ",".join(names), "--device", args.device]
    cmd += ["--shape", args.shape]
    cmd += ["--work", str(work)]
    log.write(f"==== {', '.join(names)} (timeout {timeout_s:.0f} s)\n")
    log.flush()
    offset = log.tell()
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        returncode = None
    wall_s = time.perf_counter() - started
    ended = "timeout" if returncode is None else "error"
    rows = []
    for name in names:
        result_file = work / f"{name}.json"
        row = {"section": name} | base | (json.loads(result_file.read_text()) if result_file.exists() else {})
        if "status" not in row:
            row |= {"status": ended, "seconds": 0.0, "reason": "not reached: its process ended first"}
        elif row["status"] == "running":
            row["status"] = ended
            row["seconds"] = round(wall_s - sum(r["seconds"] for r in rows), 1)
        if row["status"] == "error":
            row["log_tail"] = log_tail(log.name, offset)
        rows.append(row)
    return rows


def log_tail(path: str, offset: int, lines: int = 15) -> str:
    with open(path) as f:
        f.seek(offset)
        return "\n".join(f.read().splitlines()[-lines:])


def print_table(rows: list[dict]) -> None:
    print(f"\n{'section':<10} {'status':<8} {'seconds':>7}  summary")
    for row in rows:
        summary = (
            row.get("summary")
            or row.get("reason")
            or row.get("error")
            or row.get("log_tail", "").splitlines()[-1:]
            or ""
        )
        if isinstance(summary, list):
            summary = summary[0] if summary else ""
        print(f"{row['section']:<10} {row['status']:<8} {row['seconds']:>7}  {summary}")
        for key in row.get("failures", []):
            print(f"{'':<28}{key}: {row[key]['error']}")


def section_names(text: str) -> list[str]:
    """Comma-separated section names, returned in the order the sections run."""
    names = text.split(",")
    unknown = [name for name in names if name not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    return [name for name in SECTIONS if name in names]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--shape", choices=tuple(SHAPES), help="model and workload (default: smollm2-135m on cuda, tiny on cpu)"
    )
    parser.add_argument("--sections", type=section_names, default=list(SECTIONS), help="comma-separated (default: all)")
    parser.add_argument("--out", default="bench/out/gpu_check")
    parser.add_argument("--section", type=section_names, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.shape = args.shape or DEFAULT_SHAPE[args.device]
    return run_here(args) if args.section else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
