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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.attention import KVCache
from dynaseq.nn.outputs import MACS_TRACE, AuxOutputs, MacsRecord
from dynaseq.techniques.branching.branched_linear import BranchedLinear
from dynaseq.techniques.branching.routing import BranchGroups, Route, Router
from dynaseq.techniques.branching.traces import ROUTE_TRACE, RouteTrace


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


class BranchedAttention(nn.Module):
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
    (cross-attention) or from ``x``. Returns ``(B, T, d)``. Build it with
    :func:`dmb_attention`.
    """

    def __init__(self, d_model: int, n_heads: int, router: Router, q_proj: BranchedLinear,
                 k_proj: BranchedLinear, v_proj: BranchedLinear, out_proj: BranchedLinear,
                 dropout: float = 0.0, name: str = "attention") -> None:
        super().__init__()
        if n_heads < 1 or d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if router.d_model != d_model:
            raise ValueError(f"the router reads width {router.d_model}, expected {d_model}")
        for pname, proj in (("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj),
                            ("out_proj", out_proj)):
            if not isinstance(proj, BranchedLinear):
                raise ValueError(f"{pname} must be a BranchedLinear, got {type(proj).__name__}")
            if proj.n_branches != router.n_branches:
                raise ValueError(f"{pname} has {proj.n_branches} branches, the router "
                                 f"{router.n_branches}")
            if (proj.in_features, proj.out_features) != (d_model, d_model):
                raise ValueError(f"{pname} must map {d_model} -> {d_model}, got "
                                 f"{proj.in_features} -> {proj.out_features}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout}")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.router = router
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj
        self.dropout = dropout
        self.name = name

    @property
    def n_branches(self) -> int:
        return self.router.n_branches

    def new_cache(self, static: bool = False) -> KVCache:
        """An empty cache for incremental decoding (``static``: cross-attention)."""
        return KVCache(static=static)

    def _split(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, hd)

    def _route(self, x: Tensor) -> tuple[Route, BranchGroups, Tensor]:
        """Route ``x`` ``(B, T, d)``: decision, grouping, and its rows sorted by branch."""
        route = self.router(x)  # branch (B, T)
        groups = BranchGroups.of(route.branch.reshape(-1), self.n_branches, validate=False)
        return route, groups, groups.gather(x.reshape(-1, self.d_model))

    def _project(self, proj: BranchedLinear, groups: BranchGroups, xs: Tensor,
                 shape: torch.Size) -> Tensor:
        return groups.scatter(proj.grouped(xs, groups)).view(shape)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, attn_mask: Tensor | None = None,
                is_causal: bool = False, cache: KVCache | None = None,
                aux: AuxOutputs | None = None) -> Tensor:
        """Return ``(B, T, d_model)``.

        attn_mask: bool, broadcastable to ``(B, H, T, S)``, True where attention is allowed.
        is_causal: position t attends to keys <= t (after any cached ones).
        cache: incremental decoding state (projected keys/values), updated in place.
        """
        route_q, groups_q, xs = self._route(x)
        q = self._split(self._project(self.q_proj, groups_q, xs, x.shape))  # (B, H, T, hd)
        route_kv = None
        n_kv = 0
        if cache is not None and cache.static and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            if memory is None:  # self-attention: the query decisions route k and v too
                src, groups_kv, srcs = x, groups_q, xs
            else:
                route_kv, groups_kv, srcs = self._route(memory)
                src = memory
            k = self._split(self._project(self.k_proj, groups_kv, srcs, src.shape))
            v = self._split(self._project(self.v_proj, groups_kv, srcs, src.shape))
            n_kv = groups_kv.n_tokens
            if cache is not None:
                if cache.k is not None:
                    k = torch.cat([cache.k, k], dim=2)
                    v = torch.cat([cache.v, v], dim=2)
                cache.k, cache.v = k, v
        out = attend(q, k, v, attn_mask, is_causal,
                     self.dropout if self.training else 0.0)  # (B, H, T, hd)
        b, _, t, _ = out.shape
        h = out.transpose(1, 2).reshape(b * t, self.d_model)
        y = self._project(self.out_proj, groups_q, groups_q.gather(h), x.shape)
        if aux is not None:
            aux.add_trace(ROUTE_TRACE, RouteTrace(self.name, "attn", "input", route_q.logits,
                                                  route_q.branch, id(self.router)))
            if route_kv is not None:
                aux.add_trace(ROUTE_TRACE, RouteTrace(self.name, "attn", "memory",
                                                      route_kv.logits, route_kv.branch,
                                                      id(self.router)))
            if not self.training:
                counts = self.macs(b * t, k.size(2), n_kv, cross=route_kv is not None)
                aux.add_trace(MACS_TRACE, MacsRecord(self.name, counts))
        return y

    def macs(self, n_queries: int, n_keys: int, n_kv_tokens: int | None = None, *,
             cross: bool = False) -> dict[str, int]:
        """Multiply-adds of one call with ``n_queries`` query rows attending to ``n_keys`` keys.

        Keys as ``MultiHeadAttention.macs`` (one branch per token, so the projections cost
        what dense ones do) plus ``gate_q``, the gate on the query tokens, and ``gate_kv``,
        the gate on the ``n_kv_tokens`` memory tokens of cross-attention (``cross=True``;
        in self-attention the query decisions are reused: 0). ``n_kv_tokens`` is how many
        tokens go through the k/v projections (defaults to ``n_keys``; 0 when cached).
        """
        n_kv = n_keys if n_kv_tokens is None else n_kv_tokens
        products = n_queries * n_keys * self.d_model
        return {
            "q_proj": self.q_proj.macs(n_queries),
            "k_proj": self.k_proj.macs(n_kv),
            "v_proj": self.v_proj.macs(n_kv),
            "attn_scores": products,
            "attn_values": products,
            "out_proj": self.out_proj.macs(n_queries),
            "gate_q": self.router.macs(n_queries),
            "gate_kv": self.router.macs(n_kv) if cross else 0,
        }


def dmb_attention(d_model: int, n_heads: int, n_branches: int = 4, dropout: float = 0.0, *,
                  shared: bool = True, name: str = "attention") -> BranchedAttention:
    """DMB attention: one gate and four :class:`BranchedLinear` ``d_model -> d_model``
    projections with ``n_branches`` branches and shared-private parameters (``shared``)."""

    def proj() -> BranchedLinear:
        return BranchedLinear(d_model, d_model, n_branches, shared=shared)

    return BranchedAttention(d_model, n_heads, Router(d_model, n_branches), proj(), proj(),
                             proj(), proj(), dropout=dropout, name=name)
