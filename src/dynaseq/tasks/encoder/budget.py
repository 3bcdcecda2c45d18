"""A call's compute budget for an encoder run: a trained or calibrated CCT budget -> the
``control`` argument of the model call.

A budget is an argument of each call, one for every row or a list with one per row; it is
looked up per row and passed to the model (never written into it), so one batch may hold
rows at different budgets. A calibrated budget (``dynaseq calibrate``, trained or not) runs
with its control symbol and its gate offset (:class:`~dynaseq.techniques.cct.gating.
BudgetControl`); a trained one with its control symbol alone; a budget of 1 opens every
gate (its control networks have nothing to decide). Dense encoders take no budget.

An adaptive-depth encoder (``model.depth``) takes an exit instead (:func:`exit_for`): a
threshold γ on its structure predictor (default the run's ``depth.gamma``; one, or one per
row) or a fixed number of adaptive layers. An encoder without one can be pruned to a fixed
depth instead (:func:`layers_for`: LayerDrop's "every other" layers). A multi-exit encoder
(``model.exits``) takes a per-layer exit rule (:func:`layer_exit_for`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dynaseq.core.arguments import as_real
from dynaseq.core.errors import ConfigError, DynaseqError
from dynaseq.tasks.encoder.config import EncoderModelConfig
from dynaseq.techniques.cct.calibration import BudgetCalibration, budget_offsets
from dynaseq.techniques.cct.gating import BudgetControl
from dynaseq.techniques.depth.config import check_gamma
from dynaseq.techniques.depth.exits import DepthExit
from dynaseq.techniques.depth.layerdrop import every_other
from dynaseq.techniques.depth.multi_exit import LayerExit, rule_named

Budget = float | None
"""One budget: a compute fraction in (0, 1] of a CCT encoder, or None (the largest)."""
Budgets = Budget | list[Budget]
Control = int | torch.Tensor | BudgetControl | None


def as_fraction(budget: object) -> float:
    """``budget`` as a float in (0, 1]; DynaseqError otherwise (a bool or a string too)."""
    try:
        b = as_real(budget)
    except (TypeError, ValueError):
        raise DynaseqError(f"a budget is a fraction in (0, 1], got {budget!r}") from None
    if not 0 < b <= 1:
        raise DynaseqError(f"a budget is a fraction in (0, 1], got {budget}")
    return b


def control_id(cfg: EncoderModelConfig, budget: Budget = None) -> int | None:
    """The control-symbol id of a trained budget (None: the largest); a dense model takes
    none. Raises DynaseqError naming the trained budgets."""
    if cfg.cct is None:
        if budget is not None:
            raise DynaseqError("this is a dense encoder, which has no compute-budget knob "
                               "(train it with a model.cct section to get one)")
        return None
    if budget is None:
        return cfg.cct.largest_control
    b = as_fraction(budget)
    for i, trained in enumerate(cfg.cct.controls):
        if math.isclose(trained, b, abs_tol=1e-6):
            return i
    names = ", ".join(f"{c:g}" for c in cfg.cct.controls)
    raise DynaseqError(f"budget {b:g} was not trained; trained budgets: {names}")


def budget_setting(cfg: EncoderModelConfig, budget: Budget,
                   calibrations: Sequence[BudgetCalibration] = ()
                   ) -> tuple[int | None, BudgetCalibration | None]:
    """The control id a budget runs with and its calibration (None if none): a calibrated
    budget (trained or not) takes its calibration, else it must be trained."""
    if cfg.cct is None:
        return control_id(cfg, budget), None  # a dense encoder: nothing to calibrate
    b = cfg.cct.controls[cfg.cct.largest_control] if budget is None else as_fraction(budget)
    for cal in calibrations:
        if math.isclose(cal.budget[0], b, abs_tol=1e-6):
            return cal.control, cal
    try:
        return control_id(cfg, budget), None
    except DynaseqError as e:
        names = ", ".join(f"{c.budget[0]:g}" for c in calibrations)
        raise DynaseqError(f"{e}{'; calibrated: ' + names if names else ''} (dynaseq "
                           f"calibrate RUN --data FILE --budgets {budget} can fit it)"
                           ) from None


def control_for(cfg: EncoderModelConfig, budget: Budgets, n_rows: int, device: torch.device,
                calibrations: Sequence[BudgetCalibration] = ()) -> Control:
    """The ``control`` argument for ``n_rows`` rows: one id or :class:`BudgetControl` for
    every row, or per row for a list of budgets (``(n_rows,)`` ids, or a BudgetControl with
    per-row offsets when one is calibrated); None for a dense model."""
    if not isinstance(budget, list):
        control, cal = budget_setting(cfg, budget, calibrations)
        offsets = _offsets(cfg, control, cal)
        return BudgetControl(control, offsets) if offsets else control
    if len(budget) != n_rows:
        raise DynaseqError(f"{len(budget)} budgets for {n_rows} lines: give one budget, or a "
                           "list with one per line")
    settings = [budget_setting(cfg, b, calibrations) for b in budget]
    if cfg.cct is None:
        return None
    offsets = [_offsets(cfg, c, cal) for c, cal in settings]
    if not any(offsets):
        return torch.tensor([c for c, _ in settings], dtype=torch.long, device=device)
    return BudgetControl.per_row([c for c, _ in settings], offsets, device=device)


def _offsets(cfg: EncoderModelConfig, control: int | None,
             cal: BudgetCalibration | None) -> dict[str, float]:
    """A budget's gate offsets: the calibration's, with every gate open where the budget is
    1 (:func:`~dynaseq.techniques.cct.calibration.budget_offsets`); none for a dense model."""
    if control is None:
        return {}
    budget = cal.budget if cal is not None else (cfg.cct.controls[control],)
    return budget_offsets(budget, cal, ("encoder",))


def trained_budget(cfg: EncoderModelConfig, budget: Budget,
                   calibrations: Sequence[BudgetCalibration] = ()) -> float | None:
    """The fraction a call runs at (None for a dense model)."""
    if cfg.cct is None:
        control_id(cfg, budget)
        return None
    control, cal = budget_setting(cfg, budget, calibrations)
    return cal.budget[0] if cal is not None else cfg.cct.controls[control]


def nearest_trained(cfg: EncoderModelConfig, budget: float) -> int:
    """The control id of the trained budget closest to ``budget`` (ties: the larger)."""
    c = cfg.cct.controls
    return min(range(len(c)), key=lambda i: (abs(c[i] - budget), -c[i], i))


Gamma = float | list[float] | None
"""An exit threshold γ in (0, 1) for every row, a list with one per row, or None."""


def exit_for(cfg: EncoderModelConfig, gamma: Gamma = None, depth: int | None = None,
             n_rows: int | None = None) -> DepthExit | None:
    """The ``exit`` argument of a call: None for an encoder without adaptive depth (which
    refuses ``gamma``/``depth``), else ``depth`` adaptive layers for every row, or γ (default
    the run's ``depth.gamma``). Raises DynaseqError with one line for bad input."""
    if cfg.depth is None:
        if gamma is not None or depth is not None:
            raise DynaseqError("this encoder has no structure predictor (no adaptive depth): "
                               "--gamma/--depth need a run trained with a model.depth section")
        return None
    if gamma is not None and depth is not None:
        raise DynaseqError("give --gamma or --depth, not both")
    if depth is not None:
        k = cfg.layers - cfg.depth.first_group
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise DynaseqError(f"depth must be an integer, got {depth!r}")
        if not 0 <= depth <= k:
            raise DynaseqError(f"depth {depth} is not in [0, {k}]: this model has {k} adaptive "
                               f"layers after its first {cfg.depth.first_group}")
        return DepthExit(depth=depth)
    if gamma is None:
        return DepthExit(gamma=cfg.depth.gamma)
    try:
        if isinstance(gamma, list):
            return DepthExit(gamma=_per_row(gamma, n_rows, "gammas", check_gamma))
        return DepthExit(gamma=check_gamma(gamma))
    except ConfigError as e:
        raise DynaseqError(str(e)) from None


def _per_row(values: list, n_rows: int | None, what: str,
             check: Callable[[Any], float | int]) -> torch.Tensor:
    """(N,) a call's per-line setting, each value checked (ConfigError); DynaseqError when
    the list does not have one per line."""
    if n_rows is not None and len(values) != n_rows:
        raise DynaseqError(f"{len(values)} {what} for {n_rows} lines: give one, or a list "
                           "with one per line")
    return torch.tensor([check(v) for v in values])


def layers_for(cfg: EncoderModelConfig, keep_layers: int | None = None) -> tuple[int, ...] | None:
    """The ``layers`` argument of a call that keeps ``keep_layers`` of the model's layer
    applications, evenly spaced (LayerDrop's "every other" pruning,
    :func:`~dynaseq.techniques.depth.layerdrop.every_other`); None: every layer. Raises
    DynaseqError with one line for a count outside [1, model.layers] or an adaptive-depth
    model (which has ``depth``/``gamma`` instead)."""
    if keep_layers is None:
        return None
    if cfg.depth is not None:
        raise DynaseqError("--keep-layers is for encoders without a structure predictor; an "
                           "adaptive-depth model takes --depth or --gamma")
    if isinstance(keep_layers, bool) or not isinstance(keep_layers, int) or not (
            1 <= keep_layers <= cfg.layers):
        raise DynaseqError(f"keep-layers {keep_layers} is not in [1, {cfg.layers}] (the "
                           f"model's {cfg.layers} layers)")
    return every_other(cfg.layers, keep_layers)


Threshold = float | list[float] | None
"""A per-layer exit threshold for every row, a list with one per row, or None."""


def layer_exit_for(cfg: EncoderModelConfig, exit_rule: str | None = None,
                   threshold: Threshold = None, patience: int | list[int] | None = None,
                   n_rows: int | None = None) -> LayerExit | None:
    """The ``exit`` argument of a call on a multi-exit encoder (``model.exits``):
    ``exit_rule`` (default the run's ``exits.rule``) with its ``threshold`` (branchynet,
    shallow-deep) or ``patience`` (pabee), default the run's; one for every row or a list,
    one per row. None for an encoder without internal classifiers (which refuses them).
    Raises DynaseqError with one line for bad input."""
    given = {"exit-rule": exit_rule, "threshold": threshold, "patience": patience}
    if cfg.exits is None:
        flags = [f"--{k}" for k, v in given.items() if v is not None]
        if flags:
            raise DynaseqError(f"this encoder has no internal classifiers: {', '.join(flags)} "
                               "need a classification run trained with a model.exits section")
        return None
    name = cfg.exits.rule if exit_rule is None else exit_rule
    try:
        r = rule_named(name)
        other = "patience" if r.takes == "threshold" else "threshold"
        if given[other] is not None:
            raise DynaseqError(f"the {name} rule takes --{r.takes}, not --{other}")
        value = given[r.takes]
        if value is None:
            value = cfg.exits.default(name)
        elif isinstance(value, list):
            value = _per_row(value, n_rows, f"values of {r.takes}", r.check)
        else:
            value = r.check(value)
    except ConfigError as e:
        raise DynaseqError(str(e)) from None
    return LayerExit(name, **{r.takes: value})
