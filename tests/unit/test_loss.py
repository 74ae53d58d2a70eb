"""The loss against hand-computed values (DESIGN.md, "Loss").

Four tokens with ratios r = [1.0, 1.1, 1.5, 0.6] to the proximal policy, behaviour weights
exp(prox - mu) = [1.0, 0.5, 3.0, 1.2] and advantages [1, -1, 1, -1]; eps = (0.2, 0.28):
    surrogate min(rA, clip(r)A) = [1.0, -1.1, 1.28 (clipped), -0.8 (clipped)]
"""

from __future__ import annotations

import math

import pytest
import torch

from learner import loss
from services.config import LossSpec

RATIOS = [1.0, 1.1, 1.5, 0.6]
BEHAVIOUR = [1.0, 0.5, 3.0, 1.2]
ADVANTAGES = [1.0, -1.0, 1.0, -1.0]


def inputs(mask=(1, 1, 1, 1), seq_ids=(0, 0, 0, 0), num_seqs=1, requires_grad=True) -> loss.LossInputs:
    prox = torch.log(torch.full((4,), 0.5))
    theta = (prox + torch.log(torch.tensor(RATIOS))).requires_grad_(requires_grad)
    mu = prox - torch.log(torch.tensor(BEHAVIOUR))
    return loss.LossInputs(
        theta=theta,
        prox=prox,
        mu=mu,
        advantages=torch.tensor(ADVANTAGES),
        mask=torch.tensor(mask, dtype=torch.float32),
        seq_ids=torch.tensor(seq_ids),
        num_seqs=num_seqs,
    )


def cfg(**kw) -> LossSpec:
    return LossSpec(eps_low=0.2, eps_high=0.28, correction_cap=2.0, **kw)


def test_clipped_surrogate_clips_both_sides():
    surrogate, clipped = loss.clipped_surrogate(torch.tensor(RATIOS), torch.tensor(ADVANTAGES), 0.2, 0.28)
    assert surrogate.tolist() == pytest.approx([1.0, -1.1, 1.28, -0.8])
    assert clipped.tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "correction, expected",
    [
        ("tis", -(1.0 * 1.0 + 0.5 * -1.1 + 2.0 * 1.28 + 1.2 * -0.8) / 4),  # w capped at C = 2: -0.5125
        ("mis", -(1.0 + -1.1 + 0.0 + -0.8) / 4),  # w = 3.0 outside [1/2, 2] masked: 0.225
        ("none", -(1.0 - 1.1 + 1.28 - 0.8) / 4),  # -0.095
    ],
)
def test_token_level_behaviour_correction(correction, expected):
    out = loss.policy_loss(inputs(), cfg(correction=correction), normaliser=4)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_sequence_level_tis_uses_the_product_of_token_ratios_per_sequence():
    # seq 0 = tokens 0-1: w = 1.0 * 0.5 = 0.5; seq 1 = tokens 2-3: w = 3.0 * 1.2 = 3.6 -> capped at 2.
    out = loss.policy_loss(
        inputs(seq_ids=(0, 0, 1, 1), num_seqs=2), cfg(correction="tis", correction_level="sequence"), normaliser=4
    )
    assert out.loss.item() == pytest.approx(-(0.5 * 1.0 + 0.5 * -1.1 + 2.0 * 1.28 + 2.0 * -0.8) / 4, abs=1e-6)


def test_sequence_normalisation_averages_each_sequence_then_sequences():
    # token 1 untrained: seq 0 has one token (term 1.0), seq 1 two (2*1.28 and 1.2*-0.8).
    mask, seq_ids = (1, 0, 1, 1), (0, 0, 1, 1)
    token_mode = loss.policy_loss(inputs(mask, seq_ids, 2), cfg(correction="tis"), normaliser=3)
    sequence_mode = loss.policy_loss(
        inputs(mask, seq_ids, 2), cfg(correction="tis", normalise="sequence"), normaliser=2
    )
    assert token_mode.loss.item() == pytest.approx(-(1.0 + 2.56 - 0.96) / 3, abs=1e-6)
    assert sequence_mode.loss.item() == pytest.approx(-(1.0 + (2.56 - 0.96) / 2) / 2, abs=1e-6)


@pytest.mark.parametrize(
    "normalise, num_tokens, num_sequences, expected",
    [
        ("token", 30, 4, 30.0),
        ("sequence", 30, 4, 4.0),
        ("token", 0, 4, 1.0),  # nothing trained: the zero sum is divided by 1, not 0
    ],
)
def test_normaliser_is_the_global_count_of_trained_tokens_or_of_sequences(
    normalise, num_tokens, num_sequences, expected
):
    assert loss.normaliser(cfg(normalise=normalise), num_tokens, num_sequences) == expected


def test_reinforce_has_no_ratio_clip():
    out = loss.policy_loss(inputs(), cfg(algorithm="reinforce", correction="none"), normaliser=4)
    assert out.loss.item() == pytest.approx(-(1.0 - 1.1 + 1.5 - 0.6) / 4, abs=1e-6)
    assert out.metrics["clip_fraction"].item() == 0


