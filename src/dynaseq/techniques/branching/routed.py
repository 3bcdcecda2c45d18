"""The branched sub-layers, whatever their gate: an FFN and an attention whose projections run
per token the branch(es) a :class:`~dynaseq.techniques.branching.routing.GatingUnit` picks.

DMB (:mod:`~dynaseq.techniques.branching.dmb_ffn`, :mod:`~dynaseq.techniques.branching.dmb_attention`)
and the MoE baseline (:mod:`~dynaseq.techniques.branching.moe`) differ only in their gate: a
top-1 :class:`~dynaseq.techniques.branching.routing.Router` (one branch per token, output
not scaled) or a noisy top-k gate (k experts per token, outputs mixed by the gate values).
The gate's :class:`~dynaseq.techniques.branching.routing.Dispatch` hides that difference, so
the two layers here hold the one forward pass, trace and MAC count both kinds share; the
concrete classes name their gate's attribute (the state-dict prefix ``router.`` or
``gate.``) and the word for its branches in error messages.

Every call with ``aux`` records the gate's route trace (``ROUTE_TRACE``: the auxiliary
losses come from it) and, at inference, a ``MacsRecord`` of what ran.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.attention import AttentionHeads, KVCache
from dynaseq.nn.outputs import MACS_TRACE, AuxOutputs, MacsRecord
from dynaseq.techniques.branching.branched_linear import BranchedLinear
from dynaseq.techniques.branching.routing import GatingUnit
from dynaseq.techniques.branching.traces import ROUTE_TRACE


def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
           dropout_p: float = 0.0) -> Tensor:
    """Scaled dot-product attention of q ``(B, H, T, hd)`` over k, v ``(B, H, S, hd)``.

    ``is_causal``: query t attends to keys up to its own position, the queries being the
    last T of the S keys (several new steps after a cache); combined with ``attn_mask`` (bool,
    True = attend) when both are given. One query attends to everything cached so far.
    """
    causal = is_causal and q.size(2) > 1
    if causal and (k.size(2) != q.size(2) or attn_mask is not None):
        # explicit mask: queries sit at the end of the key sequence (several new steps
        # after a cache), or a padding mask comes too (SDPA takes one or the other)
        past = k.size(2) - q.size(2)
        pos_q = torch.arange(q.size(2), device=q.device)[:, None] + past
        allowed = torch.arange(k.size(2), device=q.device)[None, :] <= pos_q
        attn_mask = allowed if attn_mask is None else attn_mask & allowed
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                          dropout_p=dropout_p)


class _Gated:
    """The gate of a branched sub-layer, registered under the subclass's ``unit_attr``."""

    unit_attr: ClassVar[str]
    """Attribute (and state-dict prefix) of the gate: ``"router"`` (DMB) or ``"gate"`` (MoE)."""
    unit_word: ClassVar[str]
    """What error messages call its branches: ``"branches"`` or ``"experts"``."""

    @property
    def unit(self) -> GatingUnit:
        return getattr(self, self.unit_attr)

    @property
    def n_branches(self) -> int:
        """N, the gate's branches (experts)."""
        return self.unit.n_branches


