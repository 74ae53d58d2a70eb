"""Logprobs a chunk of tokens at a time equal the full-vocabulary computation, values and
gradients, to fp32 precision."""

from __future__ import annotations

import pytest
import torch

from learner import logprobs


def reference(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


def inputs(n=37, hidden_size=16, vocab=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=generator, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=generator)
    upstream = torch.randn(n, generator=generator)  # a loss that weighs tokens differently
    return hidden, weight, targets, upstream


@pytest.mark.parametrize("kept_chunks", [0, 2, 100])  # projected again in backward, some, none
@pytest.mark.parametrize("chunk_tokens", [1, 8, 37, 1000])
def test_chunked_values_entropy_and_gradients_match_the_full_computation(monkeypatch, chunk_tokens, kept_chunks):
    vocab = 50
    monkeypatch.setattr(logprobs, "CHUNK_BYTES", 4 * vocab * chunk_tokens)
    hidden, weight, targets, upstream = inputs(vocab=vocab)

    keep = kept_chunks * 4 * vocab * chunk_tokens
    logp, entropy = logprobs.ChunkedLogprobs.apply(hidden, weight, targets, 0.7, True, keep)
    (logp * upstream).sum().backward()
    chunked = (logp.detach(), entropy, hidden.grad.clone(), weight.grad.clone())

    # The full computation in float64: the chunked one must be as close to it as fp32 allows.
    hidden64, weight64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    logp_full, entropy_full = reference(hidden64, weight64, targets, 0.7)
    (logp_full * upstream.double()).sum().backward()

    expected = (logp_full.detach(), entropy_full.detach(), hidden64.grad, weight64.grad)
    for got, want in zip(chunked, expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_chunk_holds_at_most_the_budgeted_logits():
    assert logprobs.chunk_tokens(49152) == 64 * 2**20 // (4 * 49152)  # 341 tokens of SmolLM2's vocabulary
    assert logprobs.chunk_tokens(10**9) == 1


@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_first_chunks_are_kept_within_the_budget_and_no_later_one(monkeypatch, with_entropy):
    """37 tokens in chunks of 8 (the last one 5): a budget of 2.9 chunks keeps the first two;
    the last, small enough to fit beside them, is not kept after the third was not."""
    vocab = 50
    monkeypatch.setattr(logprobs, "CHUNK_BYTES", 4 * vocab * 8)
    hidden, weight, targets, _ = inputs(vocab=vocab)
    logp, _ = logprobs.ChunkedLogprobs.apply(hidden, weight, targets, 1.0, with_entropy, int(2.9 * 4 * vocab * 8))
    kept = logp.grad_fn.saved_tensors[4:]
    assert [tuple(x.shape) for x in kept] == [(8, vocab), (8, vocab)]


def test_no_tokens_to_score_still_gives_every_input_a_gradient():
    """A rank whose share is empty still runs backward with the others (FSDP reduces every
    parameter's gradient)."""
    hidden, weight, targets, _ = inputs(n=0)
    logp, entropy = logprobs.ChunkedLogprobs.apply(hidden, weight, targets, 1.0, False)
    logp.sum().backward()
    assert entropy is None
    assert hidden.grad.shape == (0, 16) and weight.grad.abs().sum() == 0


def test_the_models_method_scores_only_the_positions_asked_for(tiny_model):
    """Against the model's own logits: scored positions match log_softmax of the logits
    before them; unscored ones and each row's first token are 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    logprobs.attach(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(9).repeat(2, 1)
    scored = torch.rand(2, 9, generator=torch.Generator().manual_seed(4)) > 0.4

    with torch.no_grad():
        got, entropy = getattr(model, logprobs.METHOD)(ids, positions, scored, 0.5, True)
        logits = model(input_ids=ids, position_ids=positions).logits.float() / 0.5
    full = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    expected = torch.cat([torch.zeros(2, 1), full], 1) * (scored & (positions > 0))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (entropy[~scored] == 0).all() and (entropy[:, 0] == 0).all()


def test_bf16_operands_give_logits_not_rounded_to_bf16():
    """Under mixed precision the hidden states and the head are bf16; their product must not
    be rounded to bf16 before the softmax (a logit near 20 would move by up to 1/16)."""
    generator = torch.Generator().manual_seed(3)
    hidden = (4 * torch.randn(64, 32, generator=generator)).bfloat16()
    weight = torch.randn(200, 32, generator=generator).bfloat16()
    exact = hidden.double() @ weight.double().T
    logits = logprobs._logits(hidden, weight, 1.0)
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max() < 1e-4 * exact.abs().max()
    rounded = (hidden @ weight.T).double()  # what the old path computed
    assert (rounded - exact).abs().max() > 1e-3 * exact.abs().max(), "the inputs must be able to show the rounding"
