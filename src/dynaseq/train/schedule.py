"""Inverse-square-root learning-rate schedule with linear warm-up (Vaswani et al. 2017)."""

from __future__ import annotations

import functools
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def inverse_sqrt_factor(step: int, warmup_steps: int) -> float:
    """lr(step) / peak_lr: step/warmup while warming up, then sqrt(warmup/step).

    ``step`` counts completed updates; the first update uses step 1.
    """
    s = step + 1
    if warmup_steps == 0:
        return 1.0 / math.sqrt(s)
    return min(s / warmup_steps, math.sqrt(warmup_steps / s))


def inverse_sqrt_schedule(optimizer: Optimizer, warmup_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, functools.partial(inverse_sqrt_factor, warmup_steps=warmup_steps))


def cosine_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """lr(step) / peak_lr: linear warm-up over ``warmup_steps``, then a cosine decay to
    ``min_ratio`` at ``total_steps`` (MicroNet appendix A.5). ``step`` counts completed
    updates; the first update uses step 1."""
    s = step + 1
    if warmup_steps and s <= warmup_steps:
        return s / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(s - warmup_steps, 0) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def cosine_schedule(optimizer: Optimizer, warmup_steps: int, total_steps: int,
                    min_ratio: float = 0.0) -> LambdaLR:
    return LambdaLR(optimizer, functools.partial(cosine_factor, warmup_steps=warmup_steps,
                                                 total_steps=total_steps, min_ratio=min_ratio))


def make_schedule(optimizer: Optimizer, tc) -> LambdaLR:
    """The schedule ``tc.schedule`` names (a :class:`~dynaseq.core.config.TrainConfig`)."""
    if tc.schedule == "cosine":
        return cosine_schedule(optimizer, tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    return inverse_sqrt_schedule(optimizer, tc.warmup_steps)
