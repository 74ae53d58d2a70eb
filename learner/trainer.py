"""The policy under FSDP2: logprobs, the RL step, the SFT step.

Every rank holds the whole batch (it is small: token ids and scalars) and takes its own
micro-batches from the same deterministic partition (`learner.batching`). Losses are
divided by global counts and multiplied by the data-parallel size, because FSDP averages
gradients over ranks: the update is the same for any split of the batch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from learner import batching, loss
from services.config import JobSpec
from services.protocol import Sample

log = logging.getLogger(__name__)

COUNTS = loss.COUNTS | {"skipped_updates"}
"""Metrics that are counts: summed across ranks and minibatches, never divided by tokens."""


@dataclass
class MicroBatch:
    """One packed row (or padded rows, when the model cannot pack) on one rank."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    """[T] sequence index (within the micro-batch) of every token of the flattened rows."""
    keep: torch.Tensor
    """[T] bool, False on padding: selects real tokens out of the flattened rows."""
    samples: list[int]
    """Indices into the step's batch."""


class Trainer:
    def __init__(self, spec: JobSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        torch.manual_seed(spec.train.seed)
        self.model = self.setup_model(spec.model.local_folder())
        self.reference: torch.nn.Module | None = None
        warm = spec.warm_start
        self.optimizer, self.scheduler = self.setup_optimizer(warm.lr if warm.steps else spec.train.lr,
                                                              decay_steps=warm.steps)
        self.can_pack = self.probe_packing()

    def setup_model(self, path: str) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mixed = None
        if self.device.type == "cuda" and self.spec.model.dtype == "bfloat16":
            mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mesh": mesh} | ({"mp_policy": mixed} if mixed else {})
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def start_rl(self) -> None:
        """End of the warm start: a fresh optimizer at the RL learning rate, and the current
        policy frozen as the KL reference (same sharding: the shards copy over locally)."""
        self.optimizer, self.scheduler = self.setup_optimizer(self.spec.train.lr)
        if self.spec.train.kl_coef > 0:
            self.reference = self.setup_model(self.spec.model.path)
            self.reference.load_state_dict(self.model.state_dict())
            self.reference.requires_grad_(False)

    def setup_optimizer(self, lr: float, decay_steps: int = 0):
        """AdamW over the sharded (DTensor) parameters (build it only while sharded), with a
        learning rate that decays linearly to 10% over `decay_steps` (the warm start, so the
        policy RL starts from is settled) or stays constant (RL)."""
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=self.spec.train.weight_decay,
                                      betas=(0.9, 0.99))
        decay = (lambda step: max(0.1, 1.0 - step / decay_steps)) if decay_steps else (lambda step: 1.0)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, decay)

    def probe_packing(self) -> bool:
        """Whether this model's attention keeps packed sequences apart (transformers does so
        from restarting position ids with sdpa/eager/flash); padding is used otherwise."""
        generator = torch.Generator().manual_seed(0)
        vocab = self.model.config.vocab_size
        a, b = (torch.randint(0, vocab, (1, n), generator=generator).to(self.device) for n in (5, 4))
        with torch.no_grad():
            alone = self._logits(b, torch.arange(4, device=self.device)[None])
            both = self._logits(torch.cat([a, b], 1), torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]], device=self.device))
        self.model.reshard()
        ok = torch.allclose(alone, both[:, 5:], atol=1e-3)
        if not ok:
            log.warning("model attention does not separate packed sequences: padding instead")
        return ok

    def _logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    # ---- batches -------------------------------------------------------------------

    def micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """This rank's micro-batches for `samples` (same partition on every rank)."""
        lengths = [len(s.tokens) for s in samples]
        mine = batching.partition(lengths, self.world_size, self.spec.train.max_tokens_per_rank)[self.rank]
        return [self._collate(samples, indices) for indices in mine]

    def _collate(self, samples: list[Sample], indices: list[int]) -> MicroBatch:
        sequences = [samples[i].tokens for i in indices] or [[0]]  # an empty share still runs
        if self.can_pack:
            tokens, positions, seq_ids = batching.pack(sequences)
            rows, pos_rows, keep = [tokens], [positions], [True] * len(tokens)
        else:
            width = max(map(len, sequences))
            rows = [s + [0] * (width - len(s)) for s in sequences]
            pos_rows = [list(range(width)) for _ in sequences]
            keep = [j < len(s) for s in sequences for j in range(width)]
            seq_ids = [i for i, s in enumerate(sequences) for _ in s]
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return MicroBatch(as_long(rows), as_long(pos_rows), as_long(seq_ids),
                          torch.tensor(keep, device=self.device), list(indices))

    def _token_tensor(self, samples: list[Sample], micro: MicroBatch, field: str) -> torch.Tensor:
        values = [v for i in micro.samples for v in getattr(samples[i], field)] or [0]
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def token_logprobs(self, micro: MicroBatch, model: torch.nn.Module | None = None,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T] logprob of each token given the ones before it in its sequence (0 for a
        sequence's first token, which is always context), at the rollout temperature."""
        model = model or self.model
        logits = model(input_ids=micro.input_ids, position_ids=micro.position_ids, use_cache=False).logits
        logits = logits.float() / self.spec.rollout.temperature
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        picked = logp.gather(-1, micro.input_ids[:, 1:, None]).squeeze(-1)
        picked = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1).flatten()[micro.keep]
        entropy = None
        if with_entropy:
            with torch.no_grad():
                ent = loss.entropy_from_logits(logits[:, :-1])
                entropy = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1).flatten()[micro.keep]
        return picked, entropy

    # ---- steps ---------------------------------------------------------------------

    def rl_step(self, samples: list[Sample]) -> dict[str, float]:
        """Decoupled PPO on one batch: proximal logprobs first, then `num_minibatches`
        optimizer steps. Returns metrics averaged over trained tokens (all ranks), maxima
        as maxima."""
        chunks = _split(len(samples), self.spec.train.num_minibatches)
        plans = [[samples[i] for i in chunk] for chunk in chunks]
        with torch.no_grad():
            prox = [[self.token_logprobs(m)[0] for m in self.micro_batches(p)] for p in plans]
            ref = ([[self.token_logprobs(m, self.reference)[0] for m in self.micro_batches(p)] for p in plans]
                   if self.reference is not None else None)
        # A forward without backward leaves the root module unsharded; reshard so the
        # optimizer (which holds the sharded parameters) and the next forward agree.
        self.model.reshard()
        if self.reference is not None:
            self.reference.reshard()
        return merge_minibatches([self._rl_minibatch(plan, prox[k], ref[k] if ref else None)
                                  for k, plan in enumerate(plans)])

    def _rl_minibatch(self, samples: list[Sample], prox: list[torch.Tensor],
                      ref: list[torch.Tensor] | None) -> dict[str, float]:
        micro = self.micro_batches(samples)
        num_tokens = sum(sum(s.mask) for s in samples)
        normaliser = loss.normaliser(self.spec.train, num_tokens, len(samples))
        totals: dict[str, torch.Tensor] = {"entropy": torch.zeros((), device=self.device)}
        for i, mb in enumerate(micro):
            theta, entropy = self.token_logprobs(mb, with_entropy=True)
            mask = self._token_tensor(samples, mb, "mask")
            advantages = torch.cat([
                torch.full((len(samples[j].tokens),), samples[j].advantage, device=self.device)
                for j in mb.samples
            ]) if mb.samples else torch.zeros(1, device=self.device)
            inputs = loss.LossInputs(
                theta=theta, prox=prox[i], mu=self._token_tensor(samples, mb, "logprobs"),
                advantages=advantages, mask=mask, seq_ids=mb.seq_ids, num_seqs=max(len(mb.samples), 1),
                ref=ref[i] if ref else None,
            )
            out = loss.policy_loss(inputs, self.spec.train, normaliser)
            (out.loss * self.world_size).backward()
            accumulate(totals, {"loss": out.loss.detach()} | out.metrics)
            totals["entropy"] += (entropy * mask).sum()
        grad_norm, stepped = self._optimizer_step()
        reduced = self._reduce_over_ranks(totals)
        metrics = {name: value if name in COUNTS | loss.MAXIMA else value / max(num_tokens, 1)
                   for name, value in reduced.items() if name != "loss"}
        metrics |= {"loss": reduced["loss"], "grad_norm": grad_norm, "skipped_updates": float(not stepped)}
        return metrics

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """Masked cross-entropy on assistant tokens (the warm start)."""
        num_tokens = sum(sum(s.mask) for s in samples)
        total = torch.zeros((), device=self.device)
        for mb in self.micro_batches(samples):
            theta, _ = self.token_logprobs(mb)
            step_loss = loss.sft_loss(theta, self._token_tensor(samples, mb, "mask"), max(num_tokens, 1))
            (step_loss * self.world_size).backward()
            total += step_loss.detach()
        grad_norm, _ = self._optimizer_step()
        return {"sft_loss": self._all_reduce({"loss": total})["loss"], "grad_norm": grad_norm}

    def _optimizer_step(self) -> tuple[float, bool]:
        return optimizer_step(self.model, self.optimizer, self.scheduler, self.spec.train.max_grad_norm)

    def _reduce_over_ranks(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        """All ranks' totals combined: maxima by max, the rest by sum."""
        maxima = {name: value for name, value in totals.items() if name in loss.MAXIMA}
        sums = {name: value for name, value in totals.items() if name not in maxima}
        return self._all_reduce(sums) | self._all_reduce(maxima, dist.ReduceOp.MAX)

    def _all_reduce(self, values: dict[str, torch.Tensor],
                    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> dict[str, float]:
        names = sorted(values)
        packed = torch.stack([torch.as_tensor(values[n], dtype=torch.float64, device=self.device) for n in names])
        dist.all_reduce(packed, op=op)
        return dict(zip(names, packed.tolist()))

    # ---- weights -------------------------------------------------------------------

    def parameter_specs(self, dtype: str) -> list[tuple[str, list[int], str]]:
        """(checkpoint name, full shape, wire dtype) of every parameter, in a fixed order."""
        return [(name, list(p.shape), dtype) for name, p in self.model.named_parameters()]

    def full_tensors(self, names: list[str], dtype: str) -> dict[str, torch.Tensor]:
        """Gather full tensors of `names` from their shards (a collective: all ranks call it)."""
        params = dict(self.model.named_parameters())
        wire = getattr(torch, dtype)
        out = {}
        for name in names:
            p = params[name].detach()
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.to(wire)
        return out

    def export(self, out_dir: str) -> None:
        """Save the policy as a Hugging Face folder (rank 0 writes; all ranks must call)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            from pathlib import Path

            from safetensors.torch import save_file
            from transformers import AutoConfig, AutoTokenizer

            Path(out_dir).mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, f"{out_dir}/model.safetensors")
            AutoConfig.from_pretrained(self.spec.model.path).save_pretrained(out_dir)
            AutoTokenizer.from_pretrained(self.spec.model.path).save_pretrained(out_dir)
            generation = Path(self.spec.model.path) / "generation_config.json"
            if generation.exists():
                (Path(out_dir) / generation.name).write_text(generation.read_text())


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, max_grad_norm: float) -> tuple[float, bool]:
    """Clip the gradient and step, unless it is exactly zero; returns (norm before
    clipping, stepped). A zero gradient (every advantage of the batch 0, no KL term) is no
    reason to move, yet AdamW would: its momentum carries the last real update on, about ten
    updates' worth with beta1 = 0.9, so a policy whose groups have no spread would keep
    drifting the way it last went. The norm is global (all ranks), so all ranks agree."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    stepped = grad_norm != 0.0
    if stepped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def accumulate(totals: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    """Add one micro-batch's metrics into a rank's running totals: maxima by max, the rest
    by sum."""
    for name, value in metrics.items():
        if name not in totals:
            totals[name] = value
        elif name in loss.MAXIMA:
            totals[name] = torch.maximum(totals[name], value)
        else:
            totals[name] = totals[name] + value


def merge_minibatches(stats: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its minibatches': the mean of each, the max of maxima, the
    sum of counts."""
    def merge(name: str) -> float:
        values = [s[name] for s in stats]
        if name in loss.MAXIMA:
            return max(values)
        return sum(values) if name in COUNTS else sum(values) / len(values)

    return {name: merge(name) for name in stats[0]}


def _split(n: int, parts: int) -> list[list[int]]:
    """Indices 0..n-1 in `parts` contiguous chunks of near-equal size (no empty chunk)."""
    parts = min(parts, n)
    size = math.ceil(n / parts)
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
