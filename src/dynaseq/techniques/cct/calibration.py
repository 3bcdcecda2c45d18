"""Budget calibration: shift a CCT's gate thresholds so a budget's realized compute hits it.

The budget loss (eq. 5-9) steers the compute of training batches: dropout on, noisy gates,
sequences of one control task trading compute among themselves. At inference the gates are
hard and noise-free, so the realized fraction of a trained budget p can land off p (on
Multi30k, 0.42 for a decoder trained at 0.5). Calibration fixes this after training,
without touching a weight: per control task and sub-network j it finds one offset δ_j for
the inference threshold of every gate of j, passed with each call
(:class:`~dynaseq.techniques.cct.gating.BudgetControl`, never written into the model)::

    g = 1[G(x) + δ_j >= 0]        such that   realized_j(δ) ≈ p_j   on held-out pairs

The realized fraction rises with δ (a larger offset opens more gates), so δ is found by
bracketing and bisection, encoder first (the decoder's cross-attention reads the
encoder's output), then decoder. The same search fits a budget that was **not trained**:
it starts from the control symbol of the nearest trained budget and moves its thresholds
to the new budget (an interpolation; quality between the neighbours is not guaranteed, so
evaluate it).

Example::

    pairs = [(src (1, S), tgt_in (1, T)), ...]      # held-out sentence pairs, batch 1
    cal = calibrate_budget(model, pairs, control=2, budget=(0.5, 0.5))
    model(src, tgt_in, cal.control_for())           # every row: realized ≈ (0.5, 0.5)
    rows = BudgetControl.per_row([cal.control, 0], [cal.offsets, None])  # B = 2, two budgets
    model(src2, tgt2, rows)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from dynaseq.core.errors import DynaseqError
from dynaseq.nn.modes import evaluating
from dynaseq.techniques.cct.gating import (
    ALL_GATES_ON,
    GATE_SUBNETWORKS,
    BudgetControl,
    full_budget_offsets,
)
from dynaseq.techniques.cct.layers import realized_macs_by_layer

SUBNETWORKS = GATE_SUBNETWORKS


@dataclass(frozen=True)
class BudgetCalibration:
    """One calibrated budget.

    budget: the target fraction of each sub-network: (encoder, decoder), or (encoder,) for
        an encoder-only model (CCT-BERT).
    control: the control-symbol id it runs with (its own if trained, else the nearest).
    offsets: per sub-network threshold offset δ (see the module docstring).
    realized: realized fractions with the offsets, on the calibration pairs.
    uncalibrated: realized fractions of ``control`` with no offset, on the same pairs.
    """

    budget: tuple[float, ...]
    control: int
    offsets: dict[str, float]
    realized: dict[str, float]
    uncalibrated: dict[str, float]

    def control_for(self) -> BudgetControl:
        """The call argument that runs every row of a batch at this budget."""
        return BudgetControl(self.control, dict(self.offsets))

    def to_json(self) -> dict:
        return {**asdict(self), "budget": list(self.budget)}

    @classmethod
    def from_json(cls, d: dict) -> BudgetCalibration:
        """The calibration :meth:`to_json` wrote; ValueError for a budget fraction outside
        (0, 1] or a NaN offset (a hand-edited file: every call at that budget would fail)."""
        cal = cls(budget=tuple(float(b) for b in d["budget"]),
                  control=int(d["control"]),
                  offsets={k: float(v) for k, v in d["offsets"].items()},
                  realized={k: float(v) for k, v in d["realized"].items()},
                  uncalibrated={k: float(v) for k, v in d["uncalibrated"].items()})
        if not all(0 < b <= 1 for b in cal.budget):
            raise ValueError(f"budget {list(cal.budget)} is not fractions in (0, 1]")
        if any(math.isnan(v) for v in cal.offsets.values()):
            raise ValueError(f"budget {list(cal.budget)} has a NaN gate offset")
        return cal



def budget_offsets(budget: tuple[float, ...], cal: BudgetCalibration | None,
                   subnetworks: tuple[str, ...] = SUBNETWORKS) -> dict[str, float]:
    """The gate offsets a budget's calls run with: the calibration ``cal``'s (None: none),
    with every gate open in a sub-network whose budget fraction is 1
    (:func:`~dynaseq.techniques.cct.gating.full_budget_offsets`)."""
    return {**(cal.offsets if cal is not None else {}),
            **full_budget_offsets(budget, subnetworks)}


Measure = Callable[[BudgetControl], dict[str, int]]
"""What the gated sub-networks ran over the held-out rows at a control (its id and gate
offsets): MACs summed over the rows, by sub-network name. The default runs the model's own
pass on each pair at batch 1 (:class:`_Meter`); a task may give a faster one that counts
the same MACs (a classifier's lean pass counts each row over its own tokens in batches)."""


class _Meter:
    """Realized fractions of the gated sub-networks over fixed pairs (batch 1, eval mode),
    or as ``measure`` counts them.

    Each pass hands its offsets to the model with the call (the model is not modified), so
    the full network is the pass with every gate opened (offsets :data:`ALL_GATES_ON`).
    """

    def __init__(self, model: nn.Module, pairs: Sequence[tuple[Tensor, Tensor]],
                 control: int, subnetworks: tuple[str, ...] = SUBNETWORKS,
                 measure: Measure | None = None) -> None:
        if not pairs and measure is None:
            raise ValueError("calibration needs at least one sentence pair")
        self.model, self.pairs, self.control = model, pairs, control
        self.subnetworks = subnetworks
        self.measure = measure or self._ran_pairs
        self.full = self._ran(dict.fromkeys(subnetworks, ALL_GATES_ON))

    def _ran(self, offsets: dict[str, float]) -> dict[str, int]:
        return self.measure(BudgetControl(self.control, offsets))

    @torch.no_grad()
    def _ran_pairs(self, control: BudgetControl) -> dict[str, int]:
        totals = dict.fromkeys(self.subnetworks, 0)
        for src, tgt_in in self.pairs:
            out = self.model(src, tgt_in, control)
            for layer, counts in realized_macs_by_layer(out.aux).items():
                totals[layer.split(".")[0]] += sum(counts.values())
        return totals

    def __call__(self, offsets: dict[str, float]) -> dict[str, float]:
        ran = self._ran(offsets)
        return {k: ran[k] / self.full[k] for k in self.subnetworks}


def _solve(f, target: float, tol: float, max_calls: int) -> tuple[float, float]:
    """δ with f(δ) ≈ target for a (roughly) non-decreasing f: returns (δ, f(δ)), the best
    point seen. Brackets by doubling from 0, then bisects."""
    seen = {0.0: f(0.0)}

    def best() -> tuple[float, float]:
        return min(seen.items(), key=lambda kv: (abs(kv[1] - target), abs(kv[0])))

    if abs(seen[0.0] - target) <= tol:
        return 0.0, seen[0.0]
    sign = 1.0 if seen[0.0] < target else -1.0  # which way opens / closes gates
    lo, hi, step = 0.0, None, 1.0
    while hi is None and len(seen) < max_calls:
        x = sign * step
        seen[x] = f(x)
        if (seen[x] - target) * sign >= 0:  # crossed the target
            hi = x
        else:
            lo, step = x, step * 2
    if hi is None:
        return best()
    while len(seen) < max_calls:
        mid = (lo + hi) / 2
        seen[mid] = f(mid)
        if abs(seen[mid] - target) <= tol:
            break
        if (seen[mid] - target) * sign >= 0:
            hi = mid
        else:
            lo = mid
    return best()


MAX_TOL = 0.1
"""The largest tolerance :func:`calibrate_budget` takes: within it of its target, a
realized compute fraction is taken as the budget's."""


UNREACHED = 0.02
"""A calibrated budget whose realized compute stays further than this (or 4 ``tol``) from
it gets a warning: no offset made the model run that little, or that much."""


def calibrate_budget(model: nn.Module, pairs: Sequence[tuple[Tensor, Tensor]], control: int,
                     budget: tuple[float, ...], *, tol: float = 0.005,
                     max_calls: int = 16,
                     subnetworks: tuple[str, ...] = SUBNETWORKS,
                     measure: Measure | None = None) -> BudgetCalibration:
    """Offsets that bring the realized fractions of ``control`` on ``pairs`` to ``budget``.

    pairs: held-out ``(src (1, S), tgt_in (1, T))`` pairs, run teacher forced at batch 1
        (as :func:`~dynaseq.techniques.cct.layers.realized_fraction` measures).
    budget: ``(encoder, decoder)`` target fractions in (0, 1], one per ``subnetworks``.
    subnetworks: the gated sub-networks, in budget order (an encoder-only CCT: ``("encoder",)``
        with ``pairs`` of ``(tokens (1, S), segments (1, S))``: any model called as
        ``model(a, b, control)``).
    tol: stop a sub-network's search once within this of its target.
    max_calls: passes over ``pairs`` per sub-network at most.
    measure: counts the MACs that ran instead of the batch-1 passes over ``pairs`` (which
        may then be empty): :data:`Measure`.
    """
    if len(budget) != len(subnetworks) or not all(0 < b <= 1 for b in budget):
        what = ("an (encoder, decoder) pair of fractions" if subnetworks == SUBNETWORKS
                else f"one fraction per sub-network {list(subnetworks)}")
        raise ValueError(f"a budget is {what} in (0, 1], got {budget}")
    if not (isinstance(tol, (int, float)) and 0 < tol <= MAX_TOL):
        raise DynaseqError(f"tol must be in (0, {MAX_TOL:g}], got {tol!r}")
    with evaluating(model):
        meter = _Meter(model, pairs, control, subnetworks, measure)
        offsets = dict.fromkeys(subnetworks, 0.0)
        uncalibrated = meter(offsets)
        for j, target in zip(subnetworks, budget, strict=True):
            def f(x: float, j: str = j) -> float:
                return meter({**offsets, j: x})[j]

            offsets[j], _ = _solve(f, target, tol, max_calls)
        realized = meter(offsets)
    assert all(math.isfinite(v) for v in offsets.values())
    got = [realized[j] for j in subnetworks]
    if max(abs(r - b) for r, b in zip(got, budget, strict=True)) > max(4 * tol, UNREACHED):
        warnings.warn(f"budget {', '.join(f'{b:g}' for b in budget)} is out of reach: the "
                      f"closest realized compute is {', '.join(f'{r:.3f}' for r in got)}",
                      stacklevel=2)
    return BudgetCalibration(tuple(float(b) for b in budget), control, offsets,
                             {k: round(v, 4) for k, v in realized.items()},
                             {k: round(v, 4) for k, v in uncalibrated.items()})


def nearest_control(trained: Sequence[tuple[float, ...]], budget: tuple[float, ...]) -> int:
    """The trained budget closest to ``budget`` (Euclidean over (encoder, decoder)); ties go
    to the larger trained budget, then the first listed."""
    if not trained:
        raise ValueError("no trained budgets")
    return min(range(len(trained)),
               key=lambda i: (math.dist(trained[i], budget), -sum(trained[i]), i))


def same_budget(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two budgets (one fraction per sub-network) are the same within 1e-6."""
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-6)
                                    for x, y in zip(a, b, strict=True))


def merge_calibrations(held: Sequence[BudgetCalibration], fitted: Sequence[BudgetCalibration]
                       ) -> list[BudgetCalibration]:
    """``held`` without the budgets ``fitted`` calibrates again, then ``fitted``."""
    return [c for c in held if not any(same_budget(c.budget, f.budget) for f in fitted)
            ] + list(fitted)


def distinct_budgets(budgets: Sequence[tuple[float, ...]]) -> list[tuple[float, ...]]:
    """``budgets`` with each repeat (:func:`same_budget`) left out, the first kept: a
    budget asked twice is calibrated once."""
    out: list[tuple[float, ...]] = []
    for b in budgets:
        if not any(same_budget(b, o) for o in out):
            out.append(b)
    return out
