"""Lean decoding-step parts of the dense sub-layers (see :mod:`dynaseq.nn.lean_step`).

* self-attention (:class:`~dynaseq.nn.MultiHeadAttention`): q/k/v projections fused into one
  ``(3·inner, d)`` matrix (a copy), keys and values written into the layer's preallocated
  :class:`~dynaseq.nn.lean_step.StepCache`;
* cross-attention: the encoder output's keys and values projected once, at ``start``;
* feed-forward (:class:`~dynaseq.nn.FeedForward`): ``fc2(relu(fc1(x)))`` as two function calls;
* an encoder's self-attention (role ``"encoder"``): the fused q/k/v product over whole
  sequences, padding keys masked, and the attention's position scores (relative positions)
  added as the module adds them.

Projections may be float ``nn.Linear`` or int8 :class:`~dynaseq.nn.int8.Int8Linear` (a
quantized model, ``dynaseq quantize``): each runs through
:func:`~dynaseq.nn.lean_step.linear_fn`, the fused q/k/v through
:func:`~dynaseq.nn.lean_step.fused_linear` (int8 rows stacked: exactly the separate
products, as the input is quantized per row). The same operations as the modules' forward
passes, some fused: outputs equal them up to float rounding (int8: exactly). Attention
pruned to no head, or with position scores in a decoding step, declines (the general step
runs it).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.attention import (
    MultiHeadAttention,
    padding_to_attn_mask,
    with_position_scores,
)
from dynaseq.nn.feedforward import FeedForward
from dynaseq.nn.lean_step import (
    CrossKeys,
    LinearFn,
    StepCache,
    StepTally,
    attend_keys,
    fused_linear,
    linear_fn,
    linear_tensors,
    register_lean,
    split_heads,
)


class DenseSelfAttention:
    """Self-attention of one new token per row over the cached keys (see the module doc)."""

    def __init__(self, m: MultiHeadAttention, qkv: LinearFn, out: LinearFn) -> None:
        self.sources = [t for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj)
                        for t in linear_tensors(p)]
        self.qkv, self.out = qkv, out  # (3·inner, d) fused copy; the output projection
        self.n_heads, self.d_head = m.n_heads, m.d_head

    def step(self, x: Tensor, cache: StepCache, offset: Tensor | None,
             tally: StepTally | None = None) -> Tensor:
        """x ``(B, 1, d)`` -> ``(B, 1, d)``; appends this step's keys and values to ``cache``."""
        b, h, d = x.size(0), self.n_heads, self.d_head
        qkv = self.qkv(x)  # (B, 1, 3·H·hd)
        q, k, v = qkv.view(b, 3, h, 1, d).unbind(1)  # each (B, H, 1, hd)
        keys, values = cache.append(k, v)  # (B, H, t+1, hd)
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=cache.mask)  # (B,H,1,hd)
        return self.out(a.reshape(b, 1, h * d))


class DenseCrossAttention:
    """Cross-attention of one new token per row over the encoder output's keys and values,
    projected once by :meth:`start`."""

    def __init__(self, m: MultiHeadAttention, fns: list[LinearFn]) -> None:
        self.sources = [t for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj)
                        for t in linear_tensors(p)]
        self.q, self.k, self.v, self.out = fns
        self.n_heads, self.d_head = m.n_heads, m.d_head

    def start(self, memory: Tensor, pad_mask: Tensor, offset: Tensor | None,
              tally: StepTally | None = None) -> CrossKeys:
        """memory ``(B, S, d)``, pad_mask ``(B, S)`` bool (True at padding) -> the keys."""
        mask = padding_to_attn_mask(pad_mask) if bool(pad_mask.any()) else None
        return CrossKeys(split_heads(self.k(memory), self.n_heads),
                         split_heads(self.v(memory), self.n_heads), mask)

    shares_keys = True
    """Its step attends keys shared by groups of rows (:func:`attend_keys`)."""

    def step(self, x: Tensor, keys: CrossKeys, offset: Tensor | None,
             tally: StepTally | None = None) -> Tensor:
        b, h, d = x.size(0), self.n_heads, self.d_head
        a = attend_keys(self.q(x).view(b, h, 1, d), keys)  # (B, H, 1, hd)
        return self.out(a.reshape(b, 1, h * d))


