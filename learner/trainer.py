"""The policy's training steps on one rank: logprobs, the RL step, the SFT step, the DPO step.

Every rank holds the whole batch (it is small: token ids and scalars) and takes its own
micro-batches from the same deterministic partition (`learner.micro_batch`). Losses are
divided by global counts and multiplied by the data-parallel size, because FSDP averages
gradients over ranks: the update is the same for any split of the batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from learner import logprobs, loss, policy
from learner.dpo import DPOSteps
from learner.micro_batch import Collator, MicroBatch
from learner.reduce import accumulate, all_reduce, reduce_over_ranks
from services.config import JobSpec
from services.protocol import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel

COUNTS = loss.COUNTS | {"skipped_updates", "nonfinite_updates"}
"""Metrics that are counts: summed across ranks and minibatches, never divided by tokens."""


class Trainer(DPOSteps):
    """One rank's share of the policy (`learner.policy`) and its steps on the batches the
    driver sends: logprobs, the RL step, the SFT step, and the DPO step (`learner.dpo`)."""

    def __init__(self, spec: JobSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dtype = spec.model.resolved_dtype(device.type == "cuda")
        """The weights' dtype on the wire and in vLLM (`ModelSpec.dtype`, auto decided)."""
        torch.manual_seed(spec.train.seed)
        self.model = self._sharded(spec.model.local_folder())
        self.reference: torch.nn.Module | None = None
        self.reference_logprobs: dict[str, float] = {}
        """DPO: sample id -> sequence logprob under the reference, so that a pair trained
        again (offline epochs) is not scored by the reference again."""
        warm = spec.warm_start
        self.optimizer, self.scheduler = policy.optimizer(
            self.model, warm.lr if warm.steps else spec.train.lr, spec.train.weight_decay, decay_steps=warm.steps
        )
        compute = policy.compute_dtype(device, self.dtype)
        packs = spec.train.packing != "padded"
        self.can_pack = packs and policy.separates_packed_sequences(self.model, device, compute)
        self.batches = Collator(self.rank, self.world_size, spec.train.max_tokens_per_rank, self.can_pack, device)

    def _sharded(self, path: str) -> PreTrainedModel:
        return policy.sharded_model(path, self.device, self.world_size, self.dtype, self.spec.train.packing)

    def start_rl(self) -> None:
        """End of the warm start: a fresh optimizer at the RL learning rate, and the current
        policy frozen as the KL reference (same sharding: the shards copy over locally)."""
        self.optimizer, self.scheduler = policy.optimizer(self.model, self.spec.train.lr, self.spec.train.weight_decay)
        if self.spec.train.kl_coef > 0 or self.spec.train.algorithm == "dpo":
            self.reference = self._sharded(self.spec.model.path)
            self.reference.load_state_dict(self.model.state_dict())
            self.reference.requires_grad_(False)

    def token_logprobs(
        self,
        micro: MicroBatch,
        model: torch.nn.Module | None = None,
        with_entropy: bool = False,
        scored: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T] logprob of each token of `micro` under `model` (the policy by default) at the
        rollout temperature, and optionally the entropy (`logprobs.micro_batch_logprobs`)."""
        model = model or self.model
        return logprobs.micro_batch_logprobs(model, micro, self.spec.rollout.temperature, with_entropy, scored)

    # ---- steps ---------------------------------------------------------------------

    def rl_step(self, samples: list[Sample]) -> dict[str, float]:
        """Decoupled PPO on one batch: proximal logprobs first, then `num_minibatches`
        optimizer steps. Returns metrics averaged over trained tokens (all ranks), maxima
        as maxima. The first minibatch's proximal logprobs are its own forward's, detached:
        no update has happened before it, so a separate forward would compute the same
        numbers (a quarter of an RL step with one minibatch)."""
        chunks = _split(len(samples), self.spec.train.num_minibatches)
        plans = [[samples[i] for i in chunk] for chunk in chunks]
        with torch.no_grad():
            micro = [self.batches.micro_batches(p) for p in plans]
            masks = [[self.batches.per_token(p, m, "mask") for m in plan] for p, plan in zip(plans, micro)]

            def scored(model: torch.nn.Module | None, first: int = 0) -> list[list[torch.Tensor] | None]:
                return [None] * first + [
                    [self.token_logprobs(m, model, scored=mask)[0] for m, mask in zip(plan, plan_masks)]
                    for plan, plan_masks in zip(micro[first:], masks[first:])
                ]

            prox = scored(self.model, first=1)
            ref = scored(self.reference) if self.reference is not None else None
        # A forward without backward leaves the root module unsharded; reshard so the
        # optimizer (which holds the sharded parameters) and the next forward agree.
        policy.reshard(self.model)
        if self.reference is not None:
            policy.reshard(self.reference)
        return merge_minibatches(
            [self._rl_minibatch(plan, prox[k], ref[k] if ref else None) for k, plan in enumerate(plans)]
        )

    def _rl_minibatch(
        self, samples: list[Sample], prox: list[torch.Tensor] | None, ref: list[torch.Tensor] | None
    ) -> dict[str, float]:
        """One optimizer step on `samples`; `prox` None: the weights have not changed since
        the step began, so each micro-batch's own logprobs are the proximal ones."""
        micro = self.batches.micro_batches(samples)
        num_tokens = sum(sum(s.mask) for s in samples)
        normaliser = loss.normaliser(self.spec.train, num_tokens, len(samples))
        totals: dict[str, torch.Tensor] = {"entropy": torch.zeros((), device=self.device)}
        for i, mb in enumerate(micro):
            mask = self.batches.per_token(samples, mb, "mask")
            theta, entropy = self.token_logprobs(mb, with_entropy=True, scored=mask)
            if entropy is None:
                raise RuntimeError("token_logprobs returned no entropy though asked for it")
            inputs = loss.LossInputs(
                theta=theta,
                prox=prox[i] if prox is not None else theta.detach(),
                mu=self.batches.per_token(samples, mb, "logprobs"),
                advantages=self.batches.advantages(samples, mb),
                mask=mask,
                seq_ids=mb.seq_ids,
                num_seqs=max(len(mb.samples), 1),
                ref=ref[i] if ref else None,
            )
            out = loss.policy_loss(inputs, self.spec.train, normaliser)
            (out.loss * self.world_size).backward()
            accumulate(totals, {"loss": out.loss.detach()} | out.metrics)
            totals["entropy"] += (entropy * mask).sum()
        reduced = reduce_over_ranks(totals, self.device)
        update = self._optimizer_step(reduced["loss"])
        metrics = {
            name: value if name in COUNTS | loss.MAXIMA else value / max(num_tokens, 1)
            for name, value in reduced.items()
            if name != "loss"
        }
        return metrics | {"loss": reduced["loss"]} | update

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """Masked cross-entropy on assistant tokens (the warm start)."""
        num_tokens = sum(sum(s.mask) for s in samples)
        total = torch.zeros((), device=self.device)
        for mb in self.batches.micro_batches(samples):
            mask = self.batches.per_token(samples, mb, "mask")
            theta, _ = self.token_logprobs(mb, scored=mask)
            step_loss = loss.sft_loss(theta, mask, max(num_tokens, 1))
            (step_loss * self.world_size).backward()
            total += step_loss.detach()
        sft_loss = all_reduce({"loss": total}, self.device)["loss"]
        return {"sft_loss": sft_loss} | self._optimizer_step(sft_loss)

    def _optimizer_step(self, loss_sum: float) -> dict[str, float]:
        """Clip and step (`policy.optimizer_step`) unless the gradient is zero
        (`skipped_updates`) or the loss or gradient is not finite (`nonfinite_updates`).
        `loss_sum` is the loss summed over ranks (not finite if any rank's is not) and the
        norm is global, so every rank skips together."""
        finite_loss = math.isfinite(loss_sum)
        grad_norm, stepped = policy.optimizer_step(
            self.model, self.optimizer, self.scheduler, self.spec.train.max_grad_norm, finite_loss
        )
        nonfinite = not (finite_loss and math.isfinite(grad_norm))
        return {
            "grad_norm": grad_norm,
            "skipped_updates": float(not stepped and not nonfinite),
            "nonfinite_updates": float(nonfinite),
        }

    def export(self, out_dir: str) -> None:
        """The policy as a Hugging Face folder (rank 0 writes; all ranks must call)."""
        policy.export(self.model, self.spec.model.path, out_dir, self.rank)


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
