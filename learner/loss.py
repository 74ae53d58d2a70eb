"""The policy loss, as pure functions of tensors (DESIGN.md, "Loss").

All tensors are flat over the tokens a rank holds: shape [T], T = tokens of all its
sequences packed together. Per token: behaviour logprob `mu` (the engine's, at sampling
time), proximal logprob `prox` (learner weights at the start of the step, no grad) and
current logprob `theta` (with grad).

    r = exp(theta - prox)            PPO ratio, clipped to [1 - eps_low, 1 + eps_high]
    w = min(exp(prox - mu), C)       tis  (detached)
      | 1[1/C <= exp(prox - mu) <= C] mis
    loss = -sum(w * min(r A, clip(r) A) * mask) / normaliser
         + kl_coef * sum(w * k(theta, ref) * mask) / normaliser     (KL to a reference)

The KL term is estimated on the same behaviour samples as the surrogate, so it takes the
same weight w. Unweighted, a token the policy has moved away from since it was sampled
(theta far below ref) gives k3 a gradient of 1 - exp(ref - theta) that grows without bound.

The normaliser is global (all ranks, all micro-batches), so the gradient is the same
however the sequences were split across ranks.

DPO (`dpo_loss`) works on preference pairs instead: per pair, the sequence logprobs of the
chosen and the rejected response under the policy and under the frozen reference,

    h = (theta_c - ref_c) - (theta_r - ref_r)
    loss = -log sigmoid(beta h)        sigmoid (Rafailov et al.)
         | (h - 1 / (2 beta))^2        ipo (Azar et al.)

summed over a rank's pairs and divided by the global count of pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.config import LossSpec

MAXIMA = frozenset({"is_weight_max"})
"""Metrics of `policy_loss` that are maxima over tokens: they combine by max across
micro-batches, ranks and minibatches."""
COUNTS = frozenset({"is_capped_tokens"})
"""Metrics of `policy_loss` that are counts: they combine by sum and are reported as they are.
Every other metric is a sum over trained tokens, reported per trained token (divided by the
global count of trained tokens)."""


@dataclass
class LossInputs:
    theta: torch.Tensor
    """[T] current logprobs, with grad."""
    prox: torch.Tensor
    """[T] proximal logprobs, no grad."""
    mu: torch.Tensor
    """[T] behaviour logprobs from the engine."""
    advantages: torch.Tensor
    """[T] the sequence's advantage repeated on each of its tokens."""
    mask: torch.Tensor
    """[T] 1.0 on trained tokens."""
    seq_ids: torch.Tensor
    """[T] long, index of the token's sequence within the rank's batch (0..S-1)."""
    num_seqs: int
    """S: sequences on this rank (for sequence-level reductions)."""
    ref: torch.Tensor | None = None
    """[T] logprobs of the frozen reference policy, when kl_coef > 0."""


@dataclass
class LossOutputs:
    loss: torch.Tensor
    """Scalar: this rank's share of the global loss (sum of token terms / global normaliser)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """This rank's scalar statistics: maxima (`MAXIMA`), counts (`COUNTS`) and otherwise sums
    over its trained tokens."""


def ppo_ratio(theta: torch.Tensor, prox: torch.Tensor) -> torch.Tensor:
    """pi_theta / pi_prox per token; differentiable in theta only."""
    return torch.exp(theta - prox.detach())


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """min(r A, clip(r, 1-eps_low, 1+eps_high) A) and a mask of the tokens where the clip bites."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    return torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def segment_sum(values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[T] -> [S]: sum of each sequence's token values."""
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_ids, values)


def behaviour_ratio(
    prox: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, spec: LossSpec
) -> torch.Tensor:
    """[T] pi_prox / mu per token (detached); at sequence level the product of the
    sequence's token ratios, the same for each of its tokens."""
    log_ratio = (prox - mu).detach() * mask
    if spec.correction_level == "sequence":
        log_ratio = segment_sum(log_ratio, seq_ids, num_seqs)[seq_ids]
    return torch.exp(log_ratio)


