"""Sparsely-gated mixture-of-experts FFN, the DMB paper's baseline (Shazeer et al. 2017).

Noisy top-k gating (Tan et al. 2021, eq. 6-9; Shazeer et al. 2017, eq. 3-5)::

    H(x) = W x + ε ⊙ softplus(W_n x),   ε ~ N(0, I)   (training only)     (eq. 8-9)
    g(x) = softmax(KeepTopK(H(x), k))                                      (eq. 7)
    y    = Σ_i g(x, i) · f_i(x)          (only the k kept experts run)      (eq. 6)

Each expert f_i is a dense FFN ``W2_i ReLU(W1_i x)`` of width ``ffn_dim``, so N experts hold
as many parameters as a DMB FFN with N branches of that width (without its shared part,
which merges away). Each token runs k experts (the paper: k = 2, N = 4), so the MoE spends
k times the expert MACs of a DMB FFN. Execution: the ``M·k`` (token, expert) pairs are
grouped by expert, each expert runs one FFN over its group, and the outputs, scaled by
their gates, are added back to their tokens. At inference there is no noise: ``H(x) = W x``.

Auxiliary losses (Shazeer et al. 2017, section 4 and appendix A), over a batch X:

* importance: ``Importance(X) = Σ_x g(x)``, loss ``CV(Importance(X))²``;
* load: ``P(x, i) = Φ(((W x)_i − kth_excluding(H(x), k, i)) / softplus(W_n x)_i)``, the
  probability that expert i is among the top k under a new draw of its own noise (the other
  experts' noisy values held fixed), ``Load(X) = Σ_x P(x, ·)``, loss ``CV(Load(X))²``;

computed by :mod:`dynaseq.branching.losses` from the :class:`ExpertTrace` records. Both
``W`` and ``W_n`` start at zero (as in Shazeer et al.: no signal and some noise). A small
``noise_epsilon`` is added to the softplus so that ``P(x, i)`` never divides by zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.adaptive.gating import MACS_TRACE, MacsRecord
from dynaseq.branching.branched_linear import BranchedLinear
from dynaseq.branching.routing import BranchGroups
from dynaseq.branching.traces import ROUTE_TRACE, ExpertTrace
from dynaseq.nn.outputs import AuxOutputs


@dataclass
class TopKRoute:
    """A noisy top-k gate's decision for a set of tokens.

    clean_logits: ``(..., N)`` ``W x``.
    gates: ``(..., k)`` ``g(x)`` of the kept experts (softmax over the kept logits, eq. 7).
    experts: ``(..., k)`` long, the kept experts, highest noisy logit first (distinct).
    load: ``(..., N)`` ``P(x, i)`` (training only, None at inference).
    """

    clean_logits: Tensor
    gates: Tensor
    experts: Tensor
    load: Tensor | None

    def dense_gates(self) -> Tensor:
        """``(..., N)`` ``g(x)`` with zeros at the experts that were not kept."""
        return torch.zeros_like(self.clean_logits).scatter(-1, self.experts, self.gates)


def load_probability(clean: Tensor, noisy: Tensor, noise_std: Tensor, k: int) -> Tensor:
    """``P(x, i)`` for every expert: ``Φ((clean_i − kth_excluding(noisy, k, i)) / std_i)``.

    clean, noisy, noise_std: ``(..., N)``, ``noisy = clean + ε·noise_std``; needs ``N > k``.
    ``kth_excluding(v, k, i)``, the k-th largest of v without component i, is the (k+1)-th
    largest of v if ``v_i`` is among the top k, else the k-th largest.
    """
    n = noisy.size(-1)
    if not 1 <= k < n:
        raise ValueError(f"load_probability needs 1 <= k < N, got k={k}, N={n}")
    top = noisy.topk(k + 1, dim=-1).values  # (..., k+1), descending
    threshold_if_in = top[..., k:k + 1]  # (k+1)-th largest
    threshold_if_out = top[..., k - 1:k]  # k-th largest
    is_in = noisy > threshold_if_in
    threshold = torch.where(is_in, threshold_if_in, threshold_if_out)
    z = (clean - threshold) / noise_std
    return 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))


class NoisyTopKGate(nn.Module):
    """Noisy top-k gating (eq. 7-9): ``(..., d_model)`` -> :class:`TopKRoute`.

    Args:
        d_model: input width.
        n_experts: N (> k).
        k: experts per token (the paper: 2).
        noise_epsilon: added to ``softplus(W_n x)``, the noise scale (numerical floor).

    MACs per token: ``d_model·N`` at inference, twice that in training (noise projection).
    """

    def __init__(self, d_model: int, n_experts: int = 4, k: int = 2,
                 noise_epsilon: float = 1e-2) -> None:
        super().__init__()
        if d_model < 1:
            raise ValueError(f"NoisyTopKGate d_model must be >= 1, got {d_model}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if n_experts <= k:
            raise ValueError(f"n_experts must exceed k (noisy top-k gating and its load "
                             f"estimate need an expert left out), got n_experts={n_experts}, "
                             f"k={k}")
        if not noise_epsilon >= 0:
            raise ValueError(f"noise_epsilon must be >= 0, got {noise_epsilon}")
        self.k = k
        self.noise_epsilon = noise_epsilon
        self.w_gate = nn.Linear(d_model, n_experts, bias=False)
        self.w_noise = nn.Linear(d_model, n_experts, bias=False)
        nn.init.zeros_(self.w_gate.weight)
        nn.init.zeros_(self.w_noise.weight)

    @property
    def n_experts(self) -> int:
        return self.w_gate.out_features

    @property
    def d_model(self) -> int:
        return self.w_gate.in_features

    def forward(self, x: Tensor) -> TopKRoute:
        clean = self.w_gate(x)  # (..., N)
        if self.training:
            std = F.softplus(self.w_noise(x)) + self.noise_epsilon
            noisy = clean + torch.randn_like(clean) * std
        else:
            noisy, std = clean, None
        kept, experts = noisy.topk(self.k, dim=-1)  # (..., k)
        gates = kept.softmax(-1)  # KeepTopK sets the others to -inf: softmax over the kept
        load = None if std is None else load_probability(clean, noisy, std, self.k)
        return TopKRoute(clean, gates, experts, load)

    def macs(self, n_tokens: int) -> int:
        """Multiply-adds of gating ``n_tokens`` tokens at inference (no noise projection)."""
        return n_tokens * self.d_model * self.n_experts


class MoEFeedForward(nn.Module):
    """Top-k mixture of N feed-forward experts (eq. 6-9); drop-in for ``FeedForward``.

    Args:
        gate: :class:`NoisyTopKGate` with N experts.
        fc1: :class:`BranchedLinear` ``d_model -> ffn_dim`` with N branches (one per expert).
        fc2: :class:`BranchedLinear` ``ffn_dim -> d_model`` with N branches.
        activation_dropout: dropout after the ReLU (training only).
        name: sub-layer name carried by its traces.

    ``forward(x, aux=None)``: x ``(..., d_model)`` -> ``(..., d_model)``; records an
    :class:`~dynaseq.branching.traces.ExpertTrace` and, at inference, a ``MacsRecord``.
    Build it with :func:`moe_feedforward`.
    """

    def __init__(self, gate: NoisyTopKGate, fc1: BranchedLinear, fc2: BranchedLinear,
                 activation_dropout: float = 0.0, name: str = "ffn") -> None:
        super().__init__()
        n = gate.n_experts
        if fc1.n_branches != n or fc2.n_branches != n:
            raise ValueError(f"the gate has {n} experts but fc1/fc2 have "
                             f"{fc1.n_branches}/{fc2.n_branches} branches")
        if fc1.in_features != gate.d_model or fc2.out_features != gate.d_model:
            raise ValueError(f"fc1 must read and fc2 must write d_model={gate.d_model}, got "
                             f"fc1 {fc1.in_features}->{fc1.out_features}, fc2 "
                             f"{fc2.in_features}->{fc2.out_features}")
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1 writes {fc1.out_features} features but fc2 reads "
                             f"{fc2.in_features}")
        if not 0.0 <= activation_dropout < 1.0:
            raise ValueError(f"activation_dropout must lie in [0, 1), got {activation_dropout}")
        self.gate, self.fc1, self.fc2 = gate, fc1, fc2
        self.dropout = nn.Dropout(activation_dropout)
        self.name = name

    @property
    def n_experts(self) -> int:
        return self.gate.n_experts

    @property
    def k(self) -> int:
        return self.gate.k

    def forward(self, x: Tensor, aux: AuxOutputs | None = None) -> Tensor:
        d = x.size(-1)
        route = self.gate(x)  # gates/experts (..., k)
        flat = x.reshape(-1, d)  # (M, d)
        m = flat.size(0)
        token = torch.arange(m, device=x.device).repeat_interleave(self.k)  # (M·k,)
        groups = BranchGroups.of(route.experts.reshape(-1), self.n_experts)
        token_sorted = token.index_select(0, groups.order)  # pairs grouped by expert
        h = self.dropout(self.fc1.grouped(flat.index_select(0, token_sorted),
                                          groups.sizes).relu_())
        ys = self.fc2.grouped(h, groups.sizes)  # (M·k, d)
        weight = route.gates.reshape(-1).index_select(0, groups.order)  # (M·k,)
        out = flat.new_zeros(m, d).index_add(0, token_sorted, ys * weight[:, None])
        if aux is not None:
            aux.add_trace(ROUTE_TRACE, ExpertTrace(self.name, "input", route.dense_gates(),
                                                   route.experts, route.load, id(self.gate)))
            if not self.training:
                aux.add_trace(MACS_TRACE, MacsRecord(self.name, self.macs(m)))
        return out.view(x.shape)

    def macs(self, n_tokens: int) -> dict[str, int]:
        """Multiply-adds at inference for ``n_tokens`` tokens: k experts each (keys of
        ``FeedForward.macs``) plus ``gate_ffn``. Training also runs the noise projection
        (another ``d_model·N`` per token)."""
        pairs = n_tokens * self.k
        return {"ffn_in": self.fc1.macs(pairs), "ffn_out": self.fc2.macs(pairs),
                "gate_ffn": self.gate.macs(n_tokens)}


def moe_feedforward(d_model: int, ffn_dim: int, n_experts: int = 4, k: int = 2,
                    activation_dropout: float = 0.0, *, noise_epsilon: float = 1e-2,
                    name: str = "ffn") -> MoEFeedForward:
    """MoE FFN with ``n_experts`` experts of width ``ffn_dim`` (the parameter count of a DMB
    FFN with as many branches), top-``k`` noisy gating, no shared part."""
    return MoEFeedForward(
        NoisyTopKGate(d_model, n_experts, k, noise_epsilon),
        BranchedLinear(d_model, ffn_dim, n_experts, shared=False),
        BranchedLinear(ffn_dim, d_model, n_experts, shared=False),
        activation_dropout, name=name)
