"""A step's samples -> this rank's micro-batches, as tensors on the training device.

Every rank holds the whole batch (token ids and scalars: small) and takes its own share
of the same deterministic partition (`learner.batching`). A micro-batch is one packed row,
position ids restarting at every sequence, or padded rows when the model's attention
cannot keep packed sequences apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner import batching
from services.protocol import Sample


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


class Collator:
    def __init__(
        self,
        rank: int,
        world_size: int,
        max_tokens_per_rank: int,
        can_pack: bool,
        device: torch.device,
        split=batching.karmarkar_karp,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.max_tokens_per_rank = max_tokens_per_rank
        self.can_pack = can_pack
        self.device = device
        self.split = split
        """How sequences are dealt to ranks and micro-batches (`batching.partition`)."""

    def micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """This rank's micro-batches for `samples` (same partition on every rank)."""
        lengths = [len(s.tokens) for s in samples]
        mine = self._partition(lengths)[self.rank]
        return [self.collate(samples, indices) for indices in mine]

    def pair_micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """Like `micro_batches` for preference pairs: `samples` alternate chosen, rejected;
        the partition deals whole pairs (balanced by the pair's tokens), so both sides of a
        pair sit in one micro-batch, chosen right before its rejected."""
        if len(samples) % 2:
            raise ValueError(f"preference pairs need an even number of samples, got {len(samples)}")
        sides = [(len(samples[i].tokens), len(samples[i + 1].tokens)) for i in range(0, len(samples), 2)]
        # Padded, a pair is two rows as wide as its longer side.
        lengths = [a + b if self.can_pack else 2 * max(a, b) for a, b in sides]
        mine = self._partition(lengths)[self.rank]
        return [self.collate(samples, [i for pair in pairs for i in (2 * pair, 2 * pair + 1)]) for pairs in mine]

    def _partition(self, lengths: list[int]) -> list[list[list[int]]]:
        padded = not self.can_pack
        return batching.partition(lengths, self.world_size, self.max_tokens_per_rank, self.split, padded)

    def collate(self, samples: list[Sample], indices: list[int]) -> MicroBatch:
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
        return MicroBatch(
            as_long(rows), as_long(pos_rows), as_long(seq_ids), torch.tensor(keep, device=self.device), list(indices)
        )

    def per_token(self, samples: list[Sample], micro: MicroBatch, field: str) -> torch.Tensor:
        """[T] a per-token field of the micro-batch's samples (mask, logprobs), as floats."""
        values = [v for i in micro.samples for v in getattr(samples[i], field)] or [0]
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def advantages(self, samples: list[Sample], micro: MicroBatch) -> torch.Tensor:
        """[T] each sample's advantage, repeated over its tokens."""
        if not micro.samples:
            return torch.zeros(1, device=self.device)
        return torch.cat(
            [torch.full((len(samples[j].tokens),), samples[j].advantage, device=self.device) for j in micro.samples]
        )
