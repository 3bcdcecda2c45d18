"""Multi-head attention whose projections are passed in, with a key/value cache.

Attention(Q, K, V) = softmax(Q Kᵀ / sqrt(d_head)) V  (Vaswani et al. 2017, eq. 1), computed
with ``torch.nn.functional.scaled_dot_product_attention``. The q/k/v/output projections are
modules handed to the constructor (torchtune style), so gated or branched projections swap in
without flags; :func:`dense_attention` builds the plain version.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.int8 import Int8Linear
from dynaseq.nn.outputs import AuxOutputs


@dataclass
class KVCache:
    """Projected keys and values of one attention sub-layer, each ``(B, H, T, d_head)``.

    Self-attention appends one step per decoding step; cross-attention fills it once from the
    encoder output (``static=True``) and reuses it.
    """

    k: Tensor | None = None
    v: Tensor | None = None
    static: bool = False

    def reorder(self, index: Tensor) -> None:
        """Keep/reorder rows of the batch (beam search, dropping finished sentences)."""
        if self.k is not None:
            self.k = self.k.index_select(0, index)
            self.v = self.v.index_select(0, index)

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.size(2)


def padding_to_attn_mask(pad_mask: Tensor) -> Tensor:
    """(B, S) bool, True at padding -> (B, 1, 1, S) bool, True where attention is allowed."""
    return (~pad_mask)[:, None, None, :]


def with_position_scores(bias: Tensor, attn_mask: Tensor | None) -> Tensor:
    """Position scores ``bias`` (B, H, T, S) as SDPA's additive float mask, ``-inf`` where the
    bool ``attn_mask`` (allowed keys, broadcastable; None: all) forbids a key."""
    return bias if attn_mask is None else bias.masked_fill(~attn_mask, float("-inf"))


class AttentionHeads(nn.Module):
    """What every multi-head attention with a :class:`KVCache` shares: ``n_heads`` heads of
    ``d_head = d_model // n_heads``, the attention-probability dropout, the cache and the
    head split. Subclasses register their projections (and any gate) themselves, in the
    order their state dict and parameter list keep.

    Args:
        d_model: model width (a multiple of ``n_heads``).
        n_heads: number of heads (>= 1).
        dropout: dropout on attention probabilities (training only).
        d_head: the width of one head when it is not ``d_model // n_heads``: a model whose
            heads were pruned (:mod:`dynaseq.compress.head_prune`) keeps its heads' width
            with fewer of them (``n_heads`` >= 0), so the projections map d_model to
            ``n_heads · d_head`` (:attr:`inner`) and back.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0,
                 d_head: int | None = None) -> None:
        super().__init__()
        if d_head is None:
            if n_heads < 1 or d_model % n_heads:
                raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
            d_head = d_model // n_heads
        elif n_heads < 0 or d_head < 1:
            raise ValueError(f"n_heads={n_heads} must be >= 0 and d_head={d_head} >= 1")
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = d_head
        self.dropout = dropout

    @property
    def inner(self) -> int:
        """Width of the concatenated heads, ``n_heads · d_head`` (d_model unless pruned)."""
        return self.n_heads * self.d_head

    def new_cache(self, static: bool = False) -> KVCache:
        """An empty cache for incremental decoding (``static``: cross-attention)."""
        return KVCache(static=static)

    def _split(self, x: Tensor) -> Tensor:
        """``(B, T, d_model)`` -> ``(B, H, T, d_head)``."""
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, hd)


