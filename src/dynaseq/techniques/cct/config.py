"""The CCT's settings (Bapna et al. 2020): the ``model.cct`` section of a run config."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynaseq.core.config import check_positive
from dynaseq.core.errors import ConfigError


@dataclass
class GateSettings:
    """The settings every CCT section shares (:class:`CCTConfig`, :class:`EncoderCCTConfig`),
    documented with :class:`CCTConfig`: pieces M and control width, the gate noise ramp,
    λ and its curriculum, the budget estimate, the control symbols' scale, the output
    LayerNorms and the inference fast paths. Its checks raise :class:`ConfigError`."""

    ffn_pieces: int = 4
    control_hidden: int = 128
    alpha_max: float = 5.0
    noise_ramp_steps: int = 10_000
    budget_weight: float = 1.0
    budget_start_step: int = 0
    budget_ramp_steps: int = 0
    budget_estimate: str = "soft"
    control_init_std: float = 1.0
    output_norms: bool = True
    fast_paths: bool = True

    def __post_init__(self) -> None:
        check_positive(self, "ffn_pieces", "control_hidden")
        if not self.control_init_std >= 0:
            raise ConfigError(f"control_init_std must be >= 0, got {self.control_init_std}")
        if min(self.alpha_max, self.noise_ramp_steps, self.budget_weight,
               self.budget_start_step, self.budget_ramp_steps) < 0:
            raise ConfigError("alpha_max, noise_ramp_steps, budget_weight, budget_start_step "
                              "and budget_ramp_steps must be >= 0")
        if self.budget_estimate not in ("soft", "hard"):
            raise ConfigError(f"budget_estimate must be 'soft' or 'hard', got "
                              f"{self.budget_estimate!r}")

    @property
    def noise_start_step(self) -> int:
        """The first update whose gates get noise (0 here; a CCT-BERT's gate warm-up)."""
        return 0

    def sampled_share(self, step: int) -> float:
        """The share of sequences that draw a budget at ``step`` (the rest: the first
        control, the full or largest budget)."""
        if step < self.budget_start_step:
            return 0.0
        if self.budget_ramp_steps == 0:
            return 1.0
        return min((step - self.budget_start_step) / self.budget_ramp_steps, 1.0)


@dataclass
class CCTConfig(GateSettings):
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

    ``fast_paths``: at inference, a gated sub-layer call whose gates are all off is not
    entered (zeros, no projection), and one whose gates are all on runs dense, without
    gather/scatter (:class:`~dynaseq.techniques.cct.conditional_attention.ConditionalAttention`,
    :class:`~dynaseq.techniques.cct.conditional_ffn.ConditionalFeedForward`). False forces
    the general path for every call (same outputs; for tests and benchmarks).
    """

    budgets: list[tuple[float, float]] = field(default_factory=lambda: [(1.0, 1.0)])
    budget_grid: list[float] | None = None
    distill_weight: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ConfigError(f"distill_weight must be in [0, 1], got {self.distill_weight}")
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


#: The paper's budgets for CCT-BERT (Bapna et al. 2020, sec. 5): P_BERT.
P_BERT = [0.8, 0.8, 0.8, 0.5, 0.33, 0.2]


@dataclass
class EncoderCCTConfig(GateSettings):
    """A CCT in an encoder-only model (CCT-BERT, Bapna et al. 2020 sec. 5): the ``model.cct``
    section of an ``mlm`` or ``classify`` run.

    ``budgets``: one compute fraction per entry (encoder only); every training sequence draws
    one entry uniformly, so repeats weigh it (default P_BERT = [.8, .8, .8, .5, .33, .2]: the
    paper found that training p = 1.0 hurt the MLM loss, which it ascribes to the [MASK]
    token's special role, sec. 8 (ii)). Each distinct value gets one control symbol
    (:attr:`controls`). ``budget_weight`` is λ of eq. 8 (0.3 in pre-training; the paper
    scales it to the task loss when fine-tuning, so set it per run). ``alpha_max``,
    ``noise_ramp_steps`` (paper: 0 -> 5 over 300k steps), ``ffn_pieces`` (M = 4),
    ``control_hidden``, ``budget_estimate``, ``control_init_std``, ``output_norms``,
    ``budget_start_step``, ``budget_ramp_steps`` and ``fast_paths`` as in :class:`CCTConfig`
    (the curriculum gives the largest budget, the first entry, before the ramp).

    ``gate_warmup_steps`` (not in the paper; 0 = off): updates before it train the gates
    soft, with no noise and no budget loss (the noise ramp starts there, and the model
    cannot become the run's best before it). For short runs: on WikiText-2 every dense
    encoder leaves the masked-LM unigram plateau (loss ~6) by ~1000 updates, while a CCT
    with noise and budget loss from the first update was still on it after 3000 (H200) and
    1200 (CPU). With 1500 warm-up updates, ``control_init_std`` 0 and no ``output_norms``
    it left the plateau at 1000 and kept learning under noise and budgets
    (benchmarks/results/cct_bert_plateau.md).
    """

    budget_weight: float = 0.3
    budgets: list[float] = field(default_factory=lambda: list(P_BERT))
    gate_warmup_steps: int = 0

    @property
    def noise_start_step(self) -> int:
        return self.gate_warmup_steps

    def budget_weight_at(self, step: int) -> float:
        """λ at update ``step``: 0 during the gate warm-up, ``budget_weight`` after."""
        return 0.0 if step < self.gate_warmup_steps else self.budget_weight

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gate_warmup_steps < 0:
            raise ConfigError(f"gate_warmup_steps must be >= 0, got {self.gate_warmup_steps}")
        if not self.budgets or not all(0.0 < b <= 1.0 for b in self.budgets):
            raise ConfigError(f"budgets must list fractions in (0, 1], got {self.budgets}")
        self.budgets = [float(b) for b in self.budgets]

    @property
    def controls(self) -> list[float]:
        """The distinct budgets in first-seen order: control symbol i stands for
        ``controls[i]``."""
        return list(dict.fromkeys(self.budgets))

    @property
    def sampling_ids(self) -> list[int]:
        """The control symbol of each ``budgets`` entry."""
        return [self.controls.index(b) for b in self.budgets]

    @property
    def largest_control(self) -> int:
        """The control id of the largest trained budget."""
        c = self.controls
        return max(range(len(c)), key=lambda i: (c[i], -i))
