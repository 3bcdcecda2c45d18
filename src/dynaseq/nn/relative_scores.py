"""Relative-position attention scores read by both queries and keys (ALBERTa, paper 004).

The adaptive-depth paper adds two positional scores to the content score of every head:

    AS_rel(i, j) = AS(i, j) + RKS(i, j) + RQS(i, j)
    RKS(i, j) = k_j · E_R(i−j),   RQS(i, j) = q_i · E_R(i−j)

with ``q = W_Q x``, ``k = W_K x`` the head's projections and ``E_R(δ)`` a learned embedding of
the signed distance δ = i − j, clipped to [−R, R] (so a table of 2R+1 rows of ``d_head``, one
per layer, shared by the heads). They enter
:func:`torch.nn.functional.scaled_dot_product_attention` as its additive float mask.

Hand-written because no library module gives these two terms as an additive bias (DeBERTa's
disentangled attention in ``transformers`` is fused into its own attention class).

Example::

    scores = RelativeScores(d_head=32, max_distance=16, max_positions=128)
    bias = scores(q, k)          # q (B, H, T, hd), k (B, H, S, hd) -> (B, H, T, S)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class RelativeScores(nn.Module):
    """(q (B, H, T, hd), k (B, H, S, hd)) -> (B, H, T, S) = RKS + RQS.

    Query position i and key position j are their indices (self-attention over one
    sequence, T == S <= ``max_positions``); distances beyond ``max_distance`` share the last
    embedding. The table is learned, so it absorbs the 1/sqrt(d_head) the content score
    carries (one operation less per layer). The distance index of every (i, j) is built
    once, at construction (a buffer, never written after)."""

    def __init__(self, d_head: int, max_distance: int, max_positions: int = 512) -> None:
        super().__init__()
        if max_distance < 1:
            raise ValueError(f"max_distance must be >= 1, got {max_distance}")
        self.max_distance = max_distance
        self.embedding = nn.Embedding(2 * max_distance + 1, d_head)
        nn.init.normal_(self.embedding.weight, std=0.02 / math.sqrt(d_head))
        pos = torch.arange(max_positions)
        index = (pos[:, None] - pos[None, :]).clamp(-max_distance, max_distance) + max_distance
        # (P, P) long: row of E_R for query i, key j; and its transpose for the keys' term
        self.register_buffer("index", index, persistent=False)
        self.register_buffer("index_t", index.t().contiguous(), persistent=False)

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        b, h, t, _ = q.shape
        s = k.size(2)
        if max(t, s) > self.index.size(0):
            raise ValueError(f"{max(t, s)} positions exceed max_positions={self.index.size(0)}")
        e = self.embedding.weight.t()  # (hd, 2R+1)
        rqs = (q @ e).gather(-1, self.index[:t, :s].expand(b, h, t, s))  # q_i · E_R(i−j)
        rks = (k @ e).gather(-1, self.index_t[:s, :t].expand(b, h, s, t))  # k_j · E_R(i−j)
        return rqs + rks.transpose(-1, -2)  # (B, H, T, S)

    def macs(self, n_queries: int, n_keys: int, n_heads: int) -> int:
        """The two products with the table: (T + S) · (2R+1) · d_head per head."""
        rows, hd = self.embedding.weight.shape
        return n_heads * (n_queries + n_keys) * rows * hd