def test_gradient_flows_only_through_current_logprobs_and_not_through_clipped_tokens():
    x = inputs()
    x.prox.requires_grad_(True)
    x.mu.requires_grad_(True)
    loss.policy_loss(x, cfg(correction="tis"), normaliser=4).loss.backward()
    # d/dtheta of -w r A / N where unclipped: t0 = -1*1.0*1/4, t1 = -0.5*1.1*(-1)/4; clipped tokens 0.
    assert x.theta.grad.tolist() == pytest.approx([-0.25, 0.1375, 0.0, 0.0], abs=1e-6)
    assert x.prox.grad is None and x.mu.grad is None


def test_masked_tokens_contribute_nothing():
    out = loss.policy_loss(inputs(mask=(1, 1, 0, 0)), cfg(correction="tis"), normaliser=2)
    assert out.loss.item() == pytest.approx(-(1.0 - 0.55) / 2, abs=1e-6)


def test_metrics_sum_over_trained_tokens():
    out = loss.policy_loss(inputs(), cfg(correction="mis"), normaliser=4)
    assert out.metrics["clip_fraction"].item() == 2
    assert out.metrics["is_masked_fraction"].item() == 1  # the w = 3.0 token
    assert out.metrics["is_weight_mean"].item() == 3
    expected_kl = sum(w - 1 - math.log(w) for w in BEHAVIOUR)  # k3 of exp(prox - mu) = w
    assert out.metrics["mismatch_kl"].item() == pytest.approx(expected_kl, abs=1e-5)


@pytest.mark.parametrize("estimator, expected", [("k1", math.log(2)), ("k3", 0.5 - 1 + math.log(2))])
def test_kl_penalty_estimators(estimator, expected):
    theta = torch.tensor([math.log(0.5)])
    ref = theta - math.log(2)
    assert loss.kl_penalty(theta, ref, estimator).item() == pytest.approx(expected, abs=1e-6)


def test_kl_penalty_is_added_with_its_coefficient():
    x = inputs()
    x.ref = x.theta.detach() - math.log(2)
    base = loss.policy_loss(inputs(), cfg(correction="none"), normaliser=4).loss.item()
    with_kl = loss.policy_loss(x, cfg(correction="none", kl_coef=0.1, kl_estimator="k1"), normaliser=4).loss.item()
    assert with_kl - base == pytest.approx(0.1 * math.log(2), abs=1e-6)


def test_kl_penalty_takes_the_behaviour_weight():
    # k1 = log 2 on every token; tis weights [1.0, 0.5, 2.0 (3.0 capped), 1.2] sum to 4.7.
    x, plain = inputs(), inputs()
    x.ref = x.theta.detach() - math.log(2)
    base = loss.policy_loss(plain, cfg(correction="tis"), normaliser=4).loss.item()
    out = loss.policy_loss(x, cfg(correction="tis", kl_coef=0.1, kl_estimator="k1"), normaliser=4)
    assert out.loss.item() - base == pytest.approx(0.1 * 4.7 * math.log(2) / 4, abs=1e-6)
    assert out.metrics["kl_ref"].item() == pytest.approx(4.7 * math.log(2), abs=1e-5)


def test_kl_gradient_of_a_token_the_policy_left_stays_bounded():
    # Sampled when the policy gave it 0.5 (mu), now 1e-4 (prox = theta), reference 0.5.
    # k3's gradient is 1 - exp(ref - theta) = 1 - 5000; the weight exp(prox - mu) = 2e-4
    # brings it to 2e-4 * -4999 = -0.9998. Unweighted, tokens like this one made the async runs'
    # gradient norm jump a hundredfold.
    theta = torch.tensor([math.log(1e-4)], requires_grad=True)
    x = loss.LossInputs(
        theta=theta,
        prox=theta.detach().clone(),
        mu=torch.tensor([math.log(0.5)]),
        advantages=torch.zeros(1),
        mask=torch.ones(1),
        seq_ids=torch.zeros(1, dtype=torch.long),
        num_seqs=1,
        ref=torch.tensor([math.log(0.5)]),
    )
    loss.policy_loss(x, cfg(correction="tis", kl_coef=1.0, kl_estimator="k3"), normaliser=1).loss.backward()
    assert theta.grad.item() == pytest.approx(2e-4 * (1 - 5000), rel=1e-4)


def test_sft_loss_is_masked_mean_negative_logprob():
    theta = torch.log(torch.tensor([0.5, 0.25, 0.1]))
    assert loss.sft_loss(theta, torch.tensor([1.0, 1.0, 0.0]), normaliser=2).item() == pytest.approx(
        (math.log(2) + math.log(4)) / 2, abs=1e-6
    )


def test_entropy_of_uniform_logits_is_log_vocab():
    assert loss.entropy_from_logits(torch.zeros(2, 8)).tolist() == pytest.approx([math.log(8)] * 2, abs=1e-6)


