"""Per-layer exits, the baselines of adaptive depth (issue 25): an internal classifier after
every layer, trained together (a weighted sum of their losses), and a rule that stops each
row at the first layer whose classifier is sure enough:

* ``branchynet`` (Teerapittayanon et al. 2016): the normalized entropy of the layer's
  prediction ``H(softmax(z)) / ln C`` falls below ``threshold`` (in [0, 1]; 0: never exits
  early, 1: every row leaves after the first layer unless its prediction there is uniform);
* ``shallow-deep`` (Kaya et al. 2019): its largest probability exceeds ``threshold`` (in
  [0, 1]; 1: never exits early, 0: every row leaves after the first layer);
* ``pabee`` (Zhou et al. 2020): the predicted label stayed the same for ``patience``
  consecutive layers (``patience`` + 1 classifiers agree; the counter of the authors' code).

A rule is a plug-in (:data:`EXIT_RULES`, name -> object with ``done(history, value)``), and
how a call exits is one argument of the call (:class:`LayerExit`), never written into the
model; one trained multi-exit model serves every rule. The last layer always exits.

Example::

    LayerExit("pabee", patience=2)                       # PABEE, patience 2
    LayerExit("shallow-deep", threshold=0.9)             # max probability > 0.9
    LayerExit("branchynet", threshold=torch.tensor([.1, .5]))  # one threshold per row
    ExitsConfig(weighting="pabee").loss_weights(6)       # [1, 2, .., 6] / 21
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from dynaseq.core.errors import ConfigError

EXIT_LOGITS = "exit_logits"
"""``AuxOutputs.traces`` key: (B, C) logits of each internal classifier, in layer order
(a multi-exit model's call without a :class:`LayerExit`, as in training)."""
EXIT_LAYER = "exit_layer"
"""``AuxOutputs.traces`` key: (B,) long, the layers each row ran (1 .. L) with a
:class:`LayerExit`."""

#: ``weighting`` values of the training loss: ∝ the layer index (PABEE), or equal.
WEIGHTINGS = ("pabee", "uniform")


class ExitRule(Protocol):
    """Decides which of the rows still running finish after the current layer.

    ``takes``: the name of the rule's one parameter (``threshold`` or ``patience``);
    ``default_field``: the :class:`ExitsConfig` field with its default."""

    takes: str
    default_field: str

    def check(self, value: float | int) -> float | int:
        """The parameter as a number; ConfigError (one line) if out of range."""
        ...

    def done(self, history: Tensor, value: Tensor) -> Tensor:
        """history (R, k, C): logits of the k layers run so far of the R running rows;
        value (R,) the parameter per row -> (R,) bool, True for rows that finish."""
        ...


class _ThresholdRule:
    """A rule whose parameter is a threshold in [0, 1]; ``what`` names it in errors."""

    takes = "threshold"
    what = ""

    def check(self, value: float | int) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"the {self.what} threshold is in [0, 1], got {value!r}") from None
        if not 0 <= v <= 1:  # NaN too
            raise ConfigError(f"the {self.what} threshold is in [0, 1], got {v:g}")
        return v


class EntropyRule(_ThresholdRule):
    """BranchyNet: finish when ``H(softmax(z_k)) / ln C < threshold``."""

    default_field = "entropy_threshold"
    what = "branchynet (normalized entropy)"

    def done(self, history: Tensor, value: Tensor) -> Tensor:
        logp = torch.log_softmax(history[:, -1].float(), -1)  # (R, C)
        entropy = -(logp.exp() * logp).sum(-1) / math.log(logp.size(-1))
        return entropy < value


class MaxProbRule(_ThresholdRule):
    """Shallow-Deep: finish when ``max softmax(z_k) > threshold``."""

    default_field = "max_prob_threshold"
    what = "shallow-deep (max probability)"

    def done(self, history: Tensor, value: Tensor) -> Tensor:
        return torch.softmax(history[:, -1].float(), -1).amax(-1) > value


class PatienceRule:
    """PABEE: finish when the argmax has not changed over the last ``patience`` layers
    (``patience`` + 1 consecutive internal classifiers agree)."""

    takes = "patience"
    default_field = "patience"

    def check(self, value: float | int) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(
                value) or value < 1:
            raise ConfigError(f"pabee's patience is an integer >= 1, got {value!r}")
        return int(value)

    def done(self, history: Tensor, value: Tensor) -> Tensor:
        labels = history.argmax(-1)  # (R, k)
        k = labels.size(1)
        same = (labels[:, 1:] == labels[:, :-1]).long()  # (R, k-1) agreements of neighbours
        # the agreements counted back from the last layer, stopping at the first change
        streak = same.flip(-1).cumprod(-1).sum(-1) if k > 1 else labels.new_zeros(len(labels))
        return streak >= value


