"""Adaptive input and adaptive softmax (Baevski & Auli 2018)."""

from __future__ import annotations

import pytest
import torch

from dynaseq.core.errors import ConfigError
from dynaseq.nn.adaptive_io import AdaptiveInput, AdaptiveSoftmax, default_dims

V, D, CUTOFFS = 50, 16, [10, 30]


@pytest.fixture
def softmax():
    torch.manual_seed(0)
    return AdaptiveSoftmax(D, V, CUTOFFS)


def test_layout_and_default_dims(softmax):
    assert default_dims(256, 2) == [256, 64, 4]  # MicroNet's widths
    assert softmax.head.weight.shape == (10 + 2, D)
    assert [tuple(t[1].weight.shape) for t in softmax.tails] == [(20, 4), (20, 1)]
    assert softmax.cutoffs == CUTOFFS


def test_probabilities_sum_to_one_and_forward_matches_log_prob(softmax):
    h = torch.randn(40, D)
    logp = softmax.log_prob(h)
    assert logp.shape == (40, V)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(40))
    target = torch.randint(0, V, (40,))
    torch.testing.assert_close(softmax(h, target), logp.gather(1, target[:, None]).squeeze(1))


def test_tails_run_only_on_rows_that_need_them(softmax):
    rows = []
    for tail in softmax.tails:
        tail.register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape[0]))
    h = torch.randn(6, D)
    softmax(h, torch.tensor([0, 1, 2, 3, 4, 12]))  # five head words, one in tail 0
    assert rows == [1]  # tail 0 saw one row, tail 1 never ran
    rows.clear()
    softmax(h, torch.tensor([0, 1, 2, 3, 4, 5]))
    assert rows == []


def test_bf16_is_stable(softmax):
    h = torch.randn(8, D) * 30
    target = torch.randint(0, V, (8,))
    lp = softmax.to(torch.bfloat16)(h.bfloat16(), target)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
    full = softmax.log_prob(h.bfloat16())
    torch.testing.assert_close(full.exp().sum(-1), torch.ones(8), atol=1e-3, rtol=0)


def test_gradients_flow_through_tails(softmax):
    h = torch.randn(4, D, requires_grad=True)
    softmax(h, torch.tensor([1, 15, 35, 2])).sum().backward()
    assert all(p.grad is not None for p in softmax.parameters())


def test_tied_input_shares_weights_and_embeds_every_bin(softmax):
    emb = AdaptiveInput.tied_to(softmax)
    assert emb.tables[0].weight is softmax.head.weight
    assert emb.tables[1].weight is softmax.tails[0][1].weight
    assert emb.projections[2].weight is softmax.tails[1][0].weight
    tokens = torch.tensor([[0, 9, 10, 29, 30, 49]])
    out = emb(tokens)
    assert out.shape == (1, 6, D) and torch.isfinite(out).all()
    # a head word is its (scaled) row of the softmax head
    torch.testing.assert_close(out[0, 1], softmax.head.weight[9] * D ** 0.5)
    with pytest.raises(ValueError, match="token ids"):
        emb(torch.tensor([V]))
    untied = AdaptiveInput(D, V, CUTOFFS)
    assert untied(tokens).shape == (1, 6, D)
    assert not any(p is q for p in untied.parameters() for q in softmax.parameters())


@pytest.mark.parametrize("cutoffs, message", [([10, 50], "not below the vocabulary size 50"),
                                               ([60], "not below the vocabulary"),
                                               ([30, 10], "increasing"), ([0], "> 0")])
def test_bad_cutoffs_are_refused(cutoffs, message):
    with pytest.raises(ConfigError, match=message):
        AdaptiveSoftmax(D, V, cutoffs)
    with pytest.raises(ConfigError, match="dims"):
        AdaptiveSoftmax(D, V, [10], dims=[D, 4, 2])
