"""One-query attention of the lean steps (:func:`dynaseq.nn.attention.step_attention`): the
same as ``F.scaled_dot_product_attention``, by hand (two batched products) from
STEP_ATTENTION_PAIRS (row, head) pairs on, through SDPA below and for longer queries."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dynaseq.nn.attention import STEP_ATTENTION_PAIRS, step_attention

from helpers import count_ops


def _qkv(b: int, h: int = 4, length: int = 1, t: int = 9, d: int = 8, capacity: int = 16):
    """q ``(b, h, length, d)``; k, v the first ``t`` positions of ``capacity``-long caches
    (views, as a lean step's are)."""
    g = torch.Generator().manual_seed(b * 31 + t)
    q = torch.randn(b, h, length, d, generator=g)
    k = torch.randn(b, h, capacity, d, generator=g)[:, :, :t]
    v = torch.randn(b, h, capacity, d, generator=g)[:, :, :t]
    return q, k, v


def _masks(b: int, t: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(5)
    allowed = torch.rand(b, 1, 1, t, generator=g) > 0.3
    allowed[..., 0] = True  # a key for every row
    bias = torch.randn(b, 1, 1, t, generator=g).masked_fill(~allowed, -math.inf)
    return {"none": None, "bool": allowed, "float": bias}


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
@pytest.mark.parametrize("rows", [STEP_ATTENTION_PAIRS // 4, 40])
def test_by_hand_equals_sdpa_and_runs_two_products(mask, rows):
    q, k, v = _qkv(rows)
    m = _masks(rows, k.size(2))[mask]
    with count_ops() as ops:
        got = step_attention(q, k, v, m)
    assert got.shape == q.shape
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                               rtol=1e-5, atol=1e-6)
    assert ops.names.count("bmm.default") == 2
    assert not any("attention" in n for n in ops.names)


@pytest.mark.parametrize("rows,length", [(STEP_ATTENTION_PAIRS // 4 - 1, 1), (40, 3)])
def test_fewer_pairs_and_longer_queries_go_through_sdpa(rows, length):
    q, k, v = _qkv(rows, length=length)
    m = _masks(rows, k.size(2))["bool"]
    with count_ops() as ops:
        got = step_attention(q, k, v, m)
    assert "bmm.default" not in ops.names
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=m))


def test_transposed_key_views_a_fully_masked_row_and_another_value_width():
    """k/v as heads split off a ``(B, T, d)`` projection (a transposed view), values of
    another width, a row whose keys are all masked (0, as SDPA gives)."""
    b, h, t = 20, 4, 7
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, h, 1, 8, generator=g)
    k = torch.randn(b, t, h * 8, generator=g).view(b, t, h, 8).transpose(1, 2)
    v = torch.randn(b, t, h * 6, generator=g).view(b, t, h, 6).transpose(1, 2)
    for m in (torch.ones(b, 1, 1, t, dtype=torch.bool), torch.zeros(b, 1, 1, t)):
        if m.dtype == torch.bool:
            m[3] = False
        else:
            m[3] = -math.inf
        got = step_attention(q, k, v, m)
        assert got.shape == (b, h, 1, 6)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                                   rtol=1e-5, atol=1e-6)
        assert torch.equal(got[3], torch.zeros(h, 1, 6))


def test_bfloat16_goes_through_sdpa():
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(40))
    with count_ops() as ops:
        step_attention(q, k, v)
    assert "bmm.default" not in ops.names


def test_the_mask_is_not_written():
    q, k, v = _qkv(32)
    masks = _masks(32, k.size(2))
    kept = {name: m.clone() for name, m in masks.items() if m is not None}
    for m in kept:
        step_attention(q, k, v, masks[m])
        assert torch.equal(masks[m], kept[m])
