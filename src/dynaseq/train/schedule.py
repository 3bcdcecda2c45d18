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
