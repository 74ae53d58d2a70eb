"""Packed rows give every sequence the logprobs it has alone: per attention path and dtype,
and the probe that decides whether a model may be trained packed at all."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from learner import attention, logprobs, policy
from learner.batching import pack

LENGTHS = (7, 13, 4)


def causal_lm(path, packing: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention.implementation(packing)
    )
    logprobs.attach(model)  # not sharded: FSDP's hooks are left out
    return model.eval()


def scored(model: torch.nn.Module, sequences: list[list[int]], positions: list[int] | None = None) -> torch.Tensor:
    ids = torch.tensor([sum(sequences, [])])
    positions = positions if positions is not None else pack(sequences)[1]
    method = getattr(model, logprobs.METHOD)
    with torch.no_grad():
        return method(ids, torch.tensor([positions]), torch.ones_like(ids, dtype=torch.bool), 0.7, False)[0][0]


def sequences_of(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("packing", ["varlen", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_packed_sequence_scores_as_it_does_alone(tiny_model, packing, dtype):
    model = causal_lm(tiny_model, packing, dtype)
    sequences = sequences_of(model.config.vocab_size)

    packed = scored(model, sequences)
    alone = torch.cat([scored(model, [s]) for s in sequences])

    tolerance = policy.packing_tolerance(dtype)
    assert (packed - alone).abs().max() <= tolerance
    # The first token of each sequence is context: nothing before it in its sequence.
    starts = [0, LENGTHS[0], LENGTHS[0] + LENGTHS[1]]
    assert packed[starts].tolist() == [0.0, 0.0, 0.0]


def test_the_packed_row_really_differs_when_sequences_are_not_kept_apart(tiny_model):
    """The comparison above can fail: the same row read as one long sequence (positions
    running on) scores the later sequences differently, by far more than the tolerance."""
    model = causal_lm(tiny_model, "varlen", torch.bfloat16)
    sequences = sequences_of(model.config.vocab_size)
    kept_apart = scored(model, sequences)
    run_on = scored(model, sequences, positions=list(range(sum(LENGTHS))))
    assert (kept_apart - run_on).abs().max() > 10 * policy.packing_tolerance(torch.bfloat16)


def test_varlen_and_the_dense_mask_agree_on_a_row_of_one_long_and_many_short(tiny_model):
    rng = random.Random(2)
    vocab = 64
    sequences = [[rng.randrange(3, vocab) for _ in range(n)] for n in (60, 3, 5, 2, 8, 4)]
    varlen = scored(causal_lm(tiny_model, "varlen", torch.float32), sequences)
    mask = scored(causal_lm(tiny_model, "mask", torch.float32), sequences)
    assert (varlen - mask).abs().max() <= 1e-5


def test_sequence_bounds_are_found_where_the_positions_restart():
    positions = torch.tensor([0, 1, 2, 0, 1, 0, 0, 1, 2, 3])
    assert attention.sequence_bounds(positions, 10).tolist() == [0, 3, 5, 6, 10]
    assert attention.sequence_bounds(None, 4).tolist() == [0, 4]


@pytest.mark.parametrize(
    "lengths",
    [
        [5, 1, 9, 4, 8, 4, 4],  # 9 and 8 share a padded call, 5 and 4 another, the last two 4s a run
        [4, 4, 4],  # one run: every gather is a view and the output is the row
        [3, 6],  # reordered, longest first
    ],
)
def test_varlen_attention_is_causal_attention_within_each_sequence(lengths):
    """Against SDPA on each sequence by itself, grouped-query heads included, values and
    gradients."""
    torch.manual_seed(0)
    query = torch.randn(1, 6, sum(lengths), 8, requires_grad=True)
    key, value = (torch.randn(1, 2, sum(lengths), 8, requires_grad=True) for _ in range(2))
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    weights = torch.randn(1, sum(lengths), 6, 8)

    out, _ = attention.varlen_attention(None, query, key, value, None, scaling=0.3, position_ids=positions)
    got = torch.autograd.grad((out * weights).sum(), (query, key, value))

    start, expected_total = 0, 0
    for n in lengths:
        q, k, v = (x[:, :, start : start + n] for x in (query, key, value))
        k, v = (x.repeat_interleave(3, dim=1) for x in (k, v))
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3).transpose(1, 2)
        torch.testing.assert_close(out[:, start : start + n], expected, rtol=1e-5, atol=1e-6)
        expected_total = expected_total + (expected * weights[:, start : start + n]).sum()
        start += n
    for g, e in zip(got, torch.autograd.grad(expected_total, (query, key, value))):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_sequences_share_a_call_while_padding_costs_at_most_a_quarter_more():
    spans = [(0, 5), (5, 6), (6, 15), (15, 19), (19, 27), (27, 31), (31, 35)]  # lengths 5 1 9 4 8 4 4
    # 9 and 8: 2 x 81 = 162 <= 1.25 x 145; adding 5 would cost 3 x 81 = 243 > 1.25 x 170.
    # 5 and 4: 2 x 25 = 50 <= 1.25 x 41; another 4: 3 x 25 = 75 > 1.25 x 57, a new group.
    # 1 with the 4s: 3 x 16 = 48 > 1.25 x 33.
    assert attention.length_groups(spans) == [
        [(6, 15), (19, 27)],
        [(0, 5), (15, 19)],
        [(27, 31), (31, 35)],
        [(5, 6)],
    ]


def test_varlen_attention_refuses_a_mask_it_would_ignore():
    x = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="takes no mask"):
        attention.varlen_attention(None, x, x, x, torch.ones(1, 1, 3, 3, dtype=torch.bool))


def leaky_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Causal attention over the whole row: a model whose attention ignores where packed
    sequences restart."""
    key, value = (x.repeat_interleave(query.shape[1] // x.shape[1], dim=1) for x in (key, value))
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_probe_packs_a_model_that_keeps_sequences_apart_in_its_dtype(tiny_model, process_group, dtype):
    model = policy.sharded_model(str(tiny_model), torch.device("cpu"), 1, dtype, "varlen")
    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model.to(compute)
    assert policy.separates_packed_sequences(model, torch.device("cpu"), compute)


def test_the_probe_pads_for_a_model_whose_attention_leaks_across_sequences(tiny_model, process_group, caplog):
    from transformers import AttentionInterface

    AttentionInterface.register("leaky", leaky_attention)
    model = policy.sharded_model(str(tiny_model), torch.device("cpu"), 1, "float32", "varlen")
    model.config._attn_implementation = "leaky"
    assert not policy.separates_packed_sequences(model, torch.device("cpu"), torch.float32)
    assert "training in padded rows" in caplog.text


@pytest.mark.parametrize("packing", ["flash", "", "varlen; rm -rf /", None])
def test_a_spec_names_only_a_packing_path_the_learner_has(packing):
    """`train.packing` picks code to run: anything but the three names is refused, naming the field."""
    from pydantic import ValidationError

    from services.config import parse_job_spec

    with pytest.raises(ValidationError, match="train.packing"):
        parse_job_spec({"model": {"path": "m"}, "train": {"packing": packing}})
    assert parse_job_spec({"model": {"path": "m"}}).train.packing == "varlen"
