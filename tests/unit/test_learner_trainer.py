"""How the trainer combines its minibatches' metrics into one step's."""

from __future__ import annotations

import pytest
import torch

from learner.policy import optimizer_step
from learner.reduce import accumulate
from learner.trainer import merge_minibatches


def test_micro_batch_metrics_add_up_except_maxima_which_keep_the_largest():
    totals = {}
    accumulate(
        totals, {"loss": torch.tensor(0.5), "is_capped_tokens": torch.tensor(2.0), "is_weight_max": torch.tensor(1.5)}
    )
    accumulate(
        totals, {"loss": torch.tensor(0.25), "is_capped_tokens": torch.tensor(3.0), "is_weight_max": torch.tensor(1.25)}
    )

    assert {name: value.item() for name, value in totals.items()} == {
        "loss": 0.75,
        "is_capped_tokens": 5.0,
        "is_weight_max": 1.5,
    }


def test_a_step_reports_the_largest_importance_weight_of_its_minibatches_and_the_mean_of_the_rest():
    stats = [
        {"loss": 0.5, "clip_fraction": 0.1, "is_weight_max": 1.5},
        {"loss": 1.5, "clip_fraction": 0.3, "is_weight_max": 4.0},
        {"loss": 1.0, "clip_fraction": 0.2, "is_weight_max": 2.0},
    ]

    merged = merge_minibatches(stats)

    assert merged["is_weight_max"] == 4.0  # not the mean of maxima, 2.5
    assert merged["loss"] == pytest.approx(1.0)
    assert merged["clip_fraction"] == pytest.approx(0.2)


def test_counts_are_summed_over_minibatches():
    stats = [{"is_capped_tokens": 3.0, "skipped_updates": 0.0}, {"is_capped_tokens": 5.0, "skipped_updates": 1.0}]
    assert merge_minibatches(stats) == {"is_capped_tokens": 8.0, "skipped_updates": 1.0}


def adam_after_one_real_step() -> tuple[torch.nn.Linear, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.99), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(1, 3)).sum().backward()  # gradient [1, 1, 1]
    assert optimizer_step(model, optimizer, scheduler, max_grad_norm=10.0) == (pytest.approx(3**0.5), True)
    return model, optimizer, scheduler


def zero_gradient(model: torch.nn.Module) -> None:
    (model(torch.ones(1, 3)) * 0.0).sum().backward()  # a batch whose advantages are all 0


def test_plain_adamw_moves_the_parameters_on_a_zero_gradient():
    """The mechanism the skip exists for: with m = 0.1 * g after one step, the next update
    on g = 0 is lr * m_hat / sqrt(v_hat) = 0.1 * (0.09 / 0.19) / sqrt(0.0099 / 0.0199)."""
    model, optimizer, _ = adam_after_one_real_step()
    before = model.weight.detach().clone()
    zero_gradient(model)
    optimizer.step()
    moved = before - model.weight.detach()
    expected = 0.1 * (0.09 / 0.19) / (0.0099 / 0.0199) ** 0.5
    assert moved.flatten().tolist() == pytest.approx([expected] * 3, rel=1e-3)  # about 0.067 per parameter


def test_a_zero_gradient_leaves_parameters_moments_and_schedule_alone():
    model, optimizer, scheduler = adam_after_one_real_step()
    before = model.weight.detach().clone()
    moments = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    zero_gradient(model)

    assert optimizer_step(model, optimizer, scheduler, max_grad_norm=10.0) == (0.0, False)

    assert torch.equal(model.weight.detach(), before)
    assert all(torch.equal(optimizer.state[model.weight][k], v) for k, v in moments.items())
    assert scheduler.last_epoch == 1 and model.weight.grad is None


def test_an_empty_share_gives_one_placeholder_logprob_and_a_dpo_step_on_no_pairs_moves_nothing(
    tiny_model, process_group
):
    """A rank with no sequence (fewer pairs than ranks) still runs its forward: the
    placeholder row is one token long, and its logprobs must not fail on that."""
    from learner.trainer import Trainer
    from services.config import ModelSpec, RLJob, TrainSpec

    trainer = Trainer(
        RLJob(model=ModelSpec(path=str(tiny_model)), train=TrainSpec(algorithm="dpo")), torch.device("cpu")
    )
    trainer.start_rl()
    empty = trainer.batches.collate([], [])
    logprobs, entropy = trainer.token_logprobs(empty, with_entropy=True)
    assert logprobs.tolist() == [0.0] and entropy.tolist() == [0.0]
    full = lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # noqa: E731
    before = {n: full(p) for n, p in trainer.model.named_parameters()}
    metrics = trainer.dpo_step([])
    assert metrics["pairs"] == 0 and metrics["skipped_updates"] == 1.0
    assert all(torch.equal(before[n], full(p)) for n, p in trainer.model.named_parameters())
