"""A language-model run's config (``task: lm`` at the top of the YAML): the MicroNet-style
model with its optional neural cache and Hebbian softmax, word-level data, and training
(with optional distillation from a teacher's top-k)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dynaseq.core.config import TrainConfig, check_fraction, check_positive, check_task
from dynaseq.core.errors import ConfigError

#: The ``task:`` of a language-model config.
TASK = "lm"


@dataclass
class LMCacheConfig:
    """Differentiable neural cache (MicroNet §3.5): P = (1−λ)·P_model + λ·P_cache over the
    last ``n_cache`` (hidden state, next word) pairs. ``theta``/``lam`` are the initial
    values; with ``train: true`` they are trained jointly with the model (the cache memory
    carried across consecutive training windows); otherwise they are used as given at
    evaluation only. ``dynaseq cache-search`` re-tunes them on validation."""

    n_cache: int = 2000
    theta: float = 0.016
    lam: float = 0.07
    train: bool = True

    def __post_init__(self) -> None:
        check_positive(self, "n_cache", "theta")
        if not 0.0 < self.lam < 1.0:
            raise ConfigError(f"lam must lie strictly between 0 and 1, got {self.lam!r}")


@dataclass
class LMHebbianConfig:
    """Hebbian softmax (Rae et al. 2018; MicroNet A.1: gamma 0.01, max_count 500): after each
    update the output embedding of each word seen is pulled towards the hidden states that
    predicted it, until the word has been seen ``max_count`` times. ``match_norm`` rescales
    the states to the row's norm first (MicroNet's code)."""

    gamma: float = 0.01
    max_count: int = 500
    match_norm: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"gamma must be in (0, 1], got {self.gamma!r}")
        check_positive(self, "max_count")


@dataclass
class LMModelConfig:
    """MicroNet-style decoder-only LM (Yan et al. 2020, appendix A): relative-position
    attention over a per-layer ``context`` C, trained on windows of ``extended_context`` C_e
    tokens (choose C_e >= n_layers·(C-1)+1 to backpropagate through every dependency),
    adaptive input/softmax with bins ``cutoffs`` and widths ``adaptive_dims`` (default
    ``[d, d/4, d/64]``; MicroNet: d=256, L=8, H=8, d_head=24, ffn 768, C=97, C_e=1152,
    widths [256, 64, 4]). ``d_head`` defaults to d_model / n_heads. ``tie_embeddings`` shares
    the input and output embeddings, ``tie_projections`` also the tail projections.

    Options: ``cache`` (:class:`LMCacheConfig`, a neural cache; off when null), ``hebbian``
    (:class:`LMHebbianConfig`, a Hebbian softmax; off when null) and ``qat_bits`` (set by
    ``dynaseq quantize``: the weights are QAT-converted at that width, and loading re-applies
    the quantization structure before reading them)."""

    d_model: int = 256
    n_layers: int = 8
    n_heads: int = 8
    d_head: int | None = None
    ffn_dim: int = 768
    context: int = 97
    extended_context: int = 1152
    cutoffs: list[int] = field(default_factory=lambda: [3500, 20000])
    adaptive_dims: list[int] | None = None
    tie_embeddings: bool = True
    tie_projections: bool = True
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    cache: LMCacheConfig | None = None
    hebbian: LMHebbianConfig | None = None
    qat_bits: int | None = None

    def __post_init__(self) -> None:
        check_positive(self, "d_model", "n_layers", "n_heads", "ffn_dim", "context",
                        "extended_context")
        if self.qat_bits is not None and not 2 <= self.qat_bits <= 16:
            raise ConfigError(f"qat_bits must be in 2..16, got {self.qat_bits!r}")
        if self.d_head is None and self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by "
                              f"n_heads={self.n_heads} (or set d_head)")
        if self.d_head is not None and self.d_head <= 0:
            raise ConfigError(f"d_head must be > 0, got {self.d_head!r}")
        c = self.cutoffs
        if any(x <= 0 for x in c) or any(a >= b for a, b in zip(c, c[1:], strict=False)):
            raise ConfigError(f"cutoffs must be increasing and > 0, got {c}")
        dims = self.adaptive_dims
        if dims is not None:
            if len(dims) != len(c) + 1:
                raise ConfigError(f"adaptive_dims needs {len(c) + 1} widths (one per bin), "
                                  f"got {dims}")
            if dims[0] != self.d_model or any(x <= 0 for x in dims):
                raise ConfigError(f"adaptive_dims must be > 0 with adaptive_dims[0] = "
                                  f"d_model={self.d_model}, got {dims}")
        check_fraction(self, "dropout", "attention_dropout", "activation_dropout")


@dataclass
class LMDataConfig:
    """Word-level text (WikiText format: one paragraph a line, ``<eos>`` appended).

    ``batch_size`` parallel streams per update (each window is batch_size x C_e tokens);
    ``eval_batch_size`` streams for validation/test; ``valid_max_tokens`` limits the
    validation run during training (None: the whole valid file)."""

    PATHS: ClassVar[tuple[str, ...]] = ("train", "valid", "test")  # files (not exported)

    train: str | None = None
    valid: str | None = None
    test: str | None = None
    batch_size: int = 16
    eval_batch_size: int = 10
    valid_max_tokens: int | None = None

    def __post_init__(self) -> None:
        check_positive(self, "batch_size", "eval_batch_size")
        if self.valid_max_tokens is not None and self.valid_max_tokens <= 0:
            raise ConfigError("valid_max_tokens must be > 0")


@dataclass
class LMDistillConfig:
    """Token-level distillation (MicroNet §4.1) from a teacher's top-k written by
    ``dynaseq distill-data TEACHER --out topk_dir``: loss (1−λ_t)·L_hard + λ_t·L_soft with
    λ_t annealed linearly from ``lam_max`` (step 0) to ``lam_min`` (train.max_steps)."""

    topk_dir: str = ""
    lam_max: float = 0.5
    lam_min: float = 0.05

    def __post_init__(self) -> None:
        if not self.topk_dir:
            raise ConfigError("distill.topk_dir is required")
        for name in ("lam_max", "lam_min"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")


@dataclass
class LMTrainConfig(TrainConfig):
    """:class:`TrainConfig` with LM defaults: the ``cosine`` schedule (MicroNet). Label
    smoothing is off for perplexity. ``distill`` (:class:`LMDistillConfig`) trains against a
    teacher's top-k labels."""

    lr: float = 5e-4
    warmup_steps: int = 1000
    adam_eps: float = 1e-8
    label_smoothing: float = 0.0
    schedule: str = "cosine"
    distill: LMDistillConfig | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.update_freq != 1:
            raise ConfigError("update_freq must be 1 for language models")


@dataclass
class LMRunConfig:
    """A language-model run: selected by ``task: lm`` at the top of the YAML."""

    task: str = TASK
    run_dir: str = "runs/lm"
    model: LMModelConfig = field(default_factory=LMModelConfig)
    data: LMDataConfig = field(default_factory=LMDataConfig)
    train: LMTrainConfig = field(default_factory=LMTrainConfig)

    def __post_init__(self) -> None:
        check_task(self, TASK, "a language-model")
