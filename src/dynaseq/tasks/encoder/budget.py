"""A call's compute budget for an encoder run: a trained CCT budget -> its control symbol.

A budget is an argument of each call, one for every row or a list with one per row; it is
looked up per row and passed to the model (never written into it), so one batch may hold
rows at different budgets. Dense encoders take no budget.
"""

from __future__ import annotations

import math

import torch

from dynaseq.core.errors import DynaseqError
from dynaseq.tasks.encoder.config import EncoderModelConfig

Budget = float | None
"""One budget: a compute fraction in (0, 1] of a CCT encoder, or None (the largest)."""
Budgets = Budget | list[Budget]


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
    try:
        b = float(budget)
    except (TypeError, ValueError):
        raise DynaseqError(f"a budget is a fraction in (0, 1], got {budget!r}") from None
    if not 0 < b <= 1:
        raise DynaseqError(f"a budget is a fraction in (0, 1], got {budget}")
    for i, trained in enumerate(cfg.cct.controls):
        if math.isclose(trained, b, abs_tol=1e-6):
            return i
    names = ", ".join(f"{c:g}" for c in cfg.cct.controls)
    raise DynaseqError(f"budget {b:g} was not trained; trained budgets: {names}")


def control_for(cfg: EncoderModelConfig, budget: Budgets, n_rows: int,
                device: torch.device) -> int | torch.Tensor | None:
    """The ``control`` argument for ``n_rows`` rows: one id, (n_rows,) ids for a list of
    budgets, or None (dense)."""
    if not isinstance(budget, list):
        return control_id(cfg, budget)
    if len(budget) != n_rows:
        raise DynaseqError(f"{len(budget)} budgets for {n_rows} lines: give one budget, or a "
                           "list with one per line")
    ids = [control_id(cfg, b) for b in budget]
    if cfg.cct is None:
        return None
    return torch.tensor(ids, dtype=torch.long, device=device)


def trained_budget(cfg: EncoderModelConfig, budget: Budget) -> float | None:
    """The fraction a call runs at (None for a dense model)."""
    i = control_id(cfg, budget)
    return None if i is None else cfg.cct.controls[i]
