"""Sparsely-gated mixture of experts (Shazeer et al. 2017), the DMB paper's baseline: an FFN
and an attention sub-layer whose projections are mixtures of experts.

Noisy top-k gating (Tan et al. 2021, eq. 6-9; Shazeer et al. 2017, eq. 3-5)::

    H(x) = W x + ε ⊙ softplus(W_n x),   ε ~ N(0, I)   (training only)     (eq. 8-9)
    g(x) = softmax(KeepTopK(H(x), k))                                      (eq. 7)
    y    = Σ_i g(x, i) · f_i(x)          (only the k kept experts run)      (eq. 6)

Each expert f_i is a dense FFN ``W2_i ReLU(W1_i x)`` of width ``ffn_dim``, so N experts hold
as many parameters as a DMB FFN with N branches of that width (without its shared part,
which merges away). Each token runs k experts (the paper: k = 2, N = 4), so the MoE spends
k times the expert MACs of a DMB FFN. Execution: the ``M·k`` (token, expert) pairs are
grouped by expert, each expert runs one FFN over its group, and the outputs, scaled by
their gates, are added back to their tokens (:class:`ExpertPairs`). At inference there is
no noise: ``H(x) = W x``.

:class:`MoEAttention` applies the same gating to the q/k/v/out projections of an attention
sub-layer (routed like DMB attention: the query token's decision for q and out, each attended
token's own decision for its k and v). With experts in attention and FFN alike, a MoE model
has the parameters of a Transformer-DMB with as many branches, as in the paper's Table I
(15.8M each at tiny size), and spends k times DMB's projection MACs (313.2M against 229.6M).

Auxiliary losses (Shazeer et al. 2017, section 4 and appendix A), over a batch X:

* importance: ``Importance(X) = Σ_x g(x)``, loss ``CV(Importance(X))²``;
* load: ``P(x, i) = Φ(((W x)_i − kth_excluding(H(x), k, i)) / softplus(W_n x)_i)``, the
  probability that expert i is among the top k under a new draw of its own noise (the other
  experts' noisy values held fixed), ``Load(X) = Σ_x P(x, ·)``, loss ``CV(Load(X))²``;

computed by :mod:`dynaseq.techniques.branching.losses` from the :class:`ExpertTrace` records. Both
``W`` and ``W_n`` start at zero (as in Shazeer et al.: no signal and some noise). A small
``noise_epsilon`` is added to the softplus so that ``P(x, i)`` never divides by zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.int8 import KEEP_FLOAT, register_int8
from dynaseq.techniques.branching.branched_linear import BranchedLinear
from dynaseq.techniques.branching.routed import RoutedAttention, RoutedFeedForward, _Gated
from dynaseq.techniques.branching.routing import (
    BranchGroups,
    Dispatch,
    GatingUnit,
    Projection,
)
from dynaseq.techniques.branching.traces import ExpertTrace


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


@dataclass
class ExpertPairs:
    """The ``M·k`` (token, expert) pairs of a :class:`TopKRoute`, grouped by expert.

    groups: the pairs sorted by expert (``groups.sizes[i]`` pairs for expert i).
    token: ``(M·k,)`` the token of each pair, in that order.
    weight: ``(M·k,)`` the gate value ``g(x, i)`` of each pair, in that order.

    Each expert runs one matmul over the rows :meth:`gather` lines up for it; :meth:`combine`
    adds the gate-weighted results back to their tokens (eq. 6).
    """

    groups: BranchGroups
    token: Tensor
    weight: Tensor

    @classmethod
    def of(cls, route: TopKRoute, n_experts: int) -> ExpertPairs:
        experts = route.experts.reshape(-1)  # (M·k,) token-major
        k = route.experts.size(-1)
        token = torch.arange(experts.numel() // k, device=experts.device).repeat_interleave(k)
        groups = BranchGroups.of(experts, n_experts, validate=False)
        return cls(groups, token.index_select(0, groups.order),
                   route.gates.reshape(-1).index_select(0, groups.order))

    @property
    def sizes(self) -> list[int]:
        return self.groups.sizes

    def gather(self, flat: Tensor) -> Tensor:
        """``(M, d)`` token rows -> ``(M·k, d)``: each pair's token row, grouped by expert."""
        return flat.index_select(0, self.token)

    def combine(self, ys: Tensor, n_tokens: int) -> Tensor:
        """``(M·k, d')`` pair outputs -> ``(M, d')``: ``Σ_pairs g(x, i) · y`` per token."""
        weighted = ys * self.weight[:, None]  # (autocast: ys lower, the weights float32)
        return weighted.new_zeros(n_tokens, ys.size(-1)).index_add_(0, self.token, weighted)

    def mix(self, proj: BranchedLinear, flat: Tensor) -> Tensor:
        """``Σ_i g(x, i) · (W_i x + b_i)`` over each token's k experts: ``(M, in) -> (M, out)``."""
        return self.combine(proj.grouped(self.gather(flat), self.groups), flat.size(0))


class NoisyTopKGate(GatingUnit):
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
    def scorer(self) -> nn.Linear:
        return self.w_gate

    n_experts = GatingUnit.n_branches

    @property
    def runs_per_token(self) -> int:
        return self.k

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

    def dispatch(self, x: Tensor) -> ExpertDispatch:
        return ExpertDispatch.of(self(x), x, self.n_experts)


