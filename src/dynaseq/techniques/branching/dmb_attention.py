"""DMB multi-head attention (Tan et al. 2021, section III-C, eq. 25-30).

One gating unit g_a chooses, per token, one of N sets of projections::

    Q^(h) = g_a(Q, {W_q^(h,k)}),  K^(h) = g_a(K, {W_k^(h,k)}),  V^(h) = g_a(V, {W_v^(h,k)})
    head_h = Attention(Q^(h), K^(h), V^(h))                                (eq. 27-30)
    MHA_DMB(Q, K, V) = g_a(H, {W_o^(k)}),   H = Concat(head_1..head_H)      (eq. 26)

where ``g(X, {W^(k)}) = [W^(i_1) x_1, ..., W^(i_n) x_n]`` applies to each row the weight of
the branch the gate picks for it (eq. 25). The attention itself is ordinary scaled
dot-product attention over the projected rows.

**Which gate decision routes which projection.** Eq. 28-30 route each row of Q, K and V by
the gate applied to that row: a query token's query projection follows the query token's
decision, and an attended token's key and value projections follow *that* token's decision.
In self-attention Q = K = V = X, so one decision per token routes its q, k and v rows; in
cross-attention the same gating unit g_a is applied to the memory tokens for k and v. For
the output projection eq. 26 writes ``g_a(H, ...)``; this module routes row t of H by the
decision of query token t (the same one that routed its query), i.e. a token's branch is one
whole MHA branch (q and o; the paper calls ``W_o^(k)`` "weights associated with the k-th MHA
branch", and its Figure 9 shows one gate prediction per token and attention sub-layer).
Evaluating the gate a second time on the rows of H would give a token two decisions in one
sub-layer.

The gate is evaluated once per token: on x (its decision routes q, out, and in
self-attention k and v) and, in cross-attention, once on each memory token when its keys and
values are projected (not again when they come from a static cache).

Incremental decoding uses the plain :class:`~dynaseq.nn.KVCache`: the cached keys/values
are the projected rows, each already routed by its own token's decision, so decoding step
by step equals the full causal pass.
"""

from __future__ import annotations

from dynaseq.techniques.branching.branched_linear import BranchedLinear
from dynaseq.techniques.branching.routed import RoutedAttention, attend
from dynaseq.techniques.branching.routing import Router

__all__ = ["BranchedAttention", "attend", "dmb_attention"]


class BranchedAttention(RoutedAttention):
    """Multi-head attention with per-token branched q/k/v/out projections (eq. 25-30).

    Drop-in for :class:`~dynaseq.nn.MultiHeadAttention` inside ``EncoderLayer`` /
    ``DecoderLayer`` (same ``forward`` signature and cache). See the module docstring for
    which gate decision routes which projection.

    Args:
        d_model, n_heads: width and heads (``d_model % n_heads == 0``).
        router: the gating unit g_a (N branches).
        q_proj, k_proj, v_proj, out_proj: :class:`BranchedLinear` ``d_model -> d_model``
            with N branches each.
        dropout: attention-probability dropout (training only).
        name: sub-layer name carried by its traces.

    ``forward(x, memory=None, *, attn_mask=None, is_causal=False, cache=None, aux=None)``:
    x ``(B, T, d)`` are the queries; keys/values come from ``memory`` ``(B, S, d)``
    (cross-attention) or from ``x``. Returns ``(B, T, d)``. ``macs(n_queries, n_keys,
    n_kv_tokens=None, *, cross=False)``: one branch per token, so the projections cost what
    dense ones do. The forward pass and the MAC count are
    :class:`~dynaseq.techniques.branching.routed.RoutedAttention`'s. Build it with
    :func:`dmb_attention`.
    """

    unit_attr = "router"
    unit_word = "branches"
    router: Router

    def __init__(self, d_model: int, n_heads: int, router: Router, q_proj: BranchedLinear,
                 k_proj: BranchedLinear, v_proj: BranchedLinear, out_proj: BranchedLinear,
                 dropout: float = 0.0, name: str = "attention") -> None:
        super().__init__(d_model, n_heads, router, q_proj, k_proj, v_proj, out_proj,
                         dropout=dropout, name=name)


def dmb_attention(d_model: int, n_heads: int, n_branches: int = 4, dropout: float = 0.0, *,
                  shared: bool = True, name: str = "attention",
                  fast_paths: bool = True) -> BranchedAttention:
    """DMB attention: one gate and four :class:`BranchedLinear` ``d_model -> d_model``
    projections with ``n_branches`` branches and shared-private parameters (``shared``;
    ``fast_paths``: see :class:`~dynaseq.techniques.branching.routing.Router`)."""

    def proj() -> BranchedLinear:
        return BranchedLinear(d_model, d_model, n_branches, shared=shared)

    return BranchedAttention(d_model, n_heads, Router(d_model, n_branches, fast_paths=fast_paths),
                             proj(), proj(), proj(), proj(), dropout=dropout, name=name)
