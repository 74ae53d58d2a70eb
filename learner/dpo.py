"""The DPO step, a part of `learner.trainer.Trainer` kept in its own module: preference
pairs against the frozen reference, whose sequence logprobs are remembered per sample
(`Trainer.reference_logprobs`) so a pair trained again (offline epochs) is not scored by
the reference again. It uses the trainer's batches, logprobs and optimizer step."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from learner import loss
from learner.micro_batch import Collator, MicroBatch
from learner.policy import reshard
from learner.reduce import accumulate, all_reduce
from services.config import JobSpec
from services.protocol import Sample


class _Trainer(Protocol):
    """What the DPO step uses of `learner.trainer.Trainer`, its host class."""

    spec: JobSpec
    device: torch.device
    world_size: int
    batches: Collator
    reference: torch.nn.Module | None
    reference_logprobs: dict[str, float]

    def token_logprobs(
        self,
        micro: MicroBatch,
        model: torch.nn.Module | None = None,
        with_entropy: bool = False,
        scored: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def _optimizer_step(self, loss_sum: float) -> dict[str, float]: ...

    def _reference_logprobs(self, samples: list[Sample], micro: list[MicroBatch]) -> torch.Tensor: ...


class DPOSteps:
    def dpo_step(self: _Trainer, samples: list[Sample]) -> dict[str, float]:
        """One DPO optimizer step on preference pairs (`samples` alternate chosen, rejected;
        each pair sits whole in one micro-batch). Returns metrics per pair over all ranks."""
        micro = self.batches.pair_micro_batches(samples)
        reference = self._reference_logprobs(samples, micro)
        num_pairs = len(samples) // 2
        spec = self.spec.train
        totals: dict[str, torch.Tensor] = {}
        for mb in micro:
            mask = self.batches.per_token(samples, mb, "mask")
            theta, _ = self.token_logprobs(mb, scored=mask)
            if not mb.samples:  # an empty share still runs forward and backward with the others
                (theta.sum() * 0.0).backward()
                continue
            policy = loss.sequence_logprobs(theta, mask, mb.seq_ids, len(mb.samples))
            ref = reference[mb.samples]
            out = loss.dpo_loss(
                policy[0::2], policy[1::2], ref[0::2], ref[1::2], spec.dpo_beta, spec.dpo_loss, max(num_pairs, 1)
            )
            (out.loss * self.world_size).backward()
            accumulate(totals, {"loss": out.loss.detach()} | out.metrics)
        # Every rank reduces every name, whether or not its share had pairs.
        names = ("loss", *loss.DPO_METRICS)
        reduced = all_reduce({name: totals.get(name, torch.zeros(())) for name in names}, self.device)
        update = self._optimizer_step(reduced["loss"])
        metrics = {
            name: value if name in ("loss", "pairs") else value / max(num_pairs, 1) for name, value in reduced.items()
        }
        return metrics | update

    def _reference_logprobs(self: _Trainer, samples: list[Sample], micro: list[MicroBatch]) -> torch.Tensor:
        """[N] each sample's sequence logprob under the reference. Samples not seen before
        are scored by the rank that trains them and shared with every rank (all ranks hold
        the same memory, so they agree on whether to score)."""
        if any(s.sample_id not in self.reference_logprobs for s in samples):
            if self.reference is None:
                raise RuntimeError("the DPO step scores against the reference: start_rl builds it")
            scored = torch.zeros(len(samples), dtype=torch.float64, device=self.device)
            with torch.no_grad():
                for mb in micro:
                    mask = self.batches.per_token(samples, mb, "mask")
                    logprobs, _ = self.token_logprobs(mb, self.reference, scored=mask)
                    if mb.samples:
                        scored[mb.samples] = loss.sequence_logprobs(
                            logprobs, mask, mb.seq_ids, len(mb.samples)
                        ).double()
            reshard(self.reference)
            dist.all_reduce(scored)  # each sample was scored on one rank, zero elsewhere
            if len(self.reference_logprobs) > 1_000_000:  # online pairs come once: forget the old
                self.reference_logprobs.clear()
            self.reference_logprobs |= {s.sample_id: value for s, value in zip(samples, scored.tolist())}
        return torch.tensor([self.reference_logprobs[s.sample_id] for s in samples], device=self.device)