class RoutedFeedForward(_Gated, nn.Module):
    """``W2_i ReLU(W1_i x)`` per token over the branch(es) i its gate picks; drop-in for
    ``FeedForward``. Base of ``BranchedFeedForward`` and ``MoEFeedForward``.

    Args:
        unit: the gate (N branches, width d_model).
        fc1: :class:`BranchedLinear` ``d_model -> ffn_dim`` with N branches.
        fc2: :class:`BranchedLinear` ``ffn_dim -> d_model`` with N branches.
        activation_dropout: dropout after the ReLU (training only).
        name: sub-layer name carried by its traces.

    ``forward(x, aux=None)``: x ``(..., d_model)`` -> ``(..., d_model)``. Tokens are laid
    out by the gate once; both matrices run over that layout, and the results are brought
    back to the tokens (put back for top-1, gate-weighted sums for top-k).
    """

    def __init__(self, unit: GatingUnit, fc1: BranchedLinear, fc2: BranchedLinear,
                 activation_dropout: float = 0.0, name: str = "ffn") -> None:
        super().__init__()
        n, who, word = unit.n_branches, self.unit_attr, self.unit_word
        if fc1.n_branches != n or fc2.n_branches != n:
            raise ValueError(f"the {who} has {n} {word} but fc1/fc2 have "
                             f"{fc1.n_branches}/{fc2.n_branches} branches")
        if fc1.in_features != unit.d_model or fc2.out_features != unit.d_model:
            raise ValueError(f"fc1 must read and fc2 must write d_model={unit.d_model}, got "
                             f"fc1 {fc1.in_features}->{fc1.out_features}, fc2 "
                             f"{fc2.in_features}->{fc2.out_features}")
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1 writes {fc1.out_features} features but fc2 reads "
                             f"{fc2.in_features}")
        if not 0.0 <= activation_dropout < 1.0:
            raise ValueError(f"activation_dropout must lie in [0, 1), got {activation_dropout}")
        setattr(self, self.unit_attr, unit)  # registered first: parameter order of checkpoints
        self.fc1, self.fc2 = fc1, fc2
        self.dropout = nn.Dropout(activation_dropout)
        self.name = name

    def forward(self, x: Tensor, aux: AuxOutputs | None = None) -> Tensor:
        dispatch = self.unit.dispatch(x)
        h = self.dropout(dispatch.run(self.fc1, dispatch.input_rows()).relu_())  # (R, ffn_dim)
        out = dispatch.combine(dispatch.run(self.fc2, h))  # (M, d)
        if aux is not None:
            aux.add_trace(ROUTE_TRACE, dispatch.trace(self.name, "ffn", "input", id(self.unit)))
            if not self.training:
                aux.add_trace(MACS_TRACE, MacsRecord(self.name, self.macs(dispatch.n_tokens)))
        return out.view(x.shape)

    def macs(self, n_tokens: int) -> dict[str, int]:
        """Multiply-adds at inference for ``n_tokens`` tokens: the keys of
        ``FeedForward.macs``, each token running ``unit.runs_per_token`` branches, plus
        ``gate_ffn``. What runs does not depend on the routing."""
        rows = n_tokens * self.unit.runs_per_token
        return {"ffn_in": self.fc1.macs(rows), "ffn_out": self.fc2.macs(rows),
                "gate_ffn": self.unit.macs(n_tokens)}


