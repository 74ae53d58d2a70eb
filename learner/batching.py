"""Split a batch of sequences across data-parallel ranks and micro-batches.

Sequences are assigned by the Karmarkar-Karp largest differencing method, generalised to
k partitions: every rank gets nearly the same number of tokens, so no rank idles while a
long-tailed conversation finishes on another. The number of partitions k is the smallest
multiple of the data-parallel size whose partitions all fit `max_tokens_per_rank`; rank r
processes partitions r, r + dp, r + 2 dp, ... as micro-batches. Each micro-batch is packed
into one row without padding, with position ids restarting at every sequence.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

Subsets = list[tuple[int, list[int]]]
"""k (sum of lengths, indices) subsets: one tuple of the differencing method."""


def karmarkar_karp(lengths: list[int], k: int) -> list[list[int]]:
    """Partition indices of `lengths` into k sets with nearly equal sums.

    Each item starts as a k-tuple of subsets (itself in one, the rest empty). Repeatedly
    merge the two tuples with the largest spread (max sum - min sum), pairing the largest
    subset of one with the smallest of the other, which cancels their differences."""
    if k < 1:
        raise ValueError("k must be >= 1")
    counter = itertools.count()
    heap: list[tuple[int, int, Subsets]] = []  # (-spread, tie-break, subsets)
    for index in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        subsets: Subsets = [(lengths[index], [index])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-lengths[index], next(counter), subsets))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: s[0], reverse=True)
        b = sorted(b, key=lambda s: s[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        spread = max(s for s, _ in merged) - min(s for s, _ in merged)
        heapq.heappush(heap, (-spread, next(counter), merged))
    _, _, subsets = heap[0]
    return sorted((sorted(indices) for _, indices in subsets), key=lambda p: (len(p) == 0, p))


def round_robin(lengths: list[int], k: int) -> list[list[int]]:
    """The naive baseline: sequence i goes to partition i mod k."""
    return [list(range(len(lengths)))[r::k] for r in range(k)]


def partition(
    lengths: list[int],
    dp_size: int,
    max_tokens_per_rank: int,
    split: Callable[[list[int], int], list[list[int]]] = karmarkar_karp,
    padded: bool = False,
) -> list[list[list[int]]]:
    """Per rank, its micro-batches (lists of sequence indices).

    k grows in steps of `dp_size` until every partition `split` makes fits under
    `max_tokens_per_rank` (`round_robin` is the benchmark's baseline). A `padded`
    micro-batch (a row per sequence, each padded to the longest) costs its rows times its
    longest sequence: that many positions go through the model."""
    if any(n > max_tokens_per_rank for n in lengths):
        longest = max(lengths)
        raise ValueError(f"a sequence of {longest} tokens exceeds max_tokens_per_rank={max_tokens_per_rank}")
    if padded:
        cost = lambda part: padded_positions([lengths[i] for i in part])  # noqa: E731
    else:
        cost = lambda part: sum(lengths[i] for i in part)  # noqa: E731
    k = dp_size
    while True:
        parts = split(lengths, k)
        if all(cost(p) <= max_tokens_per_rank for p in parts):
            break
        k += dp_size
    return [parts[rank::dp_size] for rank in range(dp_size)]


def padded_positions(lengths: list[int]) -> int:
    """Positions a padded micro-batch of sequences of `lengths` puts through the model."""
    return len(lengths) * max(lengths, default=0)


def imbalance(lengths: list[int], parts: list[list[int]]) -> float:
    """max partition tokens / mean partition tokens (1.0 is perfect balance)."""
    sums = [sum(lengths[i] for i in p) for p in parts]
    mean = sum(sums) / len(sums)
    return max(sums) / mean if mean else 1.0


def pack(sequences: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """Concatenate sequences into one row: (token ids, position ids restarting at 0 for each
    sequence, the sequence index of every token)."""
    tokens: list[int] = []
    positions: list[int] = []
    seq_ids: list[int] = []
    for index, seq in enumerate(sequences):
        tokens += seq
        positions += range(len(seq))
        seq_ids += [index] * len(seq)
    return tokens, positions, seq_ids
