"""How a call chooses each row's depth at inference (:class:`DepthExit`), one argument of the
call like a budget: never written into the model.

Example::

    DepthExit(gamma=0.5)                   # the structure predictor's depth at γ = 0.5
    DepthExit(gamma=torch.tensor([.1, .9]))  # one γ per row (mixed in one batch)
    DepthExit(depth=3)                     # every row runs 3 adaptive layers (truncated model)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dynaseq.techniques.depth.predictor import exit_depths

DEPTH_PROBS = "depth_probs"
"""``AuxOutputs.traces`` key: (B, K) keep probabilities of each call (training's loss)."""
DEPTH_RUN = "depth_run"
"""``AuxOutputs.traces`` key: (B,) long, the adaptive layers each row ran (early exit)."""
LAYER_ROWS = "layer_rows"
"""``AuxOutputs.traces`` key: a list, rows that entered each adaptive layer (early exit)."""


@dataclass(frozen=True)
class DepthExit:
    """Early exit for one call: ``gamma`` (a float in (0, 1), or (B,) per row) applied to the
    structure predictor's keep probabilities, or ``depth`` (an int, or (B,) long per row)
    adaptive layers regardless of the input (a truncated model; the static-exit baseline).
    Exactly one is given."""

    gamma: float | Tensor | None = None
    depth: int | Tensor | None = None

    def __post_init__(self) -> None:
        if (self.gamma is None) == (self.depth is None):
            raise ValueError("give exactly one of gamma and depth")
        if self.gamma is not None:
            g = torch.as_tensor(self.gamma, dtype=torch.float32)
            if not bool(((g > 0) & (g < 1)).all()):
                raise ValueError(f"gamma is an exit threshold in (0, 1), got {self.gamma}")
        elif bool((torch.as_tensor(self.depth) < 0).any()):
            raise ValueError(f"depth must be >= 0, got {self.depth}")

    def select(self, index: Tensor) -> DepthExit:
        """The exit of rows ``index`` (a per-row γ or depth is indexed, one for all kept)."""
        for name in ("gamma", "depth"):
            v = getattr(self, name)
            if isinstance(v, Tensor) and v.numel() > 1:
                return DepthExit(**{name: v.index_select(0, index.to(v.device))})
        return self

    def depths(self, p: Tensor, n_adaptive: int) -> Tensor:
        """(B, K) keep probabilities -> (B,) long adaptive layers per row, in [0, K]."""
        b = p.size(0)
        if self.gamma is not None:
            g = self.gamma
            if isinstance(g, Tensor) and g.numel() not in (1, b):
                raise ValueError(f"gamma per row must have {b} entries, got {g.numel()}")
            return exit_depths(p, g)
        d = torch.as_tensor(self.depth, device=p.device).long().reshape(-1)
        if d.numel() not in (1, b):
            raise ValueError(f"depth per row must have {b} entries, got {d.numel()}")
        if int(d.max()) > n_adaptive:
            raise ValueError(f"depth {int(d.max())} is above the model's {n_adaptive} adaptive "
                             "layers")
        return d.expand(b).clone()
