"""Fixtures for the CCT tests: steering control networks to a chosen gate pattern (the tiny
trained CCT run, ``cct_run``, is in ``tests/conftest.py``)."""

from __future__ import annotations

import pytest
import torch

from dynaseq.techniques.cct.layers import ControlNet


def _steer(control: ControlNet, features: list[int], scale: float = 1000.0) -> None:
    """Make gate i's logit ``scale · x[..., features[i]]`` (via ReLU(x) − ReLU(−x)).

    Setting that input feature to +1 / −1 then opens / closes the gate: exactly 1 / 0 at
    inference, and σ(±1000) = 1 / 0 exactly (in float32) for the soft gates at α = 0.
    """
    assert control.n_gates == len(features) and control.w1.out_features >= 2 * len(features)
    with torch.no_grad():
        control.w1.weight.zero_()
        control.w1.bias.zero_()
        control.w2.weight.zero_()
        for i, f in enumerate(features):
            control.w1.weight[2 * i, f] = 1.0
            control.w1.weight[2 * i + 1, f] = -1.0
            control.w2.weight[i, 2 * i] = scale
            control.w2.weight[i, 2 * i + 1] = -scale


@pytest.fixture
def steer():
    return _steer


def with_pattern(x: torch.Tensor, feature: int, on: torch.Tensor) -> torch.Tensor:
    """Copy of ``x`` (B, T, d) whose ``feature`` is +1 where ``on`` (B, T) else −1."""
    x = x.clone()
    x[..., feature] = on.float() * 2 - 1
    return x


@pytest.fixture
def pattern():
    return with_pattern
