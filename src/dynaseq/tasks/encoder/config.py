"""The sections every encoder run (``task: mlm`` or ``task: classify``) shares: the
``model`` section, the training defaults both tasks start from and the vocabulary settings
of their data sections.

Example::

    EncoderModelConfig(size="small", layers=4)                       # BERT-Mini-like
    EncoderModelConfig(size="small", embedding_dim=128, share_layers="all")   # ALBERT
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dynaseq.core.config import TrainConfig, apply_size, check_fraction, check_positive
from dynaseq.core.errors import ConfigError
from dynaseq.data.tokenizer import SubwordSettings
from dynaseq.tasks.encoder.vocab import SYMBOLS
from dynaseq.techniques.cct.config import EncoderCCTConfig
from dynaseq.techniques.depth.config import DepthConfig
from dynaseq.techniques.depth.multi_exit import ExitsConfig

#: ``share_layers`` values: no sharing, one layer for every depth, or ``layer_groups``
#: groups of consecutive depths sharing one layer each (ALBERT sec. 3.1 / 4.5).
SHARING = ("none", "all", "groups")


@dataclass
class EncoderSubwordSettings(SubwordSettings):
    """:class:`~dynaseq.data.tokenizer.SubwordSettings` of an encoder's vocabulary, which
    holds [CLS], [SEP] and [MASK] after the four special ids."""

    RESERVED_IDS: ClassVar[int] = SubwordSettings.RESERVED_IDS + len(SYMBOLS)


@dataclass
class EncoderModelConfig:
    """Pre-LN Transformer encoder (BERT-style) with ALBERT's options.

    ``size`` fills ``d_model``/``ffn_dim``/``n_heads`` as for translation models
    (:data:`~dynaseq.core.config.MODEL_SIZES`), ``layers`` is the depth. ``embedding_dim`` E
    (default d_model): E < d factorizes the embedding (V·E + E·d parameters).
    ``share_layers``: ``none``, ``all`` (one layer applied ``layers`` times) or ``groups``
    (``layer_groups`` distinct layers, each for ``layers / layer_groups`` consecutive depths).
    ``max_positions``: the longest input; ``absolute_positions``: learned absolute position
    embeddings (False: none, relative positions only); ``relative_positions`` R > 0: every
    self-attention adds ALBERTa's relative scores over distances clipped to [−R, R]
    (:class:`~dynaseq.nn.relative_scores.RelativeScores`; 0: none). ``dropout`` on
    embeddings and residuals, ``attention_dropout`` on attention probabilities,
    ``classifier_dropout`` before the classification layer. ``cct``: the CCT's gated
    sub-layers (CCT-BERT). ``depth``: adaptive depth (ALBERTa: a structure predictor after
    ``depth.first_group`` layers, early exit). ``layerdrop`` p in [0, 1): LayerDrop
    training (Fan et al. 2019), each layer application skipped with probability p per
    micro-batch (prune to a fixed depth at inference: ``--keep-layers``). ``layer_heads``:
    the heads each distinct layer kept after head pruning (``dynaseq prune-heads``; None: all
    ``n_heads``; each head keeps its width ``d_model / n_heads``). ``exits``: an internal
    classifier after every layer and per-layer exit rules (BranchyNet, Shallow-Deep, PABEE;
    classification only).
    """

    size: str | None = None
    d_model: int | None = None
    ffn_dim: int | None = None
    n_heads: int | None = None
    layers: int = 4
    embedding_dim: int | None = None
    share_layers: str = "none"
    layer_groups: int = 1
    max_positions: int = 512
    absolute_positions: bool = True
    relative_positions: int = 0
    n_segments: int = 2
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation_dropout: float = 0.0
    classifier_dropout: float = 0.1
    cct: EncoderCCTConfig | None = None
    depth: DepthConfig | None = None
    layerdrop: float = 0.0
    layer_heads: list[int] | None = None
    exits: ExitsConfig | None = None

    def __post_init__(self) -> None:
        apply_size(self)
        if self.embedding_dim is None:
            self.embedding_dim = self.d_model
        check_positive(self, "d_model", "ffn_dim", "n_heads", "layers", "embedding_dim",
                       "layer_groups", "max_positions", "n_segments")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.embedding_dim > self.d_model:
            raise ConfigError(f"embedding_dim={self.embedding_dim} must be <= "
                              f"d_model={self.d_model}")
        if self.share_layers not in SHARING:
            raise ConfigError(f"share_layers must be one of {', '.join(SHARING)}, got "
                              f"{self.share_layers!r}")
        if self.share_layers == "groups" and self.layers % self.layer_groups:
            raise ConfigError(f"layers={self.layers} is not divisible by "
                              f"layer_groups={self.layer_groups}")
        if self.cct is not None and self.ffn_dim % self.cct.ffn_pieces:
            raise ConfigError(f"ffn_dim={self.ffn_dim} is not divisible by "
                              f"cct.ffn_pieces={self.cct.ffn_pieces}")
        check_fraction(self, "dropout", "attention_dropout", "activation_dropout",
                       "classifier_dropout")
        if self.relative_positions < 0:
            raise ConfigError(f"relative_positions must be >= 0, got {self.relative_positions}")
        if self.relative_positions and self.cct is not None:
            raise ConfigError("relative_positions is not available with the CCT's gated "
                              "attention (model.cct)")
        if self.depth is not None and self.depth.first_group >= self.layers:
            raise ConfigError(f"depth.first_group={self.depth.first_group} leaves no adaptive "
                              f"layer of model.layers={self.layers}")
        check_fraction(self, "layerdrop")
        if self.layerdrop and (self.depth is not None or self.cct is not None):
            raise ConfigError("model.layerdrop is for dense encoders (not with model.depth or "
                              "model.cct)")
        if self.layer_heads is not None:
            n = max(self.plan) + 1
            if len(self.layer_heads) != n or not all(
                    0 <= h <= self.n_heads for h in self.layer_heads):
                raise ConfigError(f"layer_heads must list {n} head counts (one per distinct "
                                  f"layer) in [0, {self.n_heads}], got {self.layer_heads}")
            if self.cct is not None:
                raise ConfigError("layer_heads (pruned heads) is for dense attention, not with "
                                  "model.cct")

        if self.exits is not None and (self.layerdrop or self.layer_heads is not None):
            raise ConfigError("model.exits (internal classifiers) does not combine with "
                              "model.layerdrop or layer_heads")
        if self.exits is not None and (self.depth is not None or self.cct is not None):
            raise ConfigError("model.exits (internal classifiers) does not combine with "
                              f"model.{'depth' if self.depth is not None else 'cct'}")

    def check_input_length(self, key: str, length: int) -> None:
        """Raise :class:`ConfigError` if inputs of ``length`` tokens (the run config's ``key``,
        e.g. ``data.max_len``) do not fit ``max_positions``."""
        if length > self.max_positions:
            raise ConfigError(f"{key}={length} exceeds model.max_positions={self.max_positions}")

    @property
    def plan(self) -> list[int]:
        """Which distinct layer runs at each depth (see ``share_layers``)."""
        if self.share_layers == "all":
            return [0] * self.layers
        if self.share_layers == "groups":
            return [i * self.layer_groups // self.layers for i in range(self.layers)]
        return list(range(self.layers))

    def architecture(self, predictor: bool = True) -> dict[str, object]:
        """What must match for weights to load into this model (fine-tuning's init_from):
        every field but the dropouts, the CCT's training schedule and its budget weight;
        ``predictor`` False: not the structure predictor's (:meth:`DepthConfig.architecture`)."""
        keys = ("d_model", "ffn_dim", "n_heads", "layers", "embedding_dim", "share_layers",
                "layer_groups", "max_positions", "absolute_positions", "relative_positions",
                "n_segments")
        arch: dict[str, object] = {k: getattr(self, k) for k in keys}
        if self.share_layers != "groups":
            arch.pop("layer_groups")
        c = self.cct
        arch["cct"] = None if c is None else {
            "ffn_pieces": c.ffn_pieces, "control_hidden": c.control_hidden,
            "controls": c.controls, "output_norms": c.output_norms}
        arch["depth"] = None if self.depth is None else self.depth.architecture(predictor)
        arch["layer_heads"] = self.layer_heads
        return arch


@dataclass
class EncoderTrainConfig(TrainConfig):
    """:class:`TrainConfig` with the defaults BERT-style training shares, pre-training and
    fine-tuning alike: Adam's ``adam_eps`` 1e-6 (BERT), no label smoothing, the ``cosine``
    schedule (linear warm-up, then decay). Each task sets its own lr and step counts."""

    adam_eps: float = 1e-6
    label_smoothing: float = 0.0
    schedule: str = "cosine"
