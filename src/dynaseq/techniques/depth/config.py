"""The adaptive-depth settings (ALBERTa, paper 004): the ``model.depth`` section of an encoder
run config."""

from __future__ import annotations

from dataclasses import dataclass

from dynaseq.core.config import check_positive
from dynaseq.core.errors import ConfigError


def check_gamma(gamma: float) -> float:
    """γ as a float in (0, 1); :class:`ConfigError` (a one-line message) otherwise."""
    try:
        g = float(gamma)
    except (TypeError, ValueError):
        raise ConfigError(f"gamma is an exit threshold in (0, 1), got {gamma!r}") from None
    if not 0 < g < 1:
        raise ConfigError(f"gamma is an exit threshold in (0, 1), got {g:g}")
    return g


@dataclass
class DepthConfig:
    """ALBERTa's structure predictor and early exit.

    ``first_group``: the layers every input runs before the predictor reads it (the paper's
    first hidden group); the other ``model.layers - first_group`` layers are adaptive.
    ``predictor_hidden``: width of the predictor's MLP. ``revpc``: keep probabilities from
    the reverse cumulative sum of a softmax over depths (the paper); False (the ablation):
    one independent sigmoid per layer, not monotone. ``depth_weight`` λ_d: the compute term
    ``λ_d · E[adaptive layers run] / K`` per loss unit added to the task loss (the paper
    names none; without it the predictor learns to keep every layer, since a deeper model
    scores better, and nothing exits). ``gamma``: the default exit threshold of inference
    (0.1 slow and accurate ... 0.9 fast).
    """

    first_group: int = 2
    predictor_hidden: int = 128
    revpc: bool = True
    depth_weight: float = 0.1
    gamma: float = 0.5

    def __post_init__(self) -> None:
        check_positive(self, "first_group", "predictor_hidden")
        if not self.depth_weight >= 0:
            raise ConfigError(f"depth.depth_weight must be >= 0, got {self.depth_weight}")
        try:
            self.gamma = check_gamma(self.gamma)
        except ConfigError as e:
            raise ConfigError(f"depth.{e}") from None

    def architecture(self) -> dict[str, object]:
        """What must match for weights to load (fine-tuning's init_from)."""
        return {"first_group": self.first_group, "predictor_hidden": self.predictor_hidden,
                "revpc": self.revpc}