class RoutedAttention(_Gated, AttentionHeads):
    """Multi-head attention whose q/k/v/out projections run per token the branch(es) its gate
    picks. Base of ``BranchedAttention`` and ``MoEAttention``; drop-in for
    :class:`~dynaseq.nn.MultiHeadAttention` (same ``forward`` and plain
    :class:`~dynaseq.nn.KVCache`).

    Routing: the gate runs once on x; its decision routes each query token's query and
    output projections, and in self-attention its keys and values too. In cross-attention
    the same gate runs on each memory token for its keys and values (stream ``"memory"``;
    not again when they come from a static cache).

    Args:
        d_model, n_heads: width and heads (``d_model % n_heads == 0``).
        unit: the gate (N branches, width d_model).
        q_proj, k_proj, v_proj, out_proj: :class:`BranchedLinear` ``d_model -> d_model``
            with N branches each.
        dropout: attention-probability dropout (training only).
        name: sub-layer name carried by its traces.
    """

    def __init__(self, d_model: int, n_heads: int, unit: GatingUnit, q_proj: BranchedLinear,
                 k_proj: BranchedLinear, v_proj: BranchedLinear, out_proj: BranchedLinear,
                 dropout: float = 0.0, name: str = "attention") -> None:
        super().__init__(d_model, n_heads, dropout)
        who, word = self.unit_attr, self.unit_word
        if unit.d_model != d_model:
            raise ValueError(f"the {who} reads width {unit.d_model}, expected {d_model}")
        for pname, proj in (("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj),
                            ("out_proj", out_proj)):
            if not isinstance(proj, BranchedLinear):
                raise ValueError(f"{pname} must be a BranchedLinear, got {type(proj).__name__}")
            if proj.n_branches != unit.n_branches:
                raise ValueError(f"{pname} has {proj.n_branches} {word}, the {who} "
                                 f"{unit.n_branches}")
            if (proj.in_features, proj.out_features) != (d_model, d_model):
                raise ValueError(f"{pname} must map {d_model} -> {d_model}, got "
                                 f"{proj.in_features} -> {proj.out_features}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout}")
        setattr(self, self.unit_attr, unit)  # registered first: parameter order of checkpoints
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj
        self.name = name

    def forward(self, x: Tensor, memory: Tensor | None = None, *, attn_mask: Tensor | None = None,
                is_causal: bool = False, cache: KVCache | None = None,
                aux: AuxOutputs | None = None) -> Tensor:
        """Return ``(B, T, d_model)``.

        x: ``(B, T, d_model)`` the queries; keys/values come from ``memory`` ``(B, S, d_model)``
        (cross-attention) or from ``x``.
        attn_mask: bool, broadcastable to ``(B, H, T, S)``, True where attention is allowed.
        is_causal: position t attends to keys <= t (after any cached ones).
        cache: incremental decoding state (projected keys/values), updated in place.
        """
        b, t, d = x.shape
        route_q = self.unit.dispatch(x)
        q = self._split(route_q.project(self.q_proj, route_q.input_rows()).view(x.shape))
        route_kv = None  # the memory's own decision (cross-attention, not cached)
        n_kv = 0
        if cache is not None and cache.static and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            src = x if memory is None else memory
            kv = route_q if memory is None else self.unit.dispatch(memory)
            route_kv = None if memory is None else kv
            k = self._split(kv.project(self.k_proj, kv.input_rows()).view(src.shape))
            v = self._split(kv.project(self.v_proj, kv.input_rows()).view(src.shape))
            n_kv = kv.n_tokens
            if cache is not None:
                if cache.k is not None:
                    k = torch.cat([cache.k, k], dim=2)
                    v = torch.cat([cache.v, v], dim=2)
                cache.k, cache.v = k, v
        out = attend(q, k, v, attn_mask, is_causal,
                     self.dropout if self.training else 0.0)  # (B, H, T, hd)
        h = out.transpose(1, 2).reshape(b * t, d)
        y = route_q.project(self.out_proj, route_q.gather(h)).view(x.shape)
        if aux is not None:
            aux.add_trace(ROUTE_TRACE, route_q.trace(self.name, "attn", "input", id(self.unit)))
            if route_kv is not None:
                aux.add_trace(ROUTE_TRACE,
                              route_kv.trace(self.name, "attn", "memory", id(self.unit)))
            if not self.training:
                counts = self.macs(b * t, k.size(2), n_kv, cross=route_kv is not None)
                aux.add_trace(MACS_TRACE, MacsRecord(self.name, counts))
        return y

    def macs(self, n_queries: int, n_keys: int, n_kv_tokens: int | None = None, *,
             cross: bool = False) -> dict[str, int]:
        """Multiply-adds at inference of one call with ``n_queries`` query rows attending to
        ``n_keys`` keys.

        Keys as ``MultiHeadAttention.macs``, every projection running
        ``unit.runs_per_token`` branches per token (top-1: what a dense one costs), plus
        ``gate_q``, the gate on the query tokens, and ``gate_kv``, the gate on the
        ``n_kv_tokens`` memory tokens of cross-attention (``cross=True``; in self-attention
        the query decisions are reused: 0). ``n_kv_tokens`` is how many tokens go through
        the k/v projections (defaults to ``n_keys``; 0 when cached).
        """
        n_kv = n_keys if n_kv_tokens is None else n_kv_tokens
        runs = self.unit.runs_per_token
        products = n_queries * n_keys * self.d_model
        return {
            "q_proj": self.q_proj.macs(n_queries * runs),
            "k_proj": self.k_proj.macs(n_kv * runs),
            "v_proj": self.v_proj.macs(n_kv * runs),
            "attn_scores": products,
            "attn_values": products,
            "out_proj": self.out_proj.macs(n_queries * runs),
            "gate_q": self.unit.macs(n_queries),
            "gate_kv": self.unit.macs(n_kv) if cross else 0,
        }