@pytest.mark.parametrize(
    "correction, capped",
    [
        ("tis", [0, 0, 1, 0]),  # only w = 3.0 is above C = 2
        ("mis", [0, 1, 1, 0]),  # 0.4 below 1/C and 3.0 above C are outside [1/C, C]
        ("none", [0, 0, 0, 0]),
    ],
)
def test_tokens_at_the_importance_cap_are_counted(correction, capped):
    behaviour = torch.tensor([1.0, 0.4, 3.0, 1.2])  # 0.4 < 1/C: outside the MIS band
    assert loss.at_cap(behaviour, cfg(correction=correction)).tolist() == capped
    out = loss.policy_loss(inputs(mask=(1, 1, 1, 0)), cfg(correction=correction), normaliser=3)
    # BEHAVIOUR = [1.0, 0.5, 3.0, 1.2]: 0.5 sits exactly at 1/C, so MIS keeps it; token 3 untrained.
    assert out.metrics["is_capped_tokens"].item() == (0 if correction == "none" else 1)


# ---- DPO ----------------------------------------------------------------------------
# Two pairs. Policy sequence logprobs chosen [-2, -5], rejected [-3, -4]; reference
# chosen [-2.5, -4], rejected [-2.5, -4.5]. Log ratios to the reference: chosen [0.5, -1],
# rejected [-0.5, 0.5]; h = [1.0, -1.5]. beta = 0.5:
#   sigmoid: -log sigmoid(0.5) = 0.474077, -log sigmoid(-0.75) = 1.136871; mean 0.805474
#   ipo (1 / (2 beta) = 1): (1 - 1)^2 = 0, (-1.5 - 1)^2 = 6.25; mean 3.125
CHOSEN, REJECTED = [-2.0, -5.0], [-3.0, -4.0]
REF_CHOSEN, REF_REJECTED = [-2.5, -4.0], [-2.5, -4.5]


def dpo(kind: str, normaliser: float = 2.0) -> tuple[loss.LossOutputs, torch.Tensor, torch.Tensor]:
    chosen = torch.tensor(CHOSEN, requires_grad=True)
    rejected = torch.tensor(REJECTED, requires_grad=True)
    out = loss.dpo_loss(chosen, rejected, torch.tensor(REF_CHOSEN), torch.tensor(REF_REJECTED), 0.5, kind, normaliser)
    return out, chosen, rejected


@pytest.mark.parametrize("kind, expected", [("sigmoid", (0.474077 + 1.136871) / 2), ("ipo", 6.25 / 2)])
def test_dpo_loss_equals_hand_computed_values(kind, expected):
    out, _, _ = dpo(kind)
    assert out.loss.item() == pytest.approx(expected, abs=1e-5)


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    # d/dh -log sigmoid(beta h) = -beta sigmoid(-beta h): pair 0 -0.5 * 0.377541, pair 1 -0.5 * 0.679179;
    # h grows with the chosen logprob and shrinks with the rejected one; divided by 2 pairs.
    out, chosen, rejected = dpo("sigmoid")
    out.loss.backward()
    expected = [-0.5 * 0.377541 / 2, -0.5 * 0.679179 / 2]
    assert chosen.grad.tolist() == pytest.approx(expected, abs=1e-6)
    assert rejected.grad.tolist() == pytest.approx([-g for g in expected], abs=1e-6)


def test_dpo_metrics_are_sums_over_pairs():
    out, _, _ = dpo("sigmoid")
    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["pairs"] == 2
    assert m["preference_accuracy"] == 1  # h > 0 on pair 0 only
    assert m["reward_margin"] == pytest.approx(0.5 * (1.0 - 1.5))
    assert m["reward_chosen"] == pytest.approx(0.5 * (0.5 - 1.0))
    assert m["reward_rejected"] == pytest.approx(0.5 * (-0.5 + 0.5))
    assert m["logprob_chosen"] == pytest.approx(-7.0)
    assert m["logprob_rejected"] == pytest.approx(-7.0)


def test_dpo_loss_divides_by_the_global_pair_count():
    # Two ranks with one pair each and a normaliser of 2 add up to one rank with both pairs.
    whole, _, _ = dpo("sigmoid", normaliser=2.0)
    halves = [
        loss.dpo_loss(
            torch.tensor(CHOSEN[i : i + 1]),
            torch.tensor(REJECTED[i : i + 1]),
            torch.tensor(REF_CHOSEN[i : i + 1]),
            torch.tensor(REF_REJECTED[i : i + 1]),
            0.5,
            "sigmoid",
            2.0,
        ).loss.item()
        for i in range(2)
    ]
    assert sum(halves) == pytest.approx(whole.loss.item(), abs=1e-6)


def test_sequence_logprobs_sum_trained_tokens_per_sequence():
    values = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    out = loss.sequence_logprobs(values, mask, torch.tensor([0, 0, 0, 1, 1]), 2)
    assert out.tolist() == [-5.0, -5.0]
