"""A translation run's config: the seq2seq model (with at most one technique section), the
parallel data, the training and the decoding settings; saved as ``config.yaml``.

Example::

    cfg = load_config("configs/multi30k_small.yaml", ["train.max_steps=100"])  # tasks.registry
    cfg.model.d_model, cfg.model.cct  # 256, CCTConfig(...) or None
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from dynaseq.core.config import MODEL_SIZES, TrainConfig, apply_size, check_fraction, check_positive
from dynaseq.core.errors import ConfigError
from dynaseq.data.tokenizer import SubwordSettings
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
from dynaseq.techniques.cct.config import CCTConfig

#: The ``task:`` of a translation config (the default when a config names none).
TASK = "seq2seq"

__all__ = ["MODEL_SIZES", "TASK", "DataConfig", "DecodeConfig", "ModelConfig", "RunConfig"]



@dataclass
class ModelConfig:
    """Dense pre-LayerNorm Transformer encoder-decoder.

    ``size`` picks a named preset (``tiny``/``small``/``base``/``big``) whose values fill every
    dimension (``d_model``, ``ffn_dim``, ``n_heads``) the config does not set itself, from
    YAML and from Python alike: ``ModelConfig(size="base")`` is a base model, and
    ``ModelConfig(size="small", ffn_dim=128)`` a small one with a narrower FFN. Without a
    size the unset dimensions are ``tiny``'s. At most one of ``cct`` (conditional computation),
    ``dmb`` (dynamic multi-branch layers) and ``moe`` (its mixture-of-experts baseline) is set.
    """

    size: str | None = None
    d_model: int | None = None  # None: the size's (or tiny's) value
    ffn_dim: int | None = None
    n_heads: int | None = None
    encoder_layers: int = 3
    decoder_layers: int = 3
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    share_embeddings: bool = True
    tie_output: bool = True
    max_positions: int = 1024
    cct: CCTConfig | None = None
    dmb: DMBConfig | None = None
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        apply_size(self)
        chosen = [name for name in ("cct", "dmb", "moe") if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise ConfigError(f"{chosen[0]} and {chosen[1]} cannot be combined (a model takes "
                              "at most one of cct, dmb and moe)")
        if self.cct is not None and self.ffn_dim % self.cct.ffn_pieces:
            raise ConfigError(f"ffn_dim={self.ffn_dim} is not divisible by "
                              f"cct.ffn_pieces={self.cct.ffn_pieces}")
        check_positive(self, "d_model", "ffn_dim", "n_heads", "encoder_layers",
                        "decoder_layers", "max_positions")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        check_fraction(self, "dropout", "attention_dropout", "activation_dropout")


@dataclass
class DataConfig(SubwordSettings):
    """Parallel text (one sentence per line, plain or .gz) and its SentencePiece model
    (:class:`~dynaseq.data.tokenizer.SubwordSettings`).
    :attr:`PATHS` name the fields that are files (left out of an exported model)."""

    PATHS: ClassVar[tuple[str, ...]] = ("train_src", "train_tgt", "valid_src", "valid_tgt")

    train_src: str | None = None
    train_tgt: str | None = None
    valid_src: str | None = None
    valid_tgt: str | None = None
    max_tokens: int = 4096
    max_len: int = 256
    long_lines: str = "skip"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "max_tokens", "max_len")
        if self.long_lines not in ("skip", "truncate"):
            raise ConfigError(f"long_lines must be 'skip' or 'truncate', got {self.long_lines!r}")
        if self.max_tokens < self.max_len + 1:
            raise ConfigError(f"max_tokens={self.max_tokens} must be > max_len={self.max_len}")


@dataclass
class DecodeConfig:
    """Search settings; output length is at most ``max_len_a * src_len + max_len_b``."""

    beam: int = 4
    length_penalty: float = 1.0
    max_len_a: float = 1.2
    max_len_b: int = 10
    batch_size: int = 64

    def __post_init__(self) -> None:
        check_positive(self, "beam", "batch_size")
        if self.max_len_a < 0 or self.max_len_b < 0:
            raise ConfigError("max_len_a and max_len_b must be >= 0")


@dataclass
class RunConfig:
    """Everything a training run needs; saved as ``config.yaml`` in the run directory."""

    run_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        bound = length_penalty_bound(self.model.max_positions)
        if not abs(self.decode.length_penalty) <= bound:
            raise ConfigError(f"decode.length_penalty must be within +-{bound:g} for "
                              f"model.max_positions {self.model.max_positions}, got "
                              f"{self.decode.length_penalty}")


def length_penalty_bound(max_positions: int) -> float:
    """The largest ``|length_penalty|`` beam search takes: a finished hypothesis of ``n``
    tokens scores ``log p / n^lp``, and ``n^lp`` must stay within float range (``e^700``) for
    every ``n`` up to ``max_positions``; 100 at 1024 positions."""
    return math.floor(700 / math.log(max(max_positions, 2)))
