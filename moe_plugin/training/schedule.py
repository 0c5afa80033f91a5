"""The learning-rate schedule: linear warm-up, then cosine decay to ``min_lr`` or constant."""

from __future__ import annotations

import math

import torch

__all__ = ["lr_at", "lr_scheduler"]


def lr_at(step: int, steps: int, lr: float, min_lr: float = 0.0, warmup_steps: int = 0, decay: str = "cosine") -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``steps``.

    Warm-up rises linearly to ``lr`` over ``warmup_steps`` (step 0 gets ``lr / warmup_steps``, never 0, so the
    first step moves); then ``"cosine"`` falls from ``lr`` to ``min_lr`` at the last step and ``"constant"`` stays.
    """
    if decay not in ("cosine", "constant"):
        raise ValueError(f"schedule.decay: expected 'cosine' or 'constant', got {decay!r}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant":
        return lr
    span = max(1, steps - warmup_steps)  # the last step still moves: lr reaches min_lr just after it
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` (built with ``lr = schedule.lr``) following ``lr_at``; it is stepped
    once per optimizer step (DeepSpeed's engine does that at each gradient-accumulation boundary)."""

    def factor(step: int) -> float:
        return (
            lr_at(step, schedule.steps, schedule.lr, schedule.min_lr, schedule.warmup_steps, schedule.decay)
            / schedule.lr
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