class MultiHeadAttention(AttentionHeads):
    """Multi-head attention over ``n_heads`` heads of size ``d_model // n_heads``.

    Args:
        d_model: model width.
        n_heads: number of heads.
        q_proj, k_proj, v_proj, out_proj: modules mapping ``(B, T, d_model)`` to itself.
        dropout: dropout on attention probabilities (training only).
        position_scores: optional module ``(q (B, H, T, hd), k (B, H, S, hd)) -> (B, H, T, S)``
            added to the scaled content scores (e.g. :class:`~dynaseq.nn.relative_scores.
            RelativeScores`); self-attention over a whole sequence only (no cache).
        d_head: see :class:`AttentionHeads` (pruned heads: q/k/v map d_model to
            ``n_heads · d_head``, out_proj maps it back; with no head left the sub-layer's
            output is out_proj's bias).

    ``forward(x, memory=None, ...)``: x ``(B, T, d_model)`` are the queries; keys/values come
    from ``memory`` ``(B, S, d_model)`` (cross-attention) or from ``x`` (self-attention).
    """

    def __init__(self, d_model: int, n_heads: int, q_proj: nn.Module, k_proj: nn.Module,
                 v_proj: nn.Module, out_proj: nn.Module, dropout: float = 0.0,
                 position_scores: nn.Module | None = None, d_head: int | None = None) -> None:
        super().__init__(d_model, n_heads, dropout, d_head)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj
        self.position_scores = position_scores

    def forward(self, x: Tensor, memory: Tensor | None = None, *, attn_mask: Tensor | None = None,
                is_causal: bool = False, cache: KVCache | None = None,
                aux: AuxOutputs | None = None) -> Tensor:
        """Return ``(B, T, d_model)``.

        attn_mask: bool, broadcastable to ``(B, H, T, S)``, True where attention is allowed.
        is_causal: position t attends to keys <= t (full-sequence self-attention only).
        cache: incremental decoding state, updated in place.
        """
        if self.n_heads == 0:  # every head pruned: out_proj of nothing is its bias
            return self.out_proj(x.new_zeros(*x.shape[:-1], 0))
        q = self._split(self.q_proj(x))  # (B, H, T, hd)
        source = x if memory is None else memory
        if cache is not None and cache.static and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            k = self._split(self.k_proj(source))  # (B, H, S, hd)
            v = self._split(self.v_proj(source))
            if cache is not None:
                if cache.k is not None:
                    k = torch.cat([cache.k, k], dim=2)
                    v = torch.cat([cache.v, v], dim=2)
                cache.k, cache.v = k, v
        if is_causal and q.size(2) == 1:
            is_causal = False  # one query attends to everything cached so far
        if self.position_scores is not None:
            assert cache is None and memory is None and not is_causal, \
                "position scores are for full-sequence self-attention"
            # (B, H, T, S), added to the scaled scores
            attn_mask = with_position_scores(self.position_scores(q, k), attn_mask)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0)  # (B, H, T, hd)
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.inner))

    def macs(self, n_queries: int, n_keys: int, n_kv_tokens: int | None = None) -> dict[str, int]:
        """Multiply-adds of one call with ``n_queries`` query rows attending to ``n_keys`` keys.

        ``n_kv_tokens`` is how many tokens go through the k/v projections (defaults to
        ``n_keys``; 0 when cached). Score and value products are ``n_queries · n_keys · d_model``
        each. Assumes ``nn.Linear`` projections; adaptive projections report their own.
        """
        n_kv = n_keys if n_kv_tokens is None else n_kv_tokens

        def lin(m: nn.Module, n: int) -> int:
            # dense projections: nn.Linear, or its int8 version (dynaseq.nn.int8)
            assert isinstance(m, (nn.Linear, Int8Linear)), "macs() assumes dense projections"
            return n * m.in_features * m.out_features

        macs = {
            "q_proj": lin(self.q_proj, n_queries),
            "k_proj": lin(self.k_proj, n_kv),
            "v_proj": lin(self.v_proj, n_kv),
            "attn_scores": n_queries * n_keys * self.inner,
            "attn_values": n_queries * n_keys * self.inner,
            "out_proj": lin(self.out_proj, n_queries),
        }
        if self.position_scores is not None:
            macs["position_scores"] = self.position_scores.macs(n_queries, n_keys, self.n_heads)
        return macs


def _linear(d_in: int, d_out: int) -> nn.Linear:
    if not d_in * d_out:  # a layer whose heads were all pruned: nothing to initialise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: "zero-element tensors is a no-op"
            layer = nn.Linear(d_in, d_out)
        nn.init.zeros_(layer.bias)
        return layer
    layer = nn.Linear(d_in, d_out)
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def dense_attention(d_model: int, n_heads: int, dropout: float = 0.0,
                    position_scores: nn.Module | None = None,
                    d_head: int | None = None) -> MultiHeadAttention:
    """Plain multi-head attention with four ``nn.Linear(d_model, d_model)`` projections
    (and optional ``position_scores``, see :class:`MultiHeadAttention`); with ``d_head``
    (a head-pruned layer) q/k/v are ``nn.Linear(d_model, n_heads · d_head)`` and out_proj
    ``nn.Linear(n_heads · d_head, d_model)``."""
    inner = d_model if d_head is None else n_heads * d_head
    return MultiHeadAttention(d_model, n_heads, _linear(d_model, inner),
                              _linear(d_model, inner), _linear(d_model, inner),
                              _linear(inner, d_model), dropout=dropout,
                              position_scores=position_scores, d_head=d_head)
