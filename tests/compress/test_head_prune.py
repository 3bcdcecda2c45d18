"""HeadPrune (Michel et al. 2019): one importance per head (= |dL/dxi| by hand), selection to a
fraction, physical pruning equal to masking the dropped heads, keep-all bit-identical, fewer
parameters and smaller matmuls, a pruned model rebuilt from its config, bad inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dynaseq.compress.head_prune import (
    attention_layers,
    check_keep,
    head_importance,
    head_mask,
    masking_heads,
    prune_heads,
    select_heads,
)
from dynaseq.core.errors import ConfigError, DynaseqError
from dynaseq.metrics.encoder_profile import encoder_macs
from dynaseq.metrics.profile import count_params
from dynaseq.tasks.encoder.config import EncoderModelConfig
from dynaseq.tasks.encoder.model import build_encoder_model


def _cfg(**kw) -> EncoderModelConfig:
    base = dict(d_model=32, ffn_dim=64, n_heads=4, layers=3, max_positions=64, dropout=0.0,
                attention_dropout=0.0, classifier_dropout=0.0)
    return EncoderModelConfig(**{**base, **kw})


def _model(**kw):
    torch.manual_seed(0)
    return build_encoder_model(_cfg(**kw), 100, head=3).eval()


def _batches():
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        tok = torch.randint(5, 100, (4, 9), generator=gen)
        tok[1, 5:] = 0
        out.append((tok, torch.randint(0, 3, (4,), generator=gen)))
    return out


def _loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]).logits, batch[1], reduction="sum")


def test_importance_has_one_entry_per_head_and_is_the_mask_gradient():
    model = _model()
    raw = head_importance(model, _batches(), _loss, normalize=False)
    assert [t.shape for t in raw] == [(4,), (4,), (4,)]
    assert all(bool((t >= 0).all()) for t in raw)
    # by hand: a mask Parameter multiplying each head before out_proj, |grad| summed per batch
    xi = [torch.ones(4, requires_grad=True) for _ in range(3)]
    want = [torch.zeros(4) for _ in range(3)]
    with masking_heads(model, xi):
        for b in _batches():
            grads = torch.autograd.grad(_loss(model, b), xi)
            for w, g in zip(want, grads, strict=True):
                w += g.abs()
    for got, w in zip(raw, want, strict=True):
        assert torch.allclose(got, w, rtol=1e-5, atol=1e-7)
    normed = head_importance(model, _batches(), _loss)
    for n, r in zip(normed, raw, strict=True):
        assert torch.allclose(n, r / r.norm(), atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # the model's weights untouched


def test_select_heads_keeps_the_most_important_fraction():
    imp = [torch.tensor([0.9, 0.1, 0.5, 0.2]), torch.tensor([0.3, 0.8, 0.05, 0.6]),
           torch.tensor([0.01, 0.02, 0.03, 0.04])]
    assert select_heads(imp, 0.5) == [[0, 2, 3], [0, 1, 3], []]  # the top 6 of 12
    assert select_heads(imp, 1.0) == [[0, 1, 2, 3]] * 3
    assert select_heads(imp, 0.01) == [[0], [], []]  # at least one head
    assert sum(map(len, select_heads(imp, 0.25))) == 3


def test_keeping_every_head_is_bit_identical():
    model = _model(relative_positions=4)
    full = prune_heads(model, [[0, 1, 2, 3]] * 3)
    tok = _batches()[0][0]
    with torch.no_grad():
        assert torch.equal(full(tok).logits, model(tok).logits)
    a, b = model.state_dict(), full.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("share", ["none", "all"])
@pytest.mark.parametrize("relative", [0, 4])
def test_pruned_model_equals_the_masked_model_and_is_smaller(share, relative):
    model = _model(share_layers=share, relative_positions=relative)
    n = len(attention_layers(model))
    keep = [[0, 2], [3], []][:n] if n == 3 else [[1, 2]]
    small = prune_heads(model, keep)
    tok = _batches()[0][0]
    with torch.no_grad():
        with masking_heads(model, head_mask(model, keep)):
            masked = model(tok).logits
        out = small(tok).logits
    assert torch.allclose(out, masked, atol=1e-5)
    assert [a.n_heads for _, a in attention_layers(small)] == [len(k) for k in keep]
    assert [a.n_heads for _, a in attention_layers(model)] == [4] * n  # the source untouched
    d_head = 8
    dropped = sum(4 - len(k) for k in keep)
    # q, k, v: d_head rows (+ bias) each, out_proj: d_head columns, per dropped head
    assert count_params(model) - count_params(small) == dropped * (3 * (32 + 1) + 32) * d_head
    # the smaller matmuls really run: the analytic count and the projections' shapes
    attn = attention_layers(small)[0][1]
    assert attn.q_proj.weight.shape == (len(keep[0]) * d_head, 32)
    assert attn.out_proj.weight.shape == (32, len(keep[0]) * d_head)
    assert sum(encoder_macs(small, 9).values()) < sum(encoder_macs(model, 9).values())


def test_a_pruned_model_is_rebuilt_from_its_config():
    model = _model()
    keep = [[0, 2], [1], []]
    small = prune_heads(model, keep)
    rebuilt = build_encoder_model(_cfg(layer_heads=[2, 1, 0]), 100, head=3).eval()
    rebuilt.load_state_dict(small.state_dict())  # the same shapes
    tok = _batches()[0][0]
    with torch.no_grad():
        assert torch.equal(rebuilt(tok).logits, small(tok).logits)
    assert _cfg(layer_heads=[2, 1, 0]).architecture()["layer_heads"] == [2, 1, 0]


def test_bad_inputs_are_refused():
    for keep in (0, -0.5, 1.5, float("nan"), "x"):
        with pytest.raises(DynaseqError, match=r"fraction of heads to keep, in \(0, 1\]"):
            check_keep(keep)
    assert check_keep(1) == 1.0
    model = _model()
    with pytest.raises(ValueError, match="distinct, in"):
        prune_heads(model, [[0, 4], [1], [2]])
    with pytest.raises(ValueError, match="3 attention layers"):
        prune_heads(model, [[0]])
    for heads, message in (([2, 1], "must list 3 head counts"), ([2, 1, 5], r"in \[0, 4\]")):
        with pytest.raises(ConfigError, match=message):
            _cfg(layer_heads=heads)
    with pytest.raises(DynaseqError, match="no multi-head attention"):
        attention_layers(nn.Linear(3, 3))
