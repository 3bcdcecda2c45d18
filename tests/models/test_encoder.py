"""The encoder model: embeddings (segments, ALBERT factorization), cross-layer sharing,
heads, analytic MACs = FlopCounterMode, CCT-BERT's gates and per-row budgets."""

from __future__ import annotations

import pytest
import torch

from dynaseq.metrics.encoder_profile import encoder_macs, flop_counter_encoder_macs
from dynaseq.tasks.encoder.config import EncoderModelConfig
from dynaseq.tasks.encoder.model import MLM, build_encoder_model
from dynaseq.techniques.cct.config import EncoderCCTConfig
from dynaseq.techniques.cct.gating import ALL_GATES_ON, BudgetControl, force_gates
from dynaseq.techniques.cct.layers import realized_macs_by_row

V = 50


def _cfg(**kw) -> EncoderModelConfig:
    base = {"d_model": 32, "ffn_dim": 64, "n_heads": 2, "layers": 2, "max_positions": 64,
            "dropout": 0.0, "attention_dropout": 0.0, "classifier_dropout": 0.0}
    return EncoderModelConfig(**{**base, **kw})


def _tokens(b: int = 3, s: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(7, V, (b, s), generator=torch.Generator().manual_seed(seed))


def test_factorized_embedding_and_sharing_parameter_counts():
    d, e, f, n_layers = 32, 8, 64, 4
    dense = build_encoder_model(_cfg(layers=n_layers), V, 2)
    fact = build_encoder_model(_cfg(layers=n_layers, embedding_dim=e), V, 2)
    shared = build_encoder_model(_cfg(layers=n_layers, share_layers="all"), V, 2)
    groups = build_encoder_model(_cfg(layers=n_layers, share_layers="groups", layer_groups=2),
                                 V, 2)

    def n(m):
        return sum(p.numel() for p in m.parameters())

    # token + position + segment tables: V·d -> V·E (+ E·d + d projection); LN width d -> E
    assert n(dense) - n(fact) == (V + 64 + 2) * (d - e) + 2 * (d - e) - (e * d + d)
    layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d  # attn, FFN, two LayerNorms
    assert n(dense) - n(shared) == 3 * layer and n(dense) - n(groups) == 2 * layer
    assert shared.encoder.plan == [0, 0, 0, 0] and groups.encoder.plan == [0, 0, 1, 1]
    assert len(shared.encoder.layers) == 1 and shared.encoder.depth == 4


def test_shared_layers_apply_the_same_module_at_every_depth():
    model = build_encoder_model(_cfg(layers=3, share_layers="all"), V, 2).eval()
    ref = build_encoder_model(_cfg(layers=3), V, 2).eval()
    ref.load_state_dict({k: v for k, v in model.state_dict().items()
                         if not k.startswith("encoder.layers")}, strict=False)
    for i in range(3):  # the same layer's weights at each depth: same function
        ref.encoder.layers[i].load_state_dict(model.encoder.layers[0].state_dict())
    x = _tokens()
    torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=0, atol=0)


def test_segments_change_the_output_and_padding_does_not():
    model = build_encoder_model(_cfg(), V, 2).eval()
    x = _tokens(1, 8)
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    assert not torch.equal(model(x, seg).logits, model(x, torch.zeros_like(seg)).logits)
    padded = torch.cat([x, torch.zeros(1, 5, dtype=torch.long)], 1)
    pseg = torch.cat([seg, torch.zeros(1, 5, dtype=torch.long)], 1)
    torch.testing.assert_close(model(padded, pseg).logits, model(x, seg).logits)


def test_mlm_head_is_tied_and_scores_selected_positions():
    model = build_encoder_model(_cfg(embedding_dim=16), V, MLM)
    assert model.head.decoder_weight is model.encoder.embeddings.tokens.weight
    x = _tokens()
    select = torch.zeros_like(x, dtype=torch.bool)
    select[0, 2] = select[2, 5] = True
    out = model.eval()(x, select=select)
    assert out.logits.shape == (2, V)
    torch.testing.assert_close(out.logits, model(x).logits.view(3, 10, V)[select])


@pytest.mark.parametrize("kw,head", [({}, 2), ({"embedding_dim": 8}, 3),
                                     ({"share_layers": "all", "layers": 3}, MLM),
                                     ({"embedding_dim": 16, "share_layers": "groups",
                                       "layers": 4, "layer_groups": 2}, 1)])
def test_analytic_macs_equal_the_flop_counter(kw, head):
    model = build_encoder_model(_cfg(**kw), V, head)
    for s in (1, 7, 32):
        analytic = sum(encoder_macs(model, s).values())
        assert flop_counter_encoder_macs(model, _tokens(1, s)) == analytic
    d, f, n_layers = 32, 64, model.encoder.depth
    layer = 4 * d * d + 2 * 7 * d + 2 * d * f  # per token at S = 7
    extra = encoder_macs(model, 7)
    assert extra["ffn.ffn_in"] == n_layers * 7 * d * f
    assert sum(v for k, v in extra.items() if k.startswith(("self_attn", "ffn"))) == (
        n_layers * 7 * layer)


def _cct_model(**kw):
    cct = EncoderCCTConfig(ffn_pieces=2, control_hidden=8, budgets=[0.8, 0.5, 0.33],
                           alpha_max=0.0)
    torch.manual_seed(0)
    return build_encoder_model(_cfg(cct=cct, **kw), V, 2)


def test_cct_gates_forced_on_equal_the_soft_model():
    model = _cct_model()
    x, seg = _tokens(), torch.zeros(3, 10, dtype=torch.long)
    x[1, 7:] = 0  # padding
    with force_gates(model, 1.0), torch.no_grad():
        soft = model.train()(x, seg, 1).logits  # noise-free soft gates pinned to 1
        hard = model.eval()(x, seg, 1).logits   # inference path, every gate on
    torch.testing.assert_close(hard, soft)
    with torch.no_grad():  # opening every gate by offset is the same computation
        opened = model(x, seg, BudgetControl(1, {"encoder": ALL_GATES_ON})).logits
    torch.testing.assert_close(opened, hard)


def test_cct_mixed_budgets_in_a_batch_equal_each_row_alone():
    model = _cct_model().eval()
    x = _tokens(4, 12, seed=3)
    seg = torch.zeros_like(x)
    ids = torch.tensor([0, 2, 1, 2])
    offsets = torch.tensor([0.0, 0.3, -0.2, 0.0])
    with torch.no_grad():
        mixed = model(x, seg, BudgetControl(ids, {"encoder": offsets}))
        per_row = realized_macs_by_row(mixed.aux)
        for b in range(4):
            alone = model(x[b:b + 1], seg[b:b + 1],
                          BudgetControl(ids[b:b + 1], {"encoder": offsets[b:b + 1]}))
            torch.testing.assert_close(mixed.logits[b:b + 1], alone.logits)
            for layer, counts in realized_macs_by_row(alone.aux).items():
                assert int(per_row[layer][b]) == int(counts[0])


def test_cct_model_requires_a_control_and_dense_refuses_one():
    model = _cct_model()
    with pytest.raises(ValueError, match="control symbol"):
        model(_tokens())
    with pytest.raises(ValueError, match="no control symbols"):
        build_encoder_model(_cfg(), V, 2)(_tokens(), None, 0)
