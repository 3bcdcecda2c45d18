import math

import pytest
import torch
from torch import nn

from dynaseq.nn import AuxOutputs, DecoderLayer, EncoderLayer, padding_to_attn_mask
from dynaseq.techniques.cct.layers import (
    BudgetTerm,
    budget_loss,
    budget_terms,
    conditional_attention,
    conditional_feedforward,
    gate_traces,
    name_conditional_sublayers,
    set_gate_step,
)


def _example_terms():
    """Encoder: one gate of cost 10 per token, padding at (2, 1). Decoder: two gates, cost 1, 3."""
    enc_g = torch.tensor([[0.5, 1.0], [0.2, 0.4], [1.0, 0.9]])[..., None]
    enc_valid = torch.tensor([[1, 1], [1, 1], [1, 0]]).bool()
    dec_g = torch.tensor([[[1.0, 0.0]], [[0.5, 0.5]], [[0.0, 1.0]]])
    return [BudgetTerm(enc_g, torch.tensor(10.0), enc_valid, 0),
            BudgetTerm(dec_g, torch.tensor([1.0, 3.0]), torch.ones(3, 1, dtype=torch.bool), 1)]


def test_budget_loss_on_a_hand_computed_example():
    group = torch.tensor([0, 1, 0])  # two budget groups (control tasks); group 2 is absent
    budgets = torch.tensor([[0.5, 1.0], [0.25, 0.5], [0.2, 0.2]])
    out = budget_loss(_example_terms(), group, budgets, weight=0.5)
    # task 0 (seqs 0, 2) encoder: total 10*3 = 30, used 10*(0.5+1+1) = 25, budget 15 -> 10/15
    # task 1 (seq 1)    encoder: total 20, used 6, budget 5                   -> 1/5
    # task 0 decoder: total 2*(1+3) = 8, used 1 + 3 = 4, budget 8             -> 1/2
    # task 1 decoder: total 4, used 0.5 + 1.5 = 2, budget 2                   -> 0
    expected = torch.tensor([[10 / 15, 1 / 2], [1 / 5, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(out.per_task, expected)
    assert out.loss.item() == pytest.approx(0.5 * (10 / 15 + 1 / 5 + 1 / 2))
    torch.testing.assert_close(out.utilization[:2], torch.tensor([[25 / 30, 0.5], [0.3, 0.5]]))
    assert math.isnan(out.utilization[2, 0])


def test_padding_tokens_do_not_count():
    terms = _example_terms()
    group, budgets = torch.tensor([0, 1, 0]), torch.tensor([[0.5, 1.0], [0.25, 0.5]])
    before = budget_loss(terms, group, budgets).loss
    terms[0].gates[2, 1] = 0.0  # the padded token
    assert budget_loss(terms, group, budgets).loss == before


def test_budget_loss_is_two_sided_and_differentiable():
    g = torch.full((2, 4, 1), 0.5, requires_grad=True)
    term = BudgetTerm(g, torch.tensor(1.0), torch.ones(2, 4, dtype=torch.bool), 0)
    over = budget_loss([term], torch.tensor([0, 0]), torch.tensor([[0.25]]))
    under = budget_loss([term], torch.tensor([0, 0]), torch.tensor([[1.0]]))
    assert over.loss.item() == pytest.approx(1.0) and under.loss.item() == pytest.approx(0.5)
    over.loss.backward()
    assert (g.grad > 0).all()  # over budget: pushes the gates down


@pytest.mark.parametrize("group, budgets, match", [
    (torch.tensor([0, 1, 0]), torch.tensor([[0.5, 1.0], [0.0, 0.5]]), r"\(0, 1\]"),
    (torch.tensor([0, 1, 0]), torch.tensor([[0.5, 1.5], [0.5, 0.5]]), r"\(0, 1\]"),
    (torch.tensor([0, 2, 0]), torch.tensor([[0.5, 1.0], [0.5, 0.5]]), r"\[0, 2\)"),
    (torch.tensor([0, 1]), torch.tensor([[0.5, 1.0], [0.5, 0.5]]), "B=2"),
    (torch.tensor([0, 1, 0]), torch.tensor([0.5, 1.0]), "table"),
])
def test_bad_budget_input_raises(group, budgets, match):
    with pytest.raises(ValueError, match=match):
        budget_loss(_example_terms(), group, budgets)


class _TinyCCT(nn.Module):
    """One encoder and one decoder layer of CCT sub-layers (no embeddings)."""

    def __init__(self, d=32):
        super().__init__()

        def attn():
            return conditional_attention(d, 4, control_hidden=16)

        def ffn():
            return conditional_feedforward(d, 64, 4, control_hidden=16)

        self.encoder = nn.ModuleList([EncoderLayer(d, attn(), ffn())])
        self.decoder = nn.ModuleList([DecoderLayer(d, attn(), attn(), ffn())])

    def forward(self, src, src_pad, tgt, aux):
        mask = padding_to_attn_mask(src_pad)
        mem = self.encoder[0](src, mask, aux=aux)
        return self.decoder[0](tgt, mem, mask, aux=aux)


def test_traces_to_budget_terms_and_gradients_reach_the_control_nets():
    torch.manual_seed(0)
    model = _TinyCCT().train()
    assert name_conditional_sublayers(model) == 5
    set_gate_step(model, 0)
    src, tgt = torch.randn(3, 5, 32), torch.randn(3, 4, 32)
    src_pad = torch.zeros(3, 5, dtype=torch.bool)
    src_pad[1, 3:] = True
    tgt_pad = torch.zeros(3, 4, dtype=torch.bool)
    tgt_pad[2, 2:] = True
    aux = AuxOutputs()
    out = model(src, src_pad, tgt, aux)
    traces = gate_traces(aux)
    assert {(t.layer, t.gate, t.stream) for t in traces} == {
        ("encoder.0.self_attn", "q", "input"), ("encoder.0.self_attn", "kv", "input"),
        ("encoder.0.ffn", "ffn", "input"),
        ("decoder.0.self_attn", "q", "input"), ("decoder.0.self_attn", "kv", "input"),
        ("decoder.0.cross_attn", "q", "input"), ("decoder.0.cross_attn", "kv", "memory"),
        ("decoder.0.ffn", "ffn", "input"),
        ("encoder.0.self_attn", "control", "input"), ("encoder.0.ffn", "control", "input"),
        ("decoder.0.self_attn", "control", "input"), ("decoder.0.ffn", "control", "input"),
        ("decoder.0.cross_attn", "control", "input"),
        ("decoder.0.cross_attn", "control", "memory")}
    assert len(traces) == 16  # attention: q, kv and their two control nets; FFN: ffn, control
    for tr in traces:
        if tr.gate == "control":  # always on, costed at the control net's MACs per token
            assert not tr.values.requires_grad and bool((tr.values == 1).all())
            n_gates = 4 if tr.layer.endswith("ffn") else 1
            assert float(tr.cost) == 32 * 16 + 16 * n_gates
    valid = {"encoder": ~src_pad, "decoder": ~tgt_pad, "decoder.memory": ~src_pad}
    terms = budget_terms(traces, valid)
    cross_kv = next(t for t, tr in zip(terms, traces, strict=True)
                    if tr.gate == "kv" and "cross" in tr.layer)
    assert cross_kv.subnetwork == 1 and cross_kv.valid is valid["decoder.memory"]
    loss = budget_loss(terms, torch.tensor([0, 1, 1]), torch.tensor([[0.3, 0.5], [1.0, 0.2]]))
    (out.pow(2).mean() + loss.loss).backward()
    controls = [m for m in model.modules() if type(m).__name__ == "ControlNet"]
    assert len(controls) == 8  # q + kv per attention, one per FFN
    for c in controls:
        assert c.w1.weight.grad is not None and c.w1.weight.grad.abs().sum() > 0
        assert c.w2.weight.grad.abs().sum() > 0


def test_budget_terms_need_named_layers_and_masks():
    torch.manual_seed(0)
    ffn = conditional_feedforward(32, 64, 4, control_hidden=8).train()
    aux = AuxOutputs()
    ffn(torch.randn(2, 3, 32), aux=aux)
    with pytest.raises(ValueError, match="name_conditional_sublayers"):
        budget_terms(gate_traces(aux), {"encoder": torch.ones(2, 3, dtype=torch.bool)})
    ffn.name = "decoder.layers.0.ffn"
    aux = AuxOutputs()
    ffn(torch.randn(2, 3, 32), aux=aux)
    with pytest.raises(ValueError, match="no padding mask 'decoder'"):
        budget_terms(gate_traces(aux), {"encoder": torch.ones(2, 3, dtype=torch.bool)})