class DenseEncoderAttention:
    """Bidirectional self-attention over whole sequences (an encoder layer), with the
    module's ``position_scores`` (relative positions; the module itself, not a copy) added
    to the scores as in :meth:`MultiHeadAttention.forward`."""

    def __init__(self, m: MultiHeadAttention, qkv: LinearFn, out: LinearFn) -> None:
        self.sources = [t for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj)
                        for t in linear_tensors(p)]
        self.qkv, self.out = qkv, out
        self.n_heads, self.d_head = m.n_heads, m.d_head
        self.position_scores = m.position_scores

    def encode(self, x: Tensor, valid: Tensor | None, offset: Tensor | float | None,
               tally: StepTally | None = None) -> Tensor:
        """x ``(B, S, d)``, valid ``(B, S)`` (None: no padding) -> ``(B, S, d)``."""
        b, s, _ = x.shape
        h, d = self.n_heads, self.d_head
        q, k, v = self.qkv(x).view(b, s, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # (B,H,S,hd)
        mask = None if valid is None else valid[:, None, None, :]
        if self.position_scores is not None:
            mask = with_position_scores(self.position_scores(q, k), mask)  # (B, H, S, S)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, S, hd)
        return self.out(a.transpose(1, 2).reshape(b, s, h * d))

    def encode_first(self, x: Tensor, valid: Tensor | None, offset: Tensor | float | None
                     ) -> Tensor:
        """:meth:`encode`'s output at each row's first token alone, ``(B, 1, d)`` (what a
        first-token head reads): every key and value, the first query's scores and output
        projection only (the fused product still projects every query)."""
        if self.position_scores is not None:  # relative scores: every query, then the first
            return self.encode(x, valid, offset)[:, :1]
        b, s, _ = x.shape
        h, d = self.n_heads, self.d_head
        q, k, v = self.qkv(x).view(b, s, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        mask = None if valid is None else valid[:, None, None, :]
        a = F.scaled_dot_product_attention(q[:, :, :1], k, v, attn_mask=mask)  # (B, H, 1, hd)
        return self.out(a.reshape(b, 1, h * d))


class DenseFeedForward:
    """``fc2(relu(fc1(x)))``."""

    def __init__(self, m: FeedForward, fc1: LinearFn, fc2: LinearFn) -> None:
        self.sources = [*linear_tensors(m.fc1), *linear_tensors(m.fc2)]
        self.fc1, self.fc2 = fc1, fc2

    def step(self, x: Tensor, offset: Tensor | None, tally: StepTally | None = None
             ) -> Tensor:
        return self.fc2(self.fc1(x).relu_())


def _attention_part(m: nn.Module, role: str
                    ) -> DenseSelfAttention | DenseCrossAttention | DenseEncoderAttention | None:
    assert isinstance(m, MultiHeadAttention)
    if role == "ffn" or m.n_heads == 0 or (m.position_scores is not None and role != "encoder"):
        return None
    fns = [linear_fn(p) for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj)]
    if any(f is None for f in fns):
        return None
    if role == "cross":
        return DenseCrossAttention(m, fns)
    qkv = fused_linear((m.q_proj, m.k_proj, m.v_proj))
    if qkv is None:
        return None
    return (DenseEncoderAttention if role == "encoder" else DenseSelfAttention)(m, qkv, fns[3])


def _ffn_part(m: nn.Module, role: str) -> DenseFeedForward | None:
    assert isinstance(m, FeedForward)
    fc1, fc2 = linear_fn(m.fc1), linear_fn(m.fc2)
    ok = role == "ffn" and fc1 is not None and fc2 is not None
    return DenseFeedForward(m, fc1, fc2) if ok else None


register_lean(MultiHeadAttention, _attention_part)
register_lean(FeedForward, _ffn_part)
