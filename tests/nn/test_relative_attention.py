"""Banded relative-position attention (Transformer-XL scores, MicroNet short context)."""

from __future__ import annotations

import pytest
import torch

from dynaseq.nn.relative_attention import relative_attention


@pytest.fixture
def attn():
    torch.manual_seed(0)
    return relative_attention(d_model=16, n_heads=2, d_head=6, context=4).eval()


def test_chunks_and_cache_reproduce_the_whole_window(attn):
    x = torch.randn(2, 11, 16)
    y, cache = attn(x)
    assert y.shape == (2, 11, 16) and cache.length == 3  # the last C-1 positions
    y1, c1 = attn(x[:, :5])
    y2, _ = attn(x[:, 5:], cache=c1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    steps, c = [], None
    for t in range(11):
        out, c = attn(x[:, t:t + 1], cache=c)
        assert c.length == min(t + 1, 3)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), y)


def test_band_is_respected(attn):
    x = torch.randn(1, 10, 16)
    y, _ = attn(x)
    x2 = x.clone()
    x2[0, 2] += 1.0  # position 2 is seen by positions 2..5 only
    y2, _ = attn(x2)
    changed = (y2 - y).abs().amax(-1)[0] > 1e-6
    assert changed.tolist() == [False, False, True, True, True, True, False, False, False, False]


def test_position_term_matters(attn):
    with torch.no_grad():
        attn.v.normal_()
    x = torch.randn(1, 6, 16)
    x[0, 1] = x[0, 3]  # same content at different distances from query 4
    y, _ = attn(x)
    assert torch.isfinite(y).all()
    with torch.no_grad():
        attn.r_proj.weight.zero_()
        attn.v.zero_()
    y0, _ = attn(x)
    assert not torch.allclose(y, y0)


def test_context_one_attends_to_itself_only():
    a = relative_attention(d_model=8, n_heads=2, d_head=None, context=1).eval()
    x = torch.randn(1, 5, 8)
    y, cache = a(x)
    assert cache.length == 0
    single = torch.cat([a(x[:, t:t + 1])[0] for t in range(5)], 1)
    torch.testing.assert_close(single, y)
