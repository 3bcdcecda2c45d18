"""Fixtures for the DMB/MoE tests: steering a router to chosen branches, counting matmul rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dynaseq.techniques.branching import Router


def _route_to(router: Router, x: torch.Tensor, branch: torch.Tensor,
              scale: float = 50.0) -> torch.Tensor:
    """Make ``router`` send token ``(b, t)`` of the returned copy of ``x`` to ``branch[b, t]``.

    The router reads only the first N features (identity weights, zero bias), and those
    features of the copy hold ``scale`` at the wanted branch and 0 elsewhere.
    """
    n = router.n_branches
    with torch.no_grad():
        router.proj.weight.zero_()
        router.proj.weight[:, :n] = torch.eye(n)
        router.proj.bias.zero_()
    x = x.clone()
    x[..., :n] = scale * F.one_hot(branch, n).to(x.dtype)
    return x


@pytest.fixture
def route_to():
    return _route_to


class LinearRows:
    """Records the number of rows of every ``F.linear`` call with a given weight shape.

    A grouped matmul (``F.grouped_mm``) is recorded as one call per group with the group's
    weight shape ``(out, in)`` and rows, as if each group ran its own ``F.linear``.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], int]] = []
        self.grouped_calls = 0  # F.grouped_mm calls (each also listed per group in calls)

    def rows(self, weight_shape: tuple[int, ...]) -> list[int]:
        return [n for shape, n in self.calls if shape == weight_shape]


@pytest.fixture
def linear_rows(monkeypatch):
    """Spy on ``torch.nn.functional.linear`` and ``grouped_mm``: which weight shapes ran on
    how many rows."""
    spy = LinearRows()
    real, real_grouped = F.linear, F.grouped_mm

    def linear(x, weight, bias=None):
        spy.calls.append((tuple(weight.shape), x.reshape(-1, x.size(-1)).size(0)))
        return real(x, weight, bias)

    def grouped_mm(x, weights, *, offs, **kwargs):
        spy.grouped_calls += 1
        start = 0
        for end in offs.tolist():
            if end > start:  # an empty group runs nothing
                spy.calls.append(((weights.size(2), weights.size(1)), end - start))
            start = end
        return real_grouped(x, weights, offs=offs, **kwargs)

    monkeypatch.setattr(F, "linear", linear)
    monkeypatch.setattr(F, "grouped_mm", grouped_mm)
    return spy
