"""ALBERTa's training plug-in for the encoder tasks (MLM pre-training and fine-tuning): the
structure predictor learns from the task loss through the keep probabilities that scale
each adaptive layer, plus a compute term (see :class:`DepthTraining`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dynaseq.core.config import TrainConfig
from dynaseq.techniques.depth.config import DepthConfig
from dynaseq.techniques.depth.exits import DEPTH_PROBS


def expected_depth(aux: Any) -> tuple[Tensor, int]:
    """(B,) E[adaptive layers run] = Σ_i p_i of each row of the call's keep probabilities
    (concatenated over the calls recorded in ``aux``), and K, the adaptive layers."""
    probs = aux.traces.get(DEPTH_PROBS, [])
    assert probs, "an adaptive-depth model records its keep probabilities in training"
    return torch.cat([p.sum(-1) for p in probs]), probs[0].size(-1)


@dataclass
class DepthTraining:
    """Adds ``λ_d · n_units · mean_rows(Σ_i p_i) / K`` to the task loss (``depth.depth_weight``
    λ_d, ramped in by :meth:`DepthConfig.weight_at`, negative while ``depth.keep_steps``
    hold the layers at full depth; K adaptive layers): the expected share of the adaptive
    layers a row keeps, weighted by the micro-batch's loss units (masked tokens, or sentences) so that the loop's division
    by the update's units makes it a per-unit average like the task loss. Logs
    ``expected_depth`` (adaptive layers, mean over rows) per unit."""

    depth: DepthConfig

    @classmethod
    def from_config(cls, depth: DepthConfig, train: TrainConfig) -> DepthTraining:
        return cls(depth)

    def before_update(self, model: nn.Module, step: int) -> None:
        pass

    def keeps_best(self, step: int) -> bool:
        """The compute term only ramps the depth down: any validated model may become
        ``best/``."""
        return True

    def controls(self, n_rows: int, step: int, micro: int) -> None:
        return None

    def loss(self, aux: Any, valid: Tensor, control: Tensor | None, n_units: int,
             step: int = 0) -> tuple[Tensor, dict[str, float]]:
        rows, k = expected_depth(aux)
        e = rows.mean()
        term = self.depth.weight_at(step) * n_units * e / k
        return term, {"expected_depth": float(e.detach()) * n_units}
