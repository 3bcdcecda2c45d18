"""Relative-position attention scores read by both queries and keys (ALBERTa, paper 004).

The adaptive-depth paper adds two positional scores to the content score of every head:

    AS_rel(i, j) = AS(i, j) + RKS(i, j) + RQS(i, j)
    RKS(i, j) = k_j · E_R(i−j),   RQS(i, j) = q_i · E_R(i−j)

with ``q = W_Q x``, ``k = W_K x`` the head's projections and ``E_R(δ)`` a learned embedding of
the signed distance δ = i − j, clipped to [−R, R] (so a table of 2R+1 rows of ``d_head``, one
per layer, shared by the heads). The scores share the content score's 1/sqrt(d_head), so they
enter :func:`torch.nn.functional.scaled_dot_product_attention` as its additive float mask.

Hand-written because no library module gives these two terms as an additive bias (DeBERTa's
disentangled attention in ``transformers`` is fused into its own attention class).

Example::

    scores = RelativeScores(d_head=32, max_distance=16)
    bias = scores(q, k)          # q (B, H, T, hd), k (B, H, S, hd) -> (B, H, T, S)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class RelativeScores(nn.Module):
    """(q (B, H, T, hd), k (B, H, S, hd)) -> (B, H, T, S) = (RKS + RQS) / sqrt(hd).

    Query position i and key position j are their indices (self-attention over one
    sequence, T == S); distances beyond ``max_distance`` share the last embedding."""

    def __init__(self, d_head: int, max_distance: int) -> None:
        super().__init__()
        if max_distance < 1:
            raise ValueError(f"max_distance must be >= 1, got {max_distance}")
        self.max_distance = max_distance
        self.embedding = nn.Embedding(2 * max_distance + 1, d_head)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def index(self, t: int, s: int, device: torch.device) -> Tensor:
        """(T, S) long: clip(i − j, −R, R) + R, the row of E_R for query i and key j."""
        i = torch.arange(t, device=device)[:, None]
        j = torch.arange(s, device=device)[None, :]
        r = self.max_distance
        return (i - j).clamp(-r, r) + r

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        b, h, t, hd = q.shape
        s = k.size(2)
        e = self.embedding.weight  # (2R+1, hd)
        idx = self.index(t, s, q.device)  # (T, S)
        q_e = q @ e.t()  # (B, H, T, 2R+1): q_i · E_R(δ) for every δ
        k_e = k @ e.t()  # (B, H, S, 2R+1): k_j · E_R(δ)
        rqs = q_e.gather(-1, idx.expand(b, h, t, s))  # (B, H, T, S)
        rks = k_e.gather(-1, idx.t().expand(b, h, s, t)).transpose(-1, -2)  # (B, H, T, S)
        return (rqs + rks) / math.sqrt(hd)

    def macs(self, n_queries: int, n_keys: int, n_heads: int) -> int:
        """The two products with the table: (T + S) · (2R+1) · d_head per head."""
        rows, hd = self.embedding.weight.shape
        return n_heads * (n_queries + n_keys) * rows * hd
