"""Auxiliary losses: hand-computed diversity/entropy (eq. 17-20), layer average (eq. 31),
padding excluded through the valid masks, MoE importance/load (Shazeer et al. 2017)."""

import math

import pytest
import torch
from torch import nn

from dynaseq.nn import AuxOutputs, DecoderLayer, EncoderLayer, padding_to_attn_mask
from dynaseq.techniques.branching import (
    ExpertTrace,
    RouteTrace,
    add_routing_losses,
    dmb_attention,
    dmb_feedforward,
    name_branching_sublayers,
    route_traces,
    routing_losses,
    seq2seq_valid,
)

# Three real tokens whose gate distributions are simple fractions, and one padding token.
PROBS = [[1 / 3, 1 / 3, 1 / 3], [2 / 4, 1 / 4, 1 / 4], [1 / 5, 3 / 5, 1 / 5]]
LOGITS = torch.tensor([[[0.0, 0.0, 0.0], [math.log(2), 0.0, 0.0], [0.0, math.log(3), 0.0],
                        [9.0, -9.0, 0.0]]])  # (1, 4, 3)
VALID = torch.tensor([[True, True, True, False]])


def _hand_dmb(probs):
    n = len(probs[0])
    s = [sum(row[i] for row in probs) for i in range(n)]
    mu = sum(s) / n
    diversity = sum((si - mu) ** 2 for si in s) / mu ** 2
    entropy = -sum(p * math.log(p) for row in probs for p in row) / len(probs)
    return diversity, entropy


def _trace(logits, gate_id=1, layer="encoder.layers.0.ffn"):
    return RouteTrace(layer, "ffn", "input", logits, logits.argmax(-1), gate_id)


def test_dmb_losses_equal_the_hand_computation():
    diversity, entropy = _hand_dmb(PROBS)
    assert diversity == pytest.approx(294 / 3600)  # S = (31/30, 71/60, 47/60), μ = 1
    losses = routing_losses([_trace(LOGITS)], VALID, alpha=0.1)
    (gate,) = losses.gates
    assert gate.n_tokens == 3 and gate.kind == "dmb"
    assert float(gate.terms["diversity"]) == pytest.approx(diversity, rel=1e-5)
    assert float(gate.terms["entropy"]) == pytest.approx(entropy, rel=1e-5)
    assert float(losses.total) == pytest.approx(0.1 * (diversity + entropy), rel=1e-5)


def test_padding_tokens_do_not_count():
    other = LOGITS.clone()
    other[0, 3] = torch.tensor([-3.0, 7.0, 1.0])
    a = routing_losses([_trace(LOGITS)], VALID)
    b = routing_losses([_trace(other)], VALID)
    assert float(a.total) == float(b.total)
    assert float(routing_losses([_trace(LOGITS)]).total) != float(a.total)  # all four count


def test_losses_average_over_gating_units_eq31():
    second = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])
    losses = routing_losses([_trace(LOGITS, 1), _trace(second, 2, "decoder.layers.0.ffn")],
                            {"encoder": VALID, "decoder": torch.ones(1, 2, dtype=torch.bool)},
                            alpha=0.5)
    d1, e1 = _hand_dmb(PROBS)
    d2, e2 = _hand_dmb(second[0].softmax(-1).tolist())
    assert float(losses.total) == pytest.approx(0.5 * (d1 + e1 + d2 + e2) / 2, rel=1e-5)
    assert float(losses.mean("entropy")) == pytest.approx((e1 + e2) / 2, rel=1e-5)


def test_moe_importance_and_load_equal_the_hand_computation():
    gates = torch.tensor([[[0.6, 0.4, 0.0, 0.0], [0.0, 0.7, 0.3, 0.0], [0.5, 0.0, 0.0, 0.5],
                           [0.0, 0.0, 0.9, 0.1]]])
    load = torch.tensor([[[0.9, 0.8, 0.2, 0.1], [0.3, 0.9, 0.6, 0.2], [0.7, 0.1, 0.2, 0.9],
                          [0.5, 0.5, 0.5, 0.5]]])
    experts = torch.tensor([[[0, 1], [1, 2], [0, 3], [2, 3]]])
    trace = ExpertTrace("encoder.layers.0.ffn", "input", gates, experts, load, 7)

    def cv2(values):
        mean = sum(values) / len(values)
        return sum((v - mean) ** 2 for v in values) / len(values) / mean ** 2

    importance = cv2([1.1, 1.1, 0.3, 0.5])  # the padding token (last) left out
    load_sum = cv2([1.9, 1.8, 1.0, 1.2])
    losses = routing_losses([trace], VALID.new_tensor([[True, True, True, False]]), alpha=0.1)
    (gate,) = losses.gates
    assert float(gate.terms["importance"]) == pytest.approx(importance, rel=1e-5)
    assert float(gate.terms["load"]) == pytest.approx(load_sum, rel=1e-5)
    assert float(losses.total) == pytest.approx(0.1 * (importance + load_sum), rel=1e-5)


def _tiny_seq2seq(d=16):
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.layers = nn.ModuleList([EncoderLayer(d, dmb_attention(d, 2),
                                                       dmb_feedforward(d, 32))])
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList([DecoderLayer(d, dmb_attention(d, 2),
                                                       dmb_attention(d, 2),
                                                       dmb_feedforward(d, 32))])
    return model


