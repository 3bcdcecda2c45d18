"""Typed run configuration: dataclasses validated in ``__post_init__``, YAML in and out.

A run config has four sections (``model``, ``data``, ``train``, ``decode``) and a
``run_dir``. Unknown keys and wrong value types raise :class:`ConfigError` naming the key.

Example::

    cfg = load_config("configs/multi30k_small.yaml", ["train.max_steps=100"])
    save_config(cfg, "run/config.yaml")
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from dynaseq.core.errors import ConfigError
from dynaseq.core.files import atomic_write, read_text

#: Named model sizes. ``tiny`` and ``small`` are the DMB paper's on-device settings.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 128, "ffn_dim": 512, "n_heads": 4},
    "small": {"d_model": 256, "ffn_dim": 1024, "n_heads": 4},
    "base": {"d_model": 512, "ffn_dim": 2048, "n_heads": 8},
    "big": {"d_model": 1024, "ffn_dim": 4096, "n_heads": 16},  # Vaswani et al. (2017) big
}


def _check_positive(obj: Any, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:  # NaN too
            raise ConfigError(f"{name} must be > 0, got {getattr(obj, name)!r}")


def _check_fraction(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {value!r}")


@dataclass
class CCTConfig:
    """Conditional Computation Transformer (Bapna et al. 2020) settings.

    ``budgets`` lists (encoder, decoder) compute fractions; every training sequence draws
    one entry uniformly at random, so repeating an entry samples it more often (the paper's
    {1, 1, 1, .5, .33, .2}). ``budget_grid`` instead gives one list of fractions whose cross
    product (encoder x decoder, repeats kept) is the list, e.g. ``[1, 1, 1, .5, .33, .2]``
    for the paper's 36-entry {1, 1, 1, .5, .33, .2}² table. Each distinct pair gets one
    control symbol (:attr:`controls`).

    ``budget_weight`` is λ of eq. 8. ``budget_start_step`` and ``budget_ramp_steps`` (not in
    the paper; 0 = off) are a curriculum for short runs: before update ``budget_start_step``
    every sequence gets the full budget (the first control, which must be (1, 1)); then the
    share that draws from ``budgets`` rises linearly to 1 over ``budget_ramp_steps``. The
    model first learns the task with every sub-layer, then learns to skip. The paper trains
    300k updates; in 400-update runs on the synthetic task, drawing every budget from the
    first update left even the full-budget model far behind a dense one (validation loss
    3.7 against 1.0), while a single full-budget task kept up (1.2).

    ``budget_estimate``: what the budget loss counts as used compute: ``"soft"`` (the
    paper) the noisy training gates; ``"hard"`` the inference decisions ``1[logit >= 0]``
    with a straight-through gradient (see ``Gate.for_budget``).

    ``control_init_std``: per-dimension std of the control-symbol embeddings at init (a token
    embedding has 1). At 1/sqrt(d) the control nets barely saw the symbol and missed their
    budgets for hundreds of updates on the synthetic task; at 1 the symbol, added to every
    token, is as loud as the token itself and slowed learning on Multi30k (validation loss
    after 200 updates with every gate on 3.46 at 1, 3.30 at 0; dense model 3.12).
    ``output_norms``: the LayerNorms of eq. 12-13 and 15 on K, V, the attention output and
    every FFN piece's output (paper section 8 (i) calls them critical at its scale). False
    drops them (the per-piece input LayerNorms stay): in the same 200-update probe, 3.32
    without against 3.46 with, and 3.21 with neither them nor a loud control symbol. Trained
    the full 1400 updates, neither closed the gap at full budget (benchmarks/results/
    cct_quality.md, "CCT variants"), so the defaults stay as they were: a token-scale
    symbol and the paper's LayerNorms.

    ``distill_weight`` (β, not in the paper; 0 = off): in-place self-distillation
    (:mod:`dynaseq.techniques.cct.self_distill`): sequences drawn below the largest budget also learn
    the largest budget's output distribution on the same batch, weight β against the
    reference. Costs one extra forward pass over them per update. Measured once (Multi30k
    en->fr, 1400 updates, β 0.5) it lost at every budget, most at the lowest (46.1 / 39.1 /
    35.4 / 17.8 BLEU at (b, b), b = 1, .5, .33, .2, against 47.4 / 41.1 / 38.2 / 29.0
    without), so it stays off by default.
    """

    ffn_pieces: int = 4
    control_hidden: int = 128
    alpha_max: float = 5.0
    noise_ramp_steps: int = 10_000
    budgets: list[tuple[float, float]] = field(default_factory=lambda: [(1.0, 1.0)])
    budget_grid: list[float] | None = None
    budget_weight: float = 1.0
    budget_start_step: int = 0
    budget_ramp_steps: int = 0
    budget_estimate: str = "soft"
    control_init_std: float = 1.0
    output_norms: bool = True
    distill_weight: float = 0.0

    def __post_init__(self) -> None:
        _check_positive(self, "ffn_pieces", "control_hidden")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ConfigError(f"distill_weight must be in [0, 1], got {self.distill_weight}")
        if not self.control_init_std >= 0:
            raise ConfigError(f"control_init_std must be >= 0, got {self.control_init_std}")
        if min(self.alpha_max, self.noise_ramp_steps, self.budget_weight,
               self.budget_start_step, self.budget_ramp_steps) < 0:
            raise ConfigError("alpha_max, noise_ramp_steps, budget_weight, budget_start_step "
                              "and budget_ramp_steps must be >= 0")
        if self.budget_estimate not in ("soft", "hard"):
            raise ConfigError(f"budget_estimate must be 'soft' or 'hard', got "
                              f"{self.budget_estimate!r}")
        if self.budget_grid is not None:
            if not self.budget_grid:
                raise ConfigError("budget_grid must list at least one fraction")
            product = [(float(e), float(d)) for e in self.budget_grid for d in self.budget_grid]
            # a saved config holds both; they must agree
            if [tuple(map(float, b)) for b in self.budgets] not in ([(1.0, 1.0)], product):
                raise ConfigError("give either budgets or budget_grid, not both")
            self.budgets = product
        if not self.budgets:
            raise ConfigError("budgets must list at least one (encoder, decoder) budget")
        for pair in self.budgets:
            if len(pair) != 2 or not all(0.0 < b <= 1.0 for b in pair):
                raise ConfigError("budgets entries must be (encoder, decoder) pairs in (0, 1], "
                                  f"got {list(pair)}")
        if self.distill_weight and len(self.controls) < 2:
            raise ConfigError("distill_weight needs at least two distinct budgets: the lower "
                              "ones learn from the largest")
        if (self.budget_start_step or self.budget_ramp_steps) and self.controls[0] != (1.0, 1.0):
            raise ConfigError("budget_start_step/budget_ramp_steps need the full budget (1, 1) "
                              "as the first budgets entry: it is what the curriculum assigns")

    @property
    def largest_control(self) -> int:
        """The control id of the largest trained budget (the first of equal sums)."""
        return max(range(len(self.controls)), key=lambda i: (sum(self.controls[i]), -i))

    def sampled_share(self, step: int) -> float:
        """The share of sequences that draw a budget at ``step`` (the rest: full budget)."""
        if step < self.budget_start_step:
            return 0.0
        if self.budget_ramp_steps == 0:
            return 1.0
        return min((step - self.budget_start_step) / self.budget_ramp_steps, 1.0)

    @property
    def controls(self) -> list[tuple[float, float]]:
        """The distinct (encoder, decoder) budgets in first-seen order: control symbol i
        stands for ``controls[i]``."""
        return list(dict.fromkeys((float(e), float(d)) for e, d in self.budgets))

    @property
    def sampling_ids(self) -> list[int]:
        """The control symbol of each ``budgets`` entry (training draws entries uniformly)."""
        index = {pair: i for i, pair in enumerate(self.controls)}
        return [index[(float(e), float(d))] for e, d in self.budgets]


@dataclass
class DMBConfig:
    """Dynamic multi-branch layers (Tan et al. 2021): ``n_branches`` branches per sub-layer,
    exactly one run per token (top-1 gate).

    ``attention``: DMB attention (branched q/k/v/out projections, eq. 25-30) in every
    attention sub-layer of the encoder and decoder; False keeps dense attention and branches
    the FFNs only (eq. 24; the paper's "w/o DMB attention" ablation). ``shared_private``:
    θ_k = θ_S + θ_Pk with θ_S starting at zero (eq. 21-23); folded into the branches for
    inference. ``aux_weight`` is α of eq. 31; ``diversity`` / ``entropy`` False drop that
    term of the auxiliary loss (eq. 19 / eq. 20; the Table III ablations).
    ``diversity_weight`` scales the diversity term against the entropy term (1 = eq. 31; not
    in the paper: at 1 the routing comes out uniform, at 0 it collapses onto one branch).
    """

    n_branches: int = 4
    attention: bool = True
    shared_private: bool = True
    aux_weight: float = 0.1
    diversity: bool = True
    entropy: bool = True
    diversity_weight: float = 1.0

    def __post_init__(self) -> None:
        _check_positive(self, "n_branches")
        if self.aux_weight < 0:
            raise ConfigError(f"aux_weight must be >= 0, got {self.aux_weight!r}")
        if not self.diversity_weight >= 0:
            raise ConfigError(f"diversity_weight must be >= 0, got {self.diversity_weight!r}")


@dataclass
class MoEConfig:
    """Noisy top-k mixture of experts (Shazeer et al. 2017), the DMB paper's baseline.

    Each expert has the shape of the dense sub-layer it replaces (an FFN of width
    ``ffn_dim``; with ``attention``, also a set of q/k/v/out projections), so with
    ``n_experts`` equal to ``dmb.n_branches`` and the same ``attention`` setting a MoE model
    holds the parameters of the DMB model after its shared part is merged (the gates differ
    by a few ``N·d``: the MoE gate has a noise matrix, the DMB gate a bias), as in the paper
    (Table I: 15.8M both at tiny size). The paper's MoE numbers (313.2M against 229.6M
    Mult-Adds for DMB, tiny) fit experts in attention and FFN alike, each token running k=2
    of them. ``attention`` False puts experts in the FFNs only (Shazeer et al.'s layout).
    ``aux_weight`` is the weight of the importance + load losses (α = 0.1 in the paper).
    """

    n_experts: int = 4
    k: int = 2
    attention: bool = True
    aux_weight: float = 0.1

    def __post_init__(self) -> None:
        _check_positive(self, "n_experts", "k")
        if self.n_experts <= self.k:
            raise ConfigError(f"n_experts must exceed k (noisy top-k gating needs an expert "
                              f"left out), got n_experts={self.n_experts}, k={self.k}")
        if self.aux_weight < 0:
            raise ConfigError(f"aux_weight must be >= 0, got {self.aux_weight!r}")


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
        if self.size is not None and self.size not in MODEL_SIZES:
            raise ConfigError(f"unknown model size {self.size!r}; known: {sorted(MODEL_SIZES)}")
        for name, value in MODEL_SIZES[self.size or "tiny"].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        chosen = [name for name in ("cct", "dmb", "moe") if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise ConfigError(f"{chosen[0]} and {chosen[1]} cannot be combined (a model takes "
                              "at most one of cct, dmb and moe)")
        if self.cct is not None and self.ffn_dim % self.cct.ffn_pieces:
            raise ConfigError(f"ffn_dim={self.ffn_dim} is not divisible by "
                              f"cct.ffn_pieces={self.cct.ffn_pieces}")
        _check_positive(self, "d_model", "ffn_dim", "n_heads", "encoder_layers",
                        "decoder_layers", "max_positions")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        _check_fraction(self, "dropout", "attention_dropout", "activation_dropout")


@dataclass
class DataConfig:
    """Parallel text (one sentence per line, plain or .gz) and its SentencePiece model."""

    train_src: str | None = None
    train_tgt: str | None = None
    valid_src: str | None = None
    valid_tgt: str | None = None
    vocab_size: int = 8000
    spm_model_type: str = "unigram"
    character_coverage: float = 1.0
    max_tokens: int = 4096
    max_len: int = 256
    long_lines: str = "skip"

    def __post_init__(self) -> None:
        _check_positive(self, "vocab_size", "max_tokens", "max_len")
        if self.vocab_size <= 4:
            raise ConfigError(f"vocab_size must be > 4 (the special ids), got {self.vocab_size}")
        if self.long_lines not in ("skip", "truncate"):
            raise ConfigError(f"long_lines must be 'skip' or 'truncate', got {self.long_lines!r}")
        if self.spm_model_type not in ("unigram", "bpe", "char", "word"):
            raise ConfigError(f"unknown spm_model_type {self.spm_model_type!r}")
        if not 0.0 < self.character_coverage <= 1.0:
            raise ConfigError("character_coverage must be in (0, 1]")
        if self.max_tokens < self.max_len + 1:
            raise ConfigError(f"max_tokens={self.max_tokens} must be > max_len={self.max_len}")


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. ``lr`` is the peak of the learning-rate ``schedule``:
    ``inverse_sqrt`` (Vaswani et al.) or ``cosine`` (linear warm-up, then cosine decay to
    ``min_lr_ratio`` · lr at ``max_steps``)."""

    seed: int = 1
    lr: float = 7e-4
    warmup_steps: int = 4000
    betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    update_freq: int = 1
    label_smoothing: float = 0.1
    max_steps: int = 100_000
    max_epochs: int = 1000
    max_minutes: float | None = None
    log_every: int = 50
    valid_every: int = 1000
    save_every: int = 1000
    keep_last: int = 5
    average_last_k: int = 0
    valid_bleu_lines: int = 500
    valid_beam: int = 1
    device: str = "auto"
    schedule: str = "inverse_sqrt"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        _check_positive(self, "lr", "update_freq", "max_steps", "max_epochs", "log_every",
                        "valid_every", "save_every", "keep_last", "valid_beam")
        if self.schedule not in ("cosine", "inverse_sqrt"):
            raise ConfigError(f"schedule must be 'cosine' or 'inverse_sqrt', got "
                              f"{self.schedule!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("min_lr_ratio must be in [0, 1]")
        if self.warmup_steps < 0 or self.average_last_k < 0 or self.valid_bleu_lines < 0:
            raise ConfigError("warmup_steps, average_last_k and valid_bleu_lines must be >= 0")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ConfigError("max_minutes must be > 0")
        if not (self.weight_decay >= 0 and self.clip_norm >= 0 and self.adam_eps > 0):
            raise ConfigError("weight_decay and clip_norm must be >= 0 and adam_eps > 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas must be in [0, 1), got {list(self.betas)}")
        _check_fraction(self, "label_smoothing")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")


@dataclass
class DecodeConfig:
    """Search settings; output length is at most ``max_len_a * src_len + max_len_b``."""

    beam: int = 4
    length_penalty: float = 1.0
    max_len_a: float = 1.2
    max_len_b: int = 10
    batch_size: int = 64

    def __post_init__(self) -> None:
        _check_positive(self, "beam", "batch_size")
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


# --------------------------------------------------------------------------- language models


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
        _check_positive(self, "n_cache", "theta")
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
        _check_positive(self, "max_count")


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
        _check_positive(self, "d_model", "n_layers", "n_heads", "ffn_dim", "context",
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
        _check_fraction(self, "dropout", "attention_dropout", "activation_dropout")


@dataclass
class LMDataConfig:
    """Word-level text (WikiText format: one paragraph a line, ``<eos>`` appended).

    ``batch_size`` parallel streams per update (each window is batch_size x C_e tokens);
    ``eval_batch_size`` streams for validation/test; ``valid_max_tokens`` limits the
    validation run during training (None: the whole valid file)."""

    train: str | None = None
    valid: str | None = None
    test: str | None = None
    batch_size: int = 16
    eval_batch_size: int = 10
    valid_max_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_positive(self, "batch_size", "eval_batch_size")
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
    """:class:`TrainConfig` with LM defaults: the ``cosine`` schedule (MicroNet). Label smoothing is off for perplexity. ``distill``
    (:class:`LMDistillConfig`) trains against a teacher's top-k labels."""

    lr: float = 5e-4
    warmup_steps: int = 1000
    betas: tuple[float, float] = (0.9, 0.98)
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

    task: str = "lm"
    run_dir: str = "runs/lm"
    model: LMModelConfig = field(default_factory=LMModelConfig)
    data: LMDataConfig = field(default_factory=LMDataConfig)
    train: LMTrainConfig = field(default_factory=LMTrainConfig)

    def __post_init__(self) -> None:
        if self.task != "lm":
            raise ConfigError(f"task must be 'lm' for a language-model config, got {self.task!r}")


#: ``task:`` values and their run-config types (a missing key means seq2seq).
TASKS: dict[str, type] = {"seq2seq": RunConfig, "lm": LMRunConfig}


# --------------------------------------------------------------------------- conversion


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it in the field's type."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:  # Optional[X]: X's own, more precise error
            return _coerce(value, non_none[0], key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=f"{key}.")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
            return tuple(_coerce(v, a, key) for v, a in zip(value, args, strict=True))
        inner = args[0] if args else Any
        items = [_coerce(v, inner, key) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if not -(2**63) <= value < 2**63:
            raise ConfigError(f"{key}: {value} is out of range (a 64-bit integer)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


T = typing.TypeVar("T")


def from_dict(cls: type[T], raw: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a plain mapping, refusing unknown keys and bad types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!s}; "
                          f"known keys: {', '.join(sorted(names))}")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}") for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{prefix}{e}" if prefix else str(e)) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain, YAML-safe mapping of a config dataclass (tuples become lists)."""

    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    node[parts[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` strings (values parsed as YAML scalars) to a raw mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        _set_dotted(raw, key.strip(), value)
    return raw


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    text = read_text(p, "config file", ConfigError)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        msg = str(e).replace("\n", " ")
        raise ConfigError(f"config {p} is not valid YAML: {msg}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config {p} must be a mapping at top level")
    return raw


def load_config(path: str | Path | None,
                overrides: list[str] | None = None) -> RunConfig | LMRunConfig:
    """Read a YAML run config (or the defaults when ``path`` is None) plus overrides.

    The top-level ``task`` key picks the config type (:data:`TASKS`): absent or
    ``seq2seq`` gives a :class:`RunConfig`, ``lm`` an :class:`LMRunConfig`.
    """
    raw = read_yaml(path) if path is not None else {}
    raw = apply_overrides(raw, list(overrides or []))
    task = raw.get("task", "seq2seq")
    if not isinstance(task, str) or task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    if task == "seq2seq":
        raw = {k: v for k, v in raw.items() if k != "task"}
    return from_dict(TASKS[task], raw)


def save_config(cfg: Any, path: str | Path) -> None:
    atomic_write(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
