"""Lean decoding-step parts of the dense sub-layers (see :mod:`dynaseq.nn.lean_step`).

* self-attention (:class:`~dynaseq.nn.MultiHeadAttention`): q/k/v projections fused into one
  ``(3·inner, d)`` matrix (a copy, listed in ``sources``), keys and values written into the
  layer's preallocated :class:`~dynaseq.nn.lean_step.StepCache`;
* cross-attention: the encoder output's keys and values projected once, at ``start``;
* feed-forward (:class:`~dynaseq.nn.FeedForward`): ``fc2(relu(fc1(x)))`` as two function calls.

The same operations as the modules' forward passes, some fused: outputs equal them up to
float rounding. Attention with position scores (relative positions) or pruned to no head
declines (the general step runs it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.attention import MultiHeadAttention, padding_to_attn_mask
from dynaseq.nn.feedforward import FeedForward
from dynaseq.nn.lean_step import CrossKeys, StepCache, linear_of, register_lean, split_heads
from dynaseq.nn.lean_step import apply_linear as _linear


class DenseSelfAttention:
    """Self-attention of one new token per row over the cached keys (see the module doc)."""

    def __init__(self, m: MultiHeadAttention) -> None:
        projections = (m.q_proj, m.k_proj, m.v_proj)
        self.sources = [t for p in projections for t in (p.weight, p.bias)]
        with torch.no_grad():
            self.qkv_weight = torch.cat([p.weight for p in projections])  # (3·inner, d)
            self.qkv_bias = torch.cat([p.bias for p in projections])
        self.out = m.out_proj
        self.n_heads, self.d_head = m.n_heads, m.d_head

    def step(self, x: Tensor, cache: StepCache, offset: Tensor | None) -> Tensor:
        """x ``(B, 1, d)`` -> ``(B, 1, d)``; appends this step's keys and values to ``cache``."""
        b, h, d = x.size(0), self.n_heads, self.d_head
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # (B, 1, 3·H·hd)
        q, k, v = qkv.view(b, 3, h, 1, d).unbind(1)  # each (B, H, 1, hd)
        keys, values = cache.append(k, v)  # (B, H, t+1, hd)
        a = F.scaled_dot_product_attention(q, keys, values)  # (B, H, 1, hd)
        return _linear(a.reshape(b, 1, h * d), self.out)


class DenseCrossAttention:
    """Cross-attention of one new token per row over the encoder output's keys and values,
    projected once by :meth:`start`."""

    def __init__(self, m: MultiHeadAttention) -> None:
        self.sources: list[Tensor] = []
        self.q, self.k, self.v, self.out = m.q_proj, m.k_proj, m.v_proj, m.out_proj
        self.n_heads, self.d_head = m.n_heads, m.d_head

    def start(self, memory: Tensor, pad_mask: Tensor, offset: Tensor | None) -> CrossKeys:
        """memory ``(B, S, d)``, pad_mask ``(B, S)`` bool (True at padding) -> the keys."""
        mask = padding_to_attn_mask(pad_mask) if bool(pad_mask.any()) else None
        return CrossKeys(split_heads(_linear(memory, self.k), self.n_heads),
                         split_heads(_linear(memory, self.v), self.n_heads), mask)

    def step(self, x: Tensor, keys: CrossKeys, offset: Tensor | None) -> Tensor:
        b, h, d = x.size(0), self.n_heads, self.d_head
        q = _linear(x, self.q).view(b, h, 1, d)
        a = F.scaled_dot_product_attention(q, keys.k, keys.v, attn_mask=keys.mask)
        return _linear(a.reshape(b, 1, h * d), self.out)


class DenseFeedForward:
    """``fc2(relu(fc1(x)))``."""

    def __init__(self, m: FeedForward) -> None:
        self.sources: list[Tensor] = []
        self.fc1, self.fc2 = m.fc1, m.fc2

    def step(self, x: Tensor, offset: Tensor | None) -> Tensor:
        return _linear(_linear(x, self.fc1).relu_(), self.fc2)


def _attention_part(m: nn.Module, role: str) -> DenseSelfAttention | DenseCrossAttention | None:
    assert isinstance(m, MultiHeadAttention)
    if (role == "ffn" or m.position_scores is not None or m.n_heads == 0
            or any(linear_of(p) is None for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj))):
        return None
    return DenseSelfAttention(m) if role == "self" else DenseCrossAttention(m)


def _ffn_part(m: nn.Module, role: str) -> DenseFeedForward | None:
    assert isinstance(m, FeedForward)
    ok = role == "ffn" and linear_of(m.fc1) is not None and linear_of(m.fc2) is not None
    return DenseFeedForward(m) if ok else None


register_lean(MultiHeadAttention, _attention_part)
register_lean(FeedForward, _ffn_part)
