"""Length-balanced partitioning and packing."""

from __future__ import annotations

import random

import pytest

from learner import batching


def sums(lengths, parts):
    return sorted(sum(lengths[i] for i in p) for p in parts)


def test_karmarkar_karp_splits_a_small_case_as_computed_by_hand():
    # Differencing 10,9 -> 1; 8,7 -> 1; 6,5 -> 1; 4 -> [4,1,1,1] -> 3 -> 2 -> 1: sums 25 / 24.
    assert sums([10, 9, 8, 7, 6, 5, 4], batching.karmarkar_karp([10, 9, 8, 7, 6, 5, 4], 2)) == [24, 25]


def test_every_index_lands_in_exactly_one_partition():
    lengths = [random.Random(0).randint(1, 500) for _ in range(101)]
    parts = batching.karmarkar_karp(lengths, 6)
    assert sorted(i for p in parts for i in p) == list(range(101))
    assert len(parts) == 6


def test_balanced_beats_round_robin_on_long_tailed_lengths():
    rng = random.Random(1)
    lengths = [int(rng.lognormvariate(5, 1.2)) + 1 for _ in range(256)]
    balanced = batching.imbalance(lengths, batching.karmarkar_karp(lengths, 8))
    naive = batching.imbalance(lengths, batching.round_robin(lengths, 8))
    assert balanced <= 1.05
    assert naive > balanced


def test_partition_grows_k_in_multiples_of_dp_until_every_partition_fits():
    lengths = [100] * 10
    per_rank = batching.partition(lengths, dp_size=2, max_tokens_per_rank=250)
    # 1000 tokens, <= 250 per micro-batch: k = 6 (k = 4 would need 300 in some partition).
    assert [len(micro) for micro in per_rank] == [3, 3]
    assert all(sum(lengths[i] for i in m) <= 250 for micro in per_rank for m in micro)


def test_a_sequence_longer_than_the_cap_is_an_error_naming_the_cap():
    with pytest.raises(ValueError, match="max_tokens_per_rank=50"):
        batching.partition([10, 60], dp_size=1, max_tokens_per_rank=50)


def test_fewer_sequences_than_partitions_leaves_empty_shares():
    per_rank = batching.partition([5], dp_size=2, max_tokens_per_rank=100)
    assert per_rank == [[[0]], [[]]]


def test_pack_restarts_positions_at_every_sequence():
    tokens, positions, seq_ids = batching.pack([[7, 8, 9], [4, 5]])
    assert tokens == [7, 8, 9, 4, 5]
    assert positions == [0, 1, 2, 0, 1]
    assert seq_ids == [0, 0, 0, 1, 1]


def test_weight_segments_send_big_tensors_alone_and_pack_small_runs_in_chunks():
    from services import weight_group
    from services.weight_group import CHUNK_BYTES, DIRECT_BYTES

    small, big = DIRECT_BYTES // 2, CHUNK_BYTES * 2  # float32 bytes
    specs = [("a", [small // 4], "float32"), ("b", [small // 4], "float32"), ("big", [big // 4], "float32")]
    specs += [(f"s{i}", [small // 4], "float32") for i in range(10)]  # 10 x 2 MiB: a 16 MiB piece + 4 MiB
    bucket = weight_group.plan_buckets(specs, 1 << 40)[0]
    offsets = {t.name: t.offset for t in bucket.tensors}

    parts = weight_group.segments(bucket)

    assert parts[0] == (0, 2 * small, None)  # a, b packed
    assert parts[1] == (offsets["big"], offsets["big"] + big, "big")  # straight from memory
    run_start, run_stop = offsets["s0"], offsets["s9"] + small
    assert parts[2:] == [(run_start, run_start + CHUNK_BYTES, None), (run_start + CHUNK_BYTES, run_stop, None)]
