"""Relative-position multi-head attention over a short per-layer context (MicroNet sec. 3.2).

Scores follow Transformer-XL (Dai et al. 2019, sec. 3.3): for query i and key j at distance
δ = i - j,

    score(i, j) = (q_i + u)ᵀ k_j  +  (q_i + v)ᵀ W_r R_δ,        softmax over j, / sqrt(d_head)

with R_δ the sinusoidal encoding of δ and u, v learned per-head biases. The attention is
*banded*: position t sees keys t-C+1 .. t (δ in [0, C-1]), C being the per-layer context.
A training window of C_e tokens (the "extended context") is processed at once, gradients
flowing through all of it, so L layers reach back min(C_e, L(C-1)+1) tokens (fig. 1b).

Keys and values of the last C-1 positions are returned as a :class:`RelativeCache`; passing
it to the next call continues the text (the next training window, or one token at a time
in generation). Its size never exceeds C-1, so the cost of a token does not depend on its
position in the document. Queries are processed in blocks of C, each block attending only
to its 2C-1 possible keys, so a window costs O(C_e · C) rather than O(C_e²).

Example::

    attn = relative_attention(d_model=256, n_heads=8, d_head=24, context=97)
    y, cache = attn(x)                     # x (B, T, 256) -> y (B, T, 256)
    y1, cache = attn(x_next, cache=cache)  # continues the sequence
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class RelativeCache:
    """Keys/values ``(B, H, M, d_head)`` of the last M <= C-1 positions of one layer, and
    ``r`` ``(H, C, d_head)``: the projected relative encodings, kept only in inference
    (no grad, eval mode), where the weights cannot change between calls."""

    k: Tensor
    v: Tensor
    r: Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.size(2)

    def detach(self) -> RelativeCache:
        return RelativeCache(self.k.detach(), self.v.detach(), None)

    def index_select(self, index: Tensor) -> RelativeCache:
        return RelativeCache(self.k.index_select(0, index), self.v.index_select(0, index),
                             self.r)


def relative_encodings(length: int, d_model: int) -> Tensor:
    """(length, d_model) sinusoids for distances 0 .. length-1: [sin(δ f), cos(δ f)]."""
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32)
                         * (-math.log(10000.0) / d_model))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return table[:, :d_model]


class RelativeMultiHeadAttention(nn.Module):
    """Banded causal self-attention with Transformer-XL relative positions.

    Args:
        d_model: model width d.
        n_heads: H.
        d_head: width of one head (MicroNet: 24 with d = 256, H = 8; need not be d / H).
        context: per-layer context C >= 1 (a position attends to itself and C-1 before).
        q_proj, k_proj, v_proj: modules d -> H·d_head; r_proj: d -> H·d_head (applied to
            the relative encodings); out_proj: H·d_head -> d.
        dropout: on the attention probabilities (training only).

    ``forward(x, cache=None) -> (y, new_cache)``: x (B, T, d) -> y (B, T, d); ``new_cache``
    holds the last min(C-1, M+T) keys/values.
    """

    def __init__(self, d_model: int, n_heads: int, d_head: int, context: int,
                 q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module, r_proj: nn.Module,
                 out_proj: nn.Module, dropout: float = 0.0) -> None:
        super().__init__()
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        self.d_model, self.n_heads, self.d_head, self.context = d_model, n_heads, d_head, context
        self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj
        self.r_proj, self.out_proj = r_proj, out_proj
        self.u = nn.Parameter(torch.zeros(n_heads, d_head))  # content bias
        self.v = nn.Parameter(torch.zeros(n_heads, d_head))  # position bias
        self.dropout = dropout
        self.register_buffer("rel", relative_encodings(context, d_model), persistent=False)

    def _split(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, hd)

    def projected_positions(self) -> Tensor:
        """(H, C, d_head): W_r R_δ for δ = 0 .. C-1."""
        r = self.r_proj(self.rel.to(self.u.dtype))  # (C, H·hd)
        return r.view(self.context, self.n_heads, self.d_head).transpose(0, 1)

    def _block(self, q: Tensor, k: Tensor, v: Tensor, r: Tensor, offset: int) -> Tensor:
        """q (B, H, S, hd) at key positions offset .. offset+S-1 of k, v (B, H, K, hd)."""
        s, n_keys, c = q.size(2), k.size(2), self.context
        ac = torch.matmul(q + self.u[:, None, :], k.transpose(-1, -2))  # (B, H, S, K)
        bd = torch.matmul(q + self.v[:, None, :], r.transpose(-1, -2))  # (B, H, S, C)
        dist = (offset + torch.arange(s, device=q.device))[:, None] \
            - torch.arange(n_keys, device=q.device)[None, :]  # (S, K)
        band = (dist >= 0) & (dist < c)
        bd = bd.gather(-1, dist.clamp(0, c - 1).expand(*bd.shape[:2], s, n_keys))
        scores = (ac + bd).float() * (1.0 / math.sqrt(self.d_head))
        probs = scores.masked_fill(~band, float("-inf")).softmax(-1).to(v.dtype)
        if self.training and self.dropout > 0:
            probs = F.dropout(probs, self.dropout)
        return torch.matmul(probs, v)  # (B, H, S, hd)

    def forward(self, x: Tensor, cache: RelativeCache | None = None
                ) -> tuple[Tensor, RelativeCache]:
        b, t, _ = x.shape
        c = self.context
        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(x))
        v = self._split(self.v_proj(x))
        reuse = not self.training and not torch.is_grad_enabled()
        r = cache.r if cache is not None and reuse and cache.r is not None else None
        if r is None:
            r = self.projected_positions()
        m = 0
        if cache is not None and cache.length:
            m = cache.length
            k = torch.cat([cache.k, k], dim=2)
            v = torch.cat([cache.v, v], dim=2)
        blocks = []
        for start in range(0, t, c):  # queries start..end-1 need keys end-C+1-... onwards
            end = min(start + c, t)
            k0 = max(0, m + start - (c - 1))
            blocks.append(self._block(q[:, :, start:end], k[:, :, k0:m + end],
                                      v[:, :, k0:m + end], r, m + start - k0))
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)  # (B, H, T, hd)
        keep = min(c - 1, m + t)
        new_cache = RelativeCache(k[:, :, m + t - keep:], v[:, :, m + t - keep:],
                                  r if reuse else None)
        y = self.out_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.d_head))
        return y, new_cache

    def macs(self, n_keys: int) -> dict[str, int]:
        """Multiply-adds for one new token attending to ``n_keys`` keys (itself included),
        with keys/values and projected positions cached (incremental inference)."""
        inner = self.n_heads * self.d_head
        return {
            "q_proj": self.d_model * inner,
            "k_proj": self.d_model * inner,
            "v_proj": self.d_model * inner,
            "attn_content": n_keys * inner,
            "attn_position": n_keys * inner,
            "attn_values": n_keys * inner,
            "out_proj": inner * self.d_model,
        }


def relative_attention(d_model: int, n_heads: int, d_head: int | None, context: int,
                       dropout: float = 0.0) -> RelativeMultiHeadAttention:
    """Relative attention with plain ``nn.Linear`` projections (no biases on r)."""
    d_head = d_head or d_model // n_heads
    inner = n_heads * d_head

    def lin(d_in: int, d_out: int, bias: bool = True) -> nn.Linear:
        layer = nn.Linear(d_in, d_out, bias=bias)
        nn.init.xavier_uniform_(layer.weight)
        if bias:
            nn.init.zeros_(layer.bias)
        return layer

    return RelativeMultiHeadAttention(
        d_model, n_heads, d_head, context, q_proj=lin(d_model, inner), k_proj=lin(d_model, inner),
        v_proj=lin(d_model, inner), r_proj=lin(d_model, inner, bias=False),
        out_proj=lin(inner, d_model), dropout=dropout)
