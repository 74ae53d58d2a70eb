"""A step whose loss or gradient is NaN or infinite takes no optimizer update: parameters,
AdamW moments and the schedule stay as they were, and the step counts it."""

from __future__ import annotations

import math

import pytest
import torch

from learner.policy import optimizer_step
from services.protocol import Sample


def adamw_on_a_line() -> tuple[torch.nn.Linear, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    model = torch.nn.Linear(3, 1, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.99), weight_decay=0.0)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def unit_gradient(model: torch.nn.Module, scale: float = 1.0) -> None:
    (model(torch.ones(1, 3)) * scale).sum().backward()  # gradient [scale] * 3


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_a_nonfinite_gradient_moves_no_parameter_moment_or_schedule(poison):
    model, optimizer, scheduler = adamw_on_a_line()
    unit_gradient(model)
    optimizer_step(model, optimizer, scheduler, max_grad_norm=10.0)
    before = model.weight.detach().clone()
    moments = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    unit_gradient(model, poison)

    grad_norm, stepped = optimizer_step(model, optimizer, scheduler, max_grad_norm=10.0)

    assert not stepped and not math.isfinite(grad_norm)
    assert torch.equal(model.weight.detach(), before)
    assert all(torch.equal(optimizer.state[model.weight][k], v) for k, v in moments.items())
    assert scheduler.last_epoch == 1 and model.weight.grad is None


def test_the_step_after_a_skipped_one_is_adams_second():
    """Two unit gradients: m = 0.19, v = 0.0199 after the second, bias-corrected to 1 and 1,
    so the second update is lr = 0.1 exactly, as if the poisoned step never happened."""
    model, optimizer, scheduler = adamw_on_a_line()
    unit_gradient(model)
    optimizer_step(model, optimizer, scheduler, max_grad_norm=10.0)
    unit_gradient(model, math.nan)
    optimizer_step(model, optimizer, scheduler, max_grad_norm=10.0)
    before = model.weight.detach().clone()
    unit_gradient(model)

    assert optimizer_step(model, optimizer, scheduler, max_grad_norm=10.0) == (pytest.approx(3**0.5), True)

    assert (before - model.weight.detach()).flatten().tolist() == pytest.approx([0.1] * 3, rel=1e-6)


def test_a_finite_gradient_with_a_nonfinite_loss_takes_no_step():
    model, optimizer, scheduler = adamw_on_a_line()
    before = model.weight.detach().clone()
    unit_gradient(model)

    assert optimizer_step(model, optimizer, scheduler, 10.0, finite_loss=False) == (pytest.approx(3**0.5), False)

    assert torch.equal(model.weight.detach(), before) and not optimizer.state and model.weight.grad is None


# ---- the trainer -------------------------------------------------------------------

LR = 0.01


def batch(advantage: float = 1.0, logprob: float = -1.0) -> list[Sample]:
    """Two sequences of the tiny model's vocabulary, the last three tokens trained; the first
    sequence carries `advantage` and `logprob` (on its first trained token)."""
    samples = []
    for i, (adv, first) in enumerate([(advantage, logprob), (-1.0, -1.0)]):
        tokens = [5 + i, 17, 42, 99, 7, 3]
        mask = [0, 0, 0, 1, 1, 1]
        samples.append(
            Sample(
                sample_id=f"s{i}",
                tokens=tokens,
                mask=mask,
                logprobs=[0.0, 0.0, 0.0, first, -1.0, -1.0],
                versions=[-1, -1, -1, 0, 0, 0],
                reward=0.0,
                advantage=adv,
                num_turns=1,
            )
        )
    return samples


def parameters(trainer) -> dict[str, torch.Tensor]:
    full = lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # noqa: E731
    return {name: full(p) for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("poisoned", [{"advantage": math.nan}, {"logprob": math.nan}], ids=["advantage", "logprob"])
def test_a_batch_with_a_nan_is_not_trained_and_the_next_batch_is_adams_first_step(tiny_model, process_group, poisoned):
    """The first update after the skipped one is AdamW's first (m_hat / sqrt(v_hat) = g / |g|
    with no weight decay): every parameter moves by at most lr and the largest by lr, which
    only holds if the poisoned step left no moment behind."""
    from learner.trainer import Trainer
    from services.config import ModelSpec, RLJob, TrainSpec

    trainer = Trainer(
        RLJob(model=ModelSpec(path=str(tiny_model)), train=TrainSpec(lr=LR, weight_decay=0.0)), torch.device("cpu")
    )
    trainer.start_rl()
    before = parameters(trainer)

    metrics = trainer.rl_step(batch(**poisoned))

    assert all(torch.equal(before[name], p) for name, p in parameters(trainer).items())
    assert not trainer.optimizer.state and trainer.scheduler.last_epoch == 0
    assert math.isnan(metrics["loss"]) and math.isnan(metrics["grad_norm"])
    assert metrics["nonfinite_updates"] == 1.0 and metrics["skipped_updates"] == 0.0

    metrics = trainer.rl_step(batch())

    assert metrics["nonfinite_updates"] == 0.0 and metrics["skipped_updates"] == 0.0
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    moved = max((before[name] - p).abs().max().item() for name, p in parameters(trainer).items())
    assert moved == pytest.approx(LR, rel=1e-4)
    assert trainer.scheduler.last_epoch == 1