def behaviour_weight(ratio: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """[T] the importance weight correcting for the behaviour policy: `tis` truncates the
    ratio at C, `mis` zeroes weights outside [1/C, C], `none` is 1."""
    cap = spec.correction_cap
    if spec.correction == "tis":
        return ratio.clamp(max=cap)
    if spec.correction == "mis":
        return ((ratio >= 1.0 / cap) & (ratio <= cap)).float()
    return torch.ones_like(ratio)


def at_cap(ratio: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """[T] 1.0 on tokens whose weight the cap C decides rather than their ratio: above C
    (`tis`, truncated) or outside [1/C, C] (`mis`, masked). Many of them mean the behaviour
    policy is far from the proximal one: the data is more off-policy than C corrects."""
    cap = spec.correction_cap
    if spec.correction == "tis":
        return (ratio > cap).float()
    if spec.correction == "mis":
        return ((ratio < 1.0 / cap) | (ratio > cap)).float()
    return torch.zeros_like(ratio)


def mismatch_kl(prox: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """[T] k3 estimate of KL(mu || pi_prox) per token: exp(d) - 1 - d with d = prox - mu."""
    delta = (prox - mu).detach()
    return torch.exp(delta) - 1.0 - delta


def kl_penalty(theta: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """[T] per-token KL(pi_theta || pi_ref) estimate on samples from pi_theta: k1 = log ratio,
    k3 = exp(-d) - 1 + d with d = theta - ref (unbiased, always >= 0). On samples from another
    policy it needs that policy's importance weight (`policy_loss` applies it)."""
    delta = theta - ref
    if estimator == "k1":
        return delta
    return torch.exp(-delta) - 1.0 + delta


def normaliser(spec: LossSpec, num_tokens: int, num_sequences: int) -> float:
    """What the loss divides by, given the global counts of trained tokens and of sequences:
    the tokens (token mode) or the sequences (sequence mode); at least 1, so a batch with
    nothing to train divides its zero sum by 1."""
    return float(max(num_tokens if spec.normalise == "token" else num_sequences, 1))


def token_weights(
    mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, spec: LossSpec, normaliser: float
) -> torch.Tensor:
    """[T] the factor each token's term gets: 1/normaliser per token (token mode) or
    1/(len(seq) * normaliser) (sequence mode: each sequence's mean counts once)."""
    if spec.normalise == "token":
        return mask / normaliser
    lengths = segment_sum(mask, seq_ids, num_seqs).clamp(min=1.0)
    return mask / (lengths[seq_ids] * normaliser)


def policy_loss(inputs: LossInputs, spec: LossSpec, normaliser: float) -> LossOutputs:
    """The full per-rank loss; `normaliser` is the global count the loss divides by (all
    ranks and micro-batches: the function `normaliser` computes it)."""
    x = inputs
    ratio = ppo_ratio(x.theta, x.prox)
    if spec.algorithm == "reinforce":
        # Plain policy gradient through the ratio (value 1 at prox == theta): no trust region.
        surrogate, clipped = ratio * x.advantages, torch.zeros_like(ratio)
    else:
        surrogate, clipped = clipped_surrogate(ratio, x.advantages, spec.eps_low, spec.eps_high)
    behaviour = behaviour_ratio(x.prox, x.mu, x.mask, x.seq_ids, x.num_seqs, spec)
    weight = behaviour_weight(behaviour, spec)
    scale = token_weights(x.mask, x.seq_ids, x.num_seqs, spec, normaliser)
    loss = -(weight * surrogate * scale).sum()
    metrics = {
        "clip_fraction": (clipped * x.mask).sum(),
        "mismatch_kl": (mismatch_kl(x.prox, x.mu) * x.mask).sum(),
        "is_weight_mean": (weight * x.mask).sum(),
        "is_weight_max": (weight * x.mask).max() if x.mask.any() else weight.new_zeros(()),
        "is_masked_fraction": ((weight == 0).float() * x.mask).sum(),
        "is_capped_tokens": (at_cap(behaviour, spec) * x.mask).sum(),
        "ratio_mean": (ratio.detach() * x.mask).sum(),
    }
    if spec.kl_coef > 0 and x.ref is not None:
        kl = weight * kl_penalty(x.theta, x.ref, spec.kl_estimator)
        loss = loss + spec.kl_coef * (kl * scale).sum()
        metrics["kl_ref"] = (kl.detach() * x.mask).sum()
    return LossOutputs(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})


DPO_METRICS = (
    "pairs",
    "preference_accuracy",
    "reward_margin",
    "reward_chosen",
    "reward_rejected",
    "logprob_chosen",
    "logprob_rejected",
)
"""What `dpo_loss` reports: `pairs` is a count; the others are sums over pairs, reported per pair."""


def sequence_logprobs(
    token_logprobs: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int
) -> torch.Tensor:
    """[T] -> [S]: each sequence's logprob of its trained tokens (the response)."""
    return segment_sum(token_logprobs * mask, seq_ids, num_seqs)


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    kind: str,
    normaliser: float,
) -> LossOutputs:
    """The preference loss of a rank's pairs: [P] sequence logprobs of the chosen and the
    rejected responses under the policy (with grad) and the reference (without);
    `normaliser` is the global count of pairs. The implicit rewards are beta times the
    log ratios to the reference; the metrics are sums over the pairs."""
    chosen_ratio = chosen - ref_chosen.detach()
    rejected_ratio = rejected - ref_rejected.detach()
    h = chosen_ratio - rejected_ratio
    if kind == "ipo":
        per_pair = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        per_pair = -torch.nn.functional.logsigmoid(beta * h)
    metrics = {
        "pairs": torch.tensor(float(len(h))),
        "preference_accuracy": (h > 0).float().sum(),
        "reward_margin": (beta * h).sum(),
        "reward_chosen": (beta * chosen_ratio).sum(),
        "reward_rejected": (beta * rejected_ratio).sum(),
        "logprob_chosen": chosen.sum(),
        "logprob_rejected": rejected.sum(),
    }
    return LossOutputs(loss=per_pair.sum() / normaliser, metrics={k: v.detach() for k, v in metrics.items()})


def sft_loss(theta: torch.Tensor, mask: torch.Tensor, normaliser: float) -> torch.Tensor:
    """Masked cross-entropy: -sum(logprob of target tokens) / global trained-token count."""
    return -(theta * mask).sum() / normaliser


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] entropy of softmax(logits)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