#: Rule name -> rule (the names of ``--exit-rule`` and ``model.exits.rule``).
EXIT_RULES: dict[str, ExitRule] = {
    "branchynet": EntropyRule(),
    "shallow-deep": MaxProbRule(),
    "pabee": PatienceRule(),
}


def rule_named(name: str) -> ExitRule:
    """The rule called ``name``; ConfigError naming the known ones otherwise."""
    try:
        return EXIT_RULES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown exit rule {name!r}; known: {', '.join(EXIT_RULES)}"
                          ) from None


@dataclass(frozen=True)
class LayerExit:
    """Per-layer early exit for one call: ``rule`` (a name in :data:`EXIT_RULES`) and its
    parameter, ``threshold`` (branchynet, shallow-deep) or ``patience`` (pabee): one for
    every row, or a (B,) tensor with one per row. Checked on construction (ValueError)."""

    rule: str
    threshold: float | Tensor | None = None
    patience: int | Tensor | None = None

    def __post_init__(self) -> None:
        try:
            r = rule_named(self.rule)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        other = "patience" if r.takes == "threshold" else "threshold"
        if getattr(self, other) is not None:
            raise ValueError(f"{self.rule} takes a {r.takes}, not a {other}")
        value = getattr(self, r.takes)
        if value is None:
            raise ValueError(f"{self.rule} needs a {r.takes}")
        try:
            for v in torch.as_tensor(value).reshape(-1).tolist():
                r.check(v)
        except ConfigError as e:
            raise ValueError(str(e)) from None

    @property
    def exit_rule(self) -> ExitRule:
        return EXIT_RULES[self.rule]

    @property
    def value(self) -> float | int | Tensor:
        """The rule's parameter (threshold or patience)."""
        return getattr(self, self.exit_rule.takes)

    def values(self, n_rows: int, device: torch.device) -> Tensor:
        """(n_rows,) the parameter per row."""
        v = torch.as_tensor(self.value, device=device).reshape(-1)
        if v.numel() not in (1, n_rows):
            raise ValueError(f"{self.exit_rule.takes} per row must have {n_rows} entries, "
                             f"got {v.numel()}")
        return v.expand(n_rows)

    def select(self, index: Tensor) -> LayerExit:
        """The exit of rows ``index`` (a per-row parameter is indexed, one for all kept)."""
        v = self.value
        if isinstance(v, Tensor) and v.numel() > 1:
            return LayerExit(self.rule, **{self.exit_rule.takes: v.index_select(
                0, index.to(v.device))})
        return self

    def describe(self) -> dict[str, object]:
        """``exit_rule`` and its parameter, as an evaluation reports them."""
        v = self.value
        return {"exit_rule": self.rule,
                self.exit_rule.takes: v.tolist() if isinstance(v, Tensor) else v}


@dataclass
class ExitsConfig:
    """The ``model.exits`` section: an internal classifier after every layer of a
    classification encoder (the last layer's is the model's head).

    ``weighting``: the training loss is ``Σ_i w_i · loss_i`` over the L classifiers, with
    ``w_i ∝ i`` (``pabee``, the PABEE paper) or ``w_i = 1/L`` (``uniform``, BranchyNet /
    Shallow-Deep), normalized to sum to 1. ``rule``: the exit rule of a call that names none
    (and of validation); ``entropy_threshold`` (branchynet), ``max_prob_threshold``
    (shallow-deep) and ``patience`` (pabee): each rule's default parameter.

    Example (YAML)::

        model:
          exits: {weighting: pabee, rule: pabee, patience: 3}
    """

    weighting: str = "pabee"
    rule: str = "pabee"
    entropy_threshold: float = 0.3
    max_prob_threshold: float = 0.9
    patience: int = 3

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"exits.weighting must be one of {', '.join(WEIGHTINGS)}, got "
                              f"{self.weighting!r}")
        try:
            rule_named(self.rule)
            for r in EXIT_RULES.values():
                setattr(self, r.default_field, r.check(getattr(self, r.default_field)))
        except ConfigError as e:
            raise ConfigError(f"exits: {e}") from None

    def default(self, rule: str) -> float | int:
        """The default parameter of ``rule``."""
        return getattr(self, rule_named(rule).default_field)

    def loss_weights(self, layers: int) -> Tensor:
        """(layers,) the weights of the internal classifiers' losses, summing to 1."""
        w = (torch.arange(1, layers + 1, dtype=torch.float32) if self.weighting == "pabee"
             else torch.ones(layers))
        return w / w.sum()


def weighted_exit_loss(exit_logits: list[Tensor], weights: Tensor, loss_fn) -> Tensor:
    """``Σ_i w_i · loss_fn(logits_i)`` over the internal classifiers (in layer order)."""
    assert len(exit_logits) == len(weights), "one weight per internal classifier"
    return sum(float(w) * loss_fn(z) for w, z in zip(weights, exit_logits, strict=True))
