"""The adaptive-depth settings (ALBERTa, paper 004): the ``model.depth`` section of an encoder
run config."""

from __future__ import annotations

from dataclasses import dataclass

from dynaseq.core.arguments import as_real
from dynaseq.core.config import check_positive
from dynaseq.core.errors import ConfigError


def check_gamma(gamma: float) -> float:
    """γ as a float in (0, 1); :class:`ConfigError` (a one-line message) otherwise."""
    try:
        g = as_real(gamma)
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
    scores better, and nothing exits). ``depth_start_step`` / ``depth_ramp_steps`` (not in
    the paper; 0 = off): λ_d is 0 before update ``depth_start_step`` and rises linearly to
    ``depth_weight`` over ``depth_ramp_steps`` -- without it a short run from scratch drops
    the adaptive layers before they have learned anything (their residual branches are
    scaled by p ≈ 0, so they get no gradient and do not come back). ``keep_steps`` (not in
    the paper; 0 = off): for the first ``keep_steps`` updates the compute term is a pull
    towards full depth instead, weight ``-keep_weight``: the task loss alone drops the
    adaptive layers early in training too (an MLM pre-training here went from 9.7 to 2.0
    expected adaptive layers of 10 within 200 updates, with λ_d = 0), so they first train
    as plain layers. The pull saturates the predictor's softmax: an MLM pre-training with
    ``keep_steps`` = 750 of 1500 stayed at 10.0 of 10 expected layers after them (λ_d up to
    0.02), and so did its fine-tuning on SST-2 (λ_d 0.05). ``predictor_from_init`` (False:
    fine-tuning starts a fresh predictor instead of the pre-trained run's; the layers are
    loaded either way). ``gamma``: the default exit threshold of inference (0.1 slow and
    accurate ... 0.9 fast).
    """

    first_group: int = 2
    predictor_hidden: int = 128
    revpc: bool = True
    depth_weight: float = 0.1
    depth_start_step: int = 0
    depth_ramp_steps: int = 0
    keep_steps: int = 0
    keep_weight: float = 1.0
    predictor_from_init: bool = True
    gamma: float = 0.5

    def __post_init__(self) -> None:
        check_positive(self, "first_group", "predictor_hidden")
        if not min(self.depth_weight, self.depth_start_step, self.depth_ramp_steps,
                   self.keep_steps, self.keep_weight) >= 0:
            raise ConfigError("depth.depth_weight, depth_start_step, depth_ramp_steps, "
                              "keep_steps and keep_weight must be >= 0")
        try:
            self.gamma = check_gamma(self.gamma)
        except ConfigError as e:
            raise ConfigError(f"depth.{e}") from None

    def weight_at(self, step: int) -> float:
        """λ_d at update ``step``: ``-keep_weight`` before ``keep_steps``, 0 before
        ``depth_start_step``, then a linear ramp to ``depth_weight``."""
        if step < self.keep_steps:
            return -self.keep_weight
        if step < self.depth_start_step:
            return 0.0
        if self.depth_ramp_steps == 0:
            return self.depth_weight
        return self.depth_weight * min(1.0, (step - self.depth_start_step)
                                       / self.depth_ramp_steps)

    def architecture(self, predictor: bool = True) -> dict[str, object]:
        """What must match for weights to load (fine-tuning's init_from); ``predictor``
        False: the layers' part only (a fine-tuning that starts a fresh predictor may give it
        another width or RevPC setting)."""
        arch: dict[str, object] = {"first_group": self.first_group}
        if predictor:
            arch.update(predictor_hidden=self.predictor_hidden, revpc=self.revpc)
        return arch
