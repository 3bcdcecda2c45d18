"""Settings of the branched layers: Transformer-DMB (``model.dmb``, Tan et al. 2021) and its
noisy top-k mixture-of-experts baseline (``model.moe``, Shazeer et al. 2017)."""

from __future__ import annotations

from dataclasses import dataclass

from dynaseq.core.config import check_positive
from dynaseq.core.errors import ConfigError


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
    ``fast_paths``: a call whose tokens all chose one branch (every decoding step at batch
    1) runs that branch's plain matmul instead of the grouped path; False forces the
    grouped path (same outputs; for tests and benchmarks).
    """

    n_branches: int = 4
    attention: bool = True
    shared_private: bool = True
    aux_weight: float = 0.1
    diversity: bool = True
    entropy: bool = True
    diversity_weight: float = 1.0
    fast_paths: bool = True

    def __post_init__(self) -> None:
        check_positive(self, "n_branches")
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
        check_positive(self, "n_experts", "k")
        if self.n_experts <= self.k:
            raise ConfigError(f"n_experts must exceed k (noisy top-k gating needs an expert "
                              f"left out), got n_experts={self.n_experts}, k={self.k}")
        if self.aux_weight < 0:
            raise ConfigError(f"aux_weight must be >= 0, got {self.aux_weight!r}")
