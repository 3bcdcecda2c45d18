"""An MLM pre-training run's config (``task: mlm`` at the top of the YAML).

Example::

    cfg = load_config("configs/wikitext2_mlm_small.yaml")       # tasks.registry
    cfg.model.layers, cfg.data.block_len, cfg.data.mask_prob     # 4, 128, 0.15
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dynaseq.core.config import check_positive, check_task
from dynaseq.core.errors import ConfigError
from dynaseq.tasks.encoder.config import (
    EncoderModelConfig,
    EncoderSubwordSettings,
    EncoderTrainConfig,
)

#: The ``task:`` of an MLM config.
TASK = "mlm"


@dataclass
class MLMDataConfig(EncoderSubwordSettings):
    """Text files (one sentence or paragraph a line, plain or .gz; empty lines skipped) and
    how they become training blocks.

    ``train``: one or more files (WikiText-2 train; GLUE training sentences may be added);
    ``valid``: held-out text for the MLM loss and accuracy. A SentencePiece model of
    ``vocab_size`` (:class:`~dynaseq.tasks.encoder.config.EncoderSubwordSettings`) is trained
    on the training lines (``spm.model`` in the run). Lines are packed, each followed by
    [SEP], into blocks of ``block_len`` tokens starting with [CLS] (BERT's "sentences packed
    up to the length"). ``batch_size`` blocks per micro-batch.
    ``mask_prob`` of the tokens are chosen per block (dynamic masking, new at every update)
    and replaced by [MASK] with ``mask_token_prob``, a random word with ``random_token_prob``,
    else kept (BERT's 80/10/10). ``valid_max_blocks`` caps validation (None: all).
    """

    PATHS: ClassVar[tuple[str, ...]] = ("train", "valid")  # files (not exported)

    train: list[str] = field(default_factory=list)
    valid: str | None = None
    block_len: int = 128
    batch_size: int = 32
    mask_prob: float = 0.15
    mask_token_prob: float = 0.8
    random_token_prob: float = 0.1
    valid_max_blocks: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "batch_size")
        if self.block_len < 3:
            raise ConfigError(f"block_len must be >= 3 ([CLS] word [SEP]), got {self.block_len}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"mask_prob must be in (0, 1), got {self.mask_prob}")
        if not (self.mask_token_prob >= 0 and self.random_token_prob >= 0
                and self.mask_token_prob + self.random_token_prob <= 1.0):
            raise ConfigError("mask_token_prob and random_token_prob must be >= 0 and sum "
                              "to at most 1")
        if self.valid_max_blocks is not None and self.valid_max_blocks <= 0:
            raise ConfigError("valid_max_blocks must be > 0")


@dataclass
class MLMTrainConfig(EncoderTrainConfig):
    """:class:`EncoderTrainConfig` (cosine schedule, no label smoothing) with pre-training's
    lr and step counts."""

    lr: float = 1e-3
    warmup_steps: int = 500
    valid_every: int = 500
    save_every: int = 500


@dataclass
class MLMRunConfig:
    """An MLM pre-training run: selected by ``task: mlm`` at the top of the YAML."""

    task: str = TASK
    run_dir: str = "runs/mlm"
    model: EncoderModelConfig = field(default_factory=EncoderModelConfig)
    data: MLMDataConfig = field(default_factory=MLMDataConfig)
    train: MLMTrainConfig = field(default_factory=MLMTrainConfig)

    def __post_init__(self) -> None:
        check_task(self, TASK, "an MLM")
        self.model.check_input_length("data.block_len", self.data.block_len)
