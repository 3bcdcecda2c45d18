"""Branch usage and routing collapse of whole DMB / MoE models (teacher forced, padding out)."""

from __future__ import annotations

import pytest
import torch

from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.branching import Router
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
from dynaseq.techniques.branching.usage import branch_usage, collapsed

V, PAD = 60, 0


def _model(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, ffn_dim=48, n_heads=4, encoder_layers=2, decoder_layers=2,
                      dropout=0.0, **kw)
    return build_seq2seq(cfg, V, pad_id=PAD)


def _pairs():
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(4, V, (2, 7), generator=g), torch.randint(4, V, (2, 5), generator=g)
    src[1, 4:] = PAD  # sequence 1: 4 source and 3 target tokens
    tgt[1, 3:] = PAD
    return src, tgt


def test_a_router_that_sends_everything_to_one_branch_is_reported_collapsed():
    model = _model(dmb=DMBConfig(n_branches=3))
    routers = [m for m in model.modules() if isinstance(m, Router)]
    with torch.no_grad():
        for r in routers:
            r.proj.bias.copy_(torch.tensor([0.0, 1e4, 0.0]))
    usage = branch_usage(model, [_pairs()], PAD)
    # encoder: self-attention + FFN; decoder: self-attention, cross-attention (queries and
    # memory), FFN; 2 layers each
    assert len(usage) == 2 * 2 + 2 * 4
    assert "decoder.layers.1.cross_attn:attn:memory" in usage
    assert all(shares == [0.0, 1.0, 0.0] for shares in usage.values())
    assert collapsed(usage) == list(usage)
    assert model.training  # restored


def test_padding_is_not_counted():
    """A padded batch counts what its sequences count one at a time, unpadded."""
    model = _model(dmb=DMBConfig(n_branches=3)).eval()
    src, tgt = _pairs()
    together = branch_usage(model, [(src, tgt)], PAD)
    apart = branch_usage(model, [(src[:1], tgt[:1]), (src[1:, :4], tgt[1:, :3])], PAD)
    assert together.keys() == apart.keys()
    for name in together:
        assert together[name] == pytest.approx(apart[name], abs=1e-12)
        assert sum(together[name]) == pytest.approx(1.0)


def test_moe_counts_each_of_the_k_experts():
    model = _model(moe=MoEConfig(n_experts=4, k=2))
    usage = branch_usage(model, [_pairs()], PAD)
    assert usage and all(len(s) == 4 and sum(s) == pytest.approx(1.0) for s in usage.values())
    # every token runs 2 distinct experts, so no expert can take more than half of the pairs
    assert all(max(s) <= 0.5 for s in usage.values())
    assert collapsed(usage) == []


def test_collapse_share_must_be_a_fraction():
    with pytest.raises(ValueError, match="share must lie in"):
        collapsed({"x": [1.0]}, share=1.0)