@dataclass
class ExpertDispatch(Dispatch):
    """A :class:`NoisyTopKGate`'s decision laid out for grouped matmuls: one row per (token,
    expert) pair, grouped by expert (R = M·k); :meth:`combine` sums each token's k rows
    weighted by their gate values (eq. 6).

    route: the decision; pairs: its pairs grouped by expert; flat: ``(M, d)`` the gate's
    input rows in token order. :meth:`input_rows` gathers them anew at each call.
    """

    route: TopKRoute
    pairs: ExpertPairs
    flat: Tensor

    @classmethod
    def of(cls, route: TopKRoute, x: Tensor, n_experts: int) -> ExpertDispatch:
        """Pair the rows of ``x`` ``(..., d)`` with their ``route.experts`` ``(..., k)``."""
        pairs = ExpertPairs.of(route, n_experts)
        return cls(route, pairs, x.reshape(-1, x.size(-1)))

    @property
    def n_tokens(self) -> int:
        return self.flat.size(0)

    def input_rows(self) -> Tensor:
        return self.pairs.gather(self.flat)

    def gather(self, flat: Tensor) -> Tensor:
        return self.pairs.gather(flat)

    def run(self, proj: Projection, rows: Tensor) -> Tensor:
        return proj.grouped(rows, self.pairs.groups)

    def combine(self, ys: Tensor) -> Tensor:
        return self.pairs.combine(ys, self.n_tokens)

    def trace(self, layer: str, gate: str, stream: str, gate_id: int) -> ExpertTrace:
        """The :class:`ExpertTrace` (it has no ``gate`` field: every MoE gate is top-k)."""
        r = self.route
        return ExpertTrace(layer, stream, r.dense_gates(), r.experts, r.load, gate_id)


class _Experts(_Gated):
    """``n_experts`` and ``k`` of a MoE sub-layer: its gate's."""

    unit_attr = "gate"
    unit_word = "experts"
    gate: NoisyTopKGate
    n_experts = _Gated.n_branches

    @property
    def k(self) -> int:
        """Experts per token."""
        return self.gate.k


class MoEFeedForward(_Experts, RoutedFeedForward):
    """Top-k mixture of N feed-forward experts (eq. 6-9); drop-in for ``FeedForward``.

    Args:
        gate: :class:`NoisyTopKGate` with N experts.
        fc1: :class:`BranchedLinear` ``d_model -> ffn_dim`` with N branches (one per expert).
        fc2: :class:`BranchedLinear` ``ffn_dim -> d_model`` with N branches.
        activation_dropout: dropout after the ReLU (training only).
        name: sub-layer name carried by its traces.

    ``forward(x, aux=None)``: x ``(..., d_model)`` -> ``(..., d_model)``; records an
    :class:`~dynaseq.techniques.branching.traces.ExpertTrace` and, at inference, a ``MacsRecord``.
    ``macs(n_tokens)``: k experts per token (keys of ``FeedForward.macs``) plus ``gate_ffn``;
    training also runs the noise projection (another ``d_model·N`` per token). The forward
    pass and the MAC count are :class:`~dynaseq.techniques.branching.routed.RoutedFeedForward`'s.
    Build it with :func:`moe_feedforward`.
    """

    def __init__(self, gate: NoisyTopKGate, fc1: BranchedLinear, fc2: BranchedLinear,
                 activation_dropout: float = 0.0, name: str = "ffn") -> None:
        super().__init__(gate, fc1, fc2, activation_dropout, name)


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


class MoEAttention(_Experts, RoutedAttention):
    """Multi-head attention whose q/k/v/out projections are top-k mixtures of N experts.

    The attention counterpart of :class:`MoEFeedForward`, with the routing of
    :class:`~dynaseq.techniques.branching.BranchedAttention`: one noisy top-k gate per sub-layer; a
    token's query and output projections mix the k experts its gate picks on x, and the keys
    and values of an attended token mix the experts picked for *that* token (self-attention:
    the same decision; cross-attention: the gate applied to each memory token, recorded as
    stream ``"memory"``). Every projection is ``Σ_i g(x, i) (W_i x + b_i)`` over the k kept
    experts, so N experts of ``d_model -> d_model`` projections hold the parameters of a DMB
    attention with N branches and cost k times its projection MACs. Drop-in for
    ``MultiHeadAttention`` (same ``forward`` and plain :class:`~dynaseq.nn.KVCache`);
    ``macs`` keys as ``BranchedAttention.macs``, every projection running k experts per token
    (``gate_q``/``gate_kv``: the clean gate logits; training also runs the noise projection).
    The forward pass and the MAC count are
    :class:`~dynaseq.techniques.branching.routed.RoutedAttention`'s. Build it with
    :func:`moe_attention`.
    """

    def __init__(self, d_model: int, n_heads: int, gate: NoisyTopKGate, q_proj: BranchedLinear,
                 k_proj: BranchedLinear, v_proj: BranchedLinear, out_proj: BranchedLinear,
                 dropout: float = 0.0, name: str = "attention") -> None:
        super().__init__(d_model, n_heads, gate, q_proj, k_proj, v_proj, out_proj,
                         dropout=dropout, name=name)


def moe_attention(d_model: int, n_heads: int, n_experts: int = 4, k: int = 2,
                  dropout: float = 0.0, *, noise_epsilon: float = 1e-2,
                  name: str = "attention") -> MoEAttention:
    """MoE attention: a noisy top-``k`` gate and four :class:`BranchedLinear`
    ``d_model -> d_model`` projections with ``n_experts`` experts each (no shared part): the
    parameters of a merged DMB attention with as many branches."""

    def proj() -> BranchedLinear:
        return BranchedLinear(d_model, d_model, n_experts, shared=False)

    return MoEAttention(d_model, n_heads, NoisyTopKGate(d_model, n_experts, k, noise_epsilon),
                        proj(), proj(), proj(), proj(), dropout=dropout, name=name)


# the gate's top-k decides which experts run: int8 rounding could flip it
register_int8(NoisyTopKGate, KEEP_FLOAT)