def test_a_named_encoder_decoder_reads_masks_by_stream():
    torch.manual_seed(0)
    model = _tiny_seq2seq()
    assert name_branching_sublayers(model) == 5
    src = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]])  # pad id 0
    tgt = torch.tensor([[2, 8, 9], [2, 8, 0]])
    valid = seq2seq_valid(src, tgt, pad_id=0)
    mask = padding_to_attn_mask(src.eq(0))
    aux = AuxOutputs()
    enc = model.encoder.layers[0](torch.randn(2, 4, 16), mask, aux=aux)
    model.decoder.layers[0](torch.randn(2, 3, 16), enc, mask, aux=aux)
    losses = routing_losses(aux, valid)
    names = [g.layer for g in losses.gates]
    assert names == ["encoder.layers.0.self_attn", "encoder.layers.0.ffn",
                     "decoder.layers.0.self_attn", "decoder.layers.0.cross_attn",
                     "decoder.layers.0.ffn"]
    # the cross-attention gate routed 5 real target tokens and 5 real source tokens
    assert [g.n_tokens for g in losses.gates] == [5, 5, 5, 10, 5]
    cross = [t for t in route_traces(aux) if t.layer.endswith("cross_attn")]
    rows = torch.cat([cross[0].logits[valid["decoder"]],
                      cross[1].logits[valid["decoder.memory"]]]).softmax(-1)
    d, e = _hand_dmb(rows.tolist())
    terms = {k: float(v.detach()) for k, v in losses.gates[3].terms.items()}
    assert terms == pytest.approx({"diversity": d, "entropy": e}, rel=1e-5)
    # every gate gets its gradient from the auxiliary losses
    losses.total.backward()
    for m in model.modules():
        if hasattr(m, "router"):
            assert m.router.proj.weight.grad.abs().sum() > 0


def test_add_routing_losses_puts_the_scaled_total_in_aux():
    aux = AuxOutputs()
    aux.add_trace("branching.routes", _trace(LOGITS))
    losses = add_routing_losses(aux, VALID, alpha=0.1, scale=3.0)
    torch.testing.assert_close(aux.losses["branching"], 3.0 * losses.total)
    empty = AuxOutputs()
    assert float(add_routing_losses(empty).total) == 0.0 and not empty.losses


@pytest.mark.parametrize("valid, match", [
    ({"decoder": VALID}, "no padding mask 'encoder'"),
    (torch.ones(1, 3, dtype=torch.bool), "shape"),
    (VALID.long(), "must be bool"),
])
def test_bad_masks_raise(valid, match):
    with pytest.raises(ValueError, match=match):
        routing_losses([_trace(LOGITS)], valid)


def test_negative_alpha_raises():
    with pytest.raises(ValueError, match="alpha"):
        routing_losses([_trace(LOGITS)], alpha=-0.1)


@pytest.mark.parametrize("diversity, entropy", [(True, False), (False, True), (False, False)])
def test_dropping_a_term_the_table_iii_ablations(diversity, entropy):
    d, e = _hand_dmb(PROBS)
    logits = LOGITS.clone().requires_grad_()
    losses = routing_losses([_trace(logits)], VALID, alpha=0.1, diversity=diversity,
                            entropy=entropy)
    (gate,) = losses.gates
    kept = {"diversity": d, "entropy": e}
    kept = {k: v for k, v in kept.items() if {"diversity": diversity, "entropy": entropy}[k]}
    assert set(gate.terms) == set(kept)
    assert float(losses.total.detach()) == pytest.approx(0.1 * sum(kept.values()), rel=1e-5,
                                                         abs=1e-12)
    losses.total.backward()  # with no term left the gate stays in the graph: zero gradient
    assert logits.grad is not None and (logits.grad.abs().sum() > 0) == bool(kept)


def test_diversity_weight_scales_only_the_diversity_term():
    d, e = _hand_dmb(PROBS)
    losses = routing_losses([_trace(LOGITS)], VALID, alpha=0.1, diversity=0.25)
    (gate,) = losses.gates
    assert float(gate.terms["diversity"]) == pytest.approx(d, rel=1e-5)  # logged unweighted
    assert float(losses.total) == pytest.approx(0.1 * (0.25 * d + e), rel=1e-5)
    with pytest.raises(ValueError, match="diversity weight must be >= 0"):
        routing_losses([_trace(LOGITS)], VALID, diversity=-1.0)


def test_seq2seq_routing_loss_is_the_unweighted_mean_over_gates():
    from dynaseq.techniques.branching import seq2seq_routing_loss

    torch.manual_seed(0)
    model = _tiny_seq2seq()
    name_branching_sublayers(model)
    src = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]])
    tgt = torch.tensor([[2, 8, 9], [2, 8, 0]])
    mask = padding_to_attn_mask(src.eq(0))
    aux = AuxOutputs()
    enc = model.encoder.layers[0](torch.randn(2, 4, 16), mask, aux=aux)
    model.decoder.layers[0](torch.randn(2, 3, 16), enc, mask, aux=aux)
    full = routing_losses(aux, seq2seq_valid(src, tgt, 0), alpha=0.1)
    assert float(seq2seq_routing_loss(aux, src, tgt, 0).detach()) == pytest.approx(
        float(full.total.detach()) / 0.1, rel=1e-6)
    only_entropy = seq2seq_routing_loss(aux, src, tgt, 0, diversity=False).detach()
    assert float(only_entropy) == pytest.approx(float(full.mean("entropy").detach()), rel=1e-6)
