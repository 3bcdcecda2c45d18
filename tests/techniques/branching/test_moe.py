"""Noisy top-k MoE baseline: two experts per token, grouped execution, the load estimate,
parameter parity with DMB, MACs."""

import math

import pytest
import torch
import torch.nn.functional as F

from dynaseq.metrics.macs import _counter
from dynaseq.nn import AuxOutputs, padding_to_attn_mask
from dynaseq.techniques.branching import (
    MoEAttention,
    MoEFeedForward,
    NoisyTopKGate,
    dmb_attention,
    dmb_feedforward,
    load_probability,
    merge_shared_,
    moe_attention,
    moe_feedforward,
    route_traces,
    routing_losses,
)
from dynaseq.techniques.branching.moe import BranchedLinear
from dynaseq.techniques.cct.layers import realized_macs_by_layer

D, F_DIM, N = 16, 24, 4


def _moe(train: bool):
    torch.manual_seed(0)
    moe = moe_feedforward(D, F_DIM, N, k=2).train(train)
    with torch.no_grad():  # a gate that has learned something (it starts at zero)
        moe.gate.w_gate.weight.normal_()
        moe.gate.w_noise.weight.normal_(std=0.3)
    return moe


def _expert(moe, i, x):
    return F.linear(F.linear(x, moe.fc1.weight[i], moe.fc1.bias[i]).relu(),
                    moe.fc2.weight[i], moe.fc2.bias[i])


@pytest.mark.parametrize("train", [True, False])
def test_each_token_runs_its_two_experts_weighted_by_the_gate(train, linear_rows):
    moe = _moe(train)
    x = torch.randn(2, 5, D)
    aux = AuxOutputs()
    y = moe(x, aux=aux)
    (trace,) = route_traces(aux)
    experts, gates = trace.experts, trace.gates
    assert experts.shape == (2, 5, 2)
    assert bool((experts[..., 0] != experts[..., 1]).all())
    assert torch.equal((gates > 0).sum(-1), torch.full((2, 5), 2))
    torch.testing.assert_close(gates.sum(-1), torch.ones(2, 5))
    # one matmul per expert over its (token, expert) pairs: 2 * 10 rows in all
    counts = torch.bincount(experts.flatten(), minlength=N).tolist()
    assert linear_rows.rows((F_DIM, D)) == counts and sum(counts) == 20
    ref = torch.stack([sum(gates[b, t, i] * _expert(moe, i, x[b, t]) for i in experts[b, t])
                       for b in range(2) for t in range(5)]).view(2, 5, D)
    torch.testing.assert_close(y, ref)
    assert (trace.load is not None) == train


def test_inference_gating_is_deterministic_top2_of_clean_logits():
    moe = _moe(False)
    x = torch.randn(3, 4, D)
    route = moe.gate(x)
    clean = x @ moe.gate.w_gate.weight.T
    top, idx = clean.topk(2, -1)
    assert torch.equal(route.experts, idx)
    torch.testing.assert_close(route.gates, top.softmax(-1))


def test_load_probability_is_the_chance_of_staying_in_the_top_k():
    """P(x, i) = Φ((clean_i − kth_excluding) / std_i): compare with redrawing i's noise."""
    torch.manual_seed(0)
    clean = torch.tensor([0.3, -0.2, 0.1, 0.5])
    std = torch.tensor([0.4, 0.8, 0.5, 0.3])
    noisy = clean + torch.randn(4) * std
    p = load_probability(clean, noisy, std, k=2)
    for i in range(4):
        others = torch.cat([noisy[:i], noisy[i + 1:]])
        kth = float(others.topk(2).values[1])
        expected = 0.5 * (1 + math.erf((float(clean[i]) - kth) / float(std[i]) / math.sqrt(2)))
        assert float(p[i]) == pytest.approx(expected, rel=1e-5)
        draws = clean[i] + torch.randn(20000) * std[i]
        assert float(p[i]) == pytest.approx(float((draws > kth).float().mean()), abs=0.02)
        # it does not depend on i's own draw
        moved = noisy.clone()
        moved[i] = draws[0]
        assert float(load_probability(clean, moved, std, k=2)[i]) == pytest.approx(float(p[i]))


def test_gate_gets_gradient_from_the_output_and_from_both_losses():
    moe = _moe(True)
    aux = AuxOutputs()
    moe(torch.randn(2, 6, D), aux=aux).sum().backward(retain_graph=True)
    assert moe.gate.w_gate.weight.grad.abs().sum() > 0  # top-2 mixing is differentiable
    moe.zero_grad()
    losses = routing_losses(aux)
    assert set(losses.gates[0].terms) == {"importance", "load"}
    losses.gates[0].terms["load"].backward()
    assert moe.gate.w_noise.weight.grad.abs().sum() > 0


def test_same_parameters_as_dmb_and_macs_of_two_experts():
    dmb = dmb_feedforward(D, F_DIM, N)
    merge_shared_(dmb)
    moe = moe_feedforward(D, F_DIM, N, k=2).eval()

    def count(*mods):
        return sum(p.numel() for m in mods for p in m.parameters())

    assert count(dmb.fc1, dmb.fc2) == count(moe.fc1, moe.fc2)
    assert count(dmb.router) == N * D + N and count(moe.gate) == 2 * N * D
    x = torch.randn(3, 7, D)
    aux = AuxOutputs()
    with torch.no_grad(), _counter() as fc:
        moe(x, aux=aux)
    expected = {"ffn_in": 2 * 21 * D * F_DIM, "ffn_out": 2 * 21 * F_DIM * D,
                "gate_ffn": 21 * D * N}
    assert moe.macs(21) == expected
    assert realized_macs_by_layer(aux) == {"ffn": expected}
    assert fc.get_total_flops() / 2 == sum(expected.values())


@pytest.mark.parametrize("make, match", [
    (lambda: NoisyTopKGate(D, n_experts=2, k=2), "n_experts must exceed k"),
    (lambda: NoisyTopKGate(D, n_experts=4, k=0), "k must be >= 1"),
    (lambda: NoisyTopKGate(0), "d_model"),
    (lambda: NoisyTopKGate(D, noise_epsilon=-1.0), "noise_epsilon"),
    (lambda: MoEFeedForward(NoisyTopKGate(D, 4), BranchedLinear(D, F_DIM, 3),
                            BranchedLinear(F_DIM, D, 3)), "4 experts"),
    (lambda: moe_feedforward(D, F_DIM, activation_dropout=-0.1), "activation_dropout"),
    (lambda: load_probability(torch.zeros(2), torch.zeros(2), torch.ones(2), k=2), "k < N"),
    (lambda: moe_attention(10, 3), "not divisible"),
    (lambda: moe_attention(D, 4, dropout=1.0), "dropout"),
    (lambda: MoEAttention(D, 4, NoisyTopKGate(D, 4), *[BranchedLinear(D, D, 3)] * 4),
     "q_proj has 3 experts"),
    (lambda: MoEAttention(D, 4, NoisyTopKGate(D, 4), torch.nn.Linear(D, D),
                          *[BranchedLinear(D, D, 4)] * 3), "BranchedLinear"),
    (lambda: MoEAttention(D, 4, NoisyTopKGate(8, 4), *[BranchedLinear(D, D, 4)] * 4),
     "gate reads width 8"),
])
def test_bad_arguments_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ------------------------------------------------------------------------------ attention


def _moe_attn(train: bool):
    torch.manual_seed(0)
    attn = moe_attention(D, 4, N, k=2).train(train)
    with torch.no_grad():
        attn.gate.w_gate.weight.normal_()
    return attn


def _mixed(proj, x, route):
    """Each token's projection mixed over its k experts, one token at a time."""
    flat = x.reshape(-1, x.size(-1))
    experts, gates = route.experts.reshape(flat.size(0), -1), route.gates.reshape(flat.size(0), -1)
    rows = [sum(gates[m, j] * F.linear(flat[m], proj.weight[e], proj.bias[e])
                for j, e in enumerate(experts[m].tolist())) for m in range(flat.size(0))]
    return torch.stack(rows).view(*x.shape[:-1], -1)


def test_moe_attention_matches_the_per_token_reference():
    attn = _moe_attn(False)
    x, mem = torch.randn(2, 5, D), torch.randn(2, 6, D)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    mask = padding_to_attn_mask(pad)
    aux = AuxOutputs()
    y = attn(x, mem, attn_mask=mask, aux=aux)
    rq, rkv = attn.gate(x), attn.gate(mem)

    def heads(t):
        return t.view(2, t.size(1), 4, D // 4).transpose(1, 2)

    q = heads(_mixed(attn.q_proj, x, rq))
    k, v = heads(_mixed(attn.k_proj, mem, rkv)), heads(_mixed(attn.v_proj, mem, rkv))
    scores = (q @ k.transpose(-1, -2) / (D // 4) ** 0.5).masked_fill(~mask, float("-inf"))
    h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, D)
    torch.testing.assert_close(y, _mixed(attn.out_proj, h, rq))
    inp, memory = route_traces(aux)
    assert (inp.stream, memory.stream) == ("input", "memory") and inp.gate_id == memory.gate_id
    assert memory.experts.shape == (2, 6, 2) and inp.load is None


def test_moe_attention_losses_gradients_parameters_and_macs():
    attn = _moe_attn(True)
    aux = AuxOutputs()
    attn(torch.randn(2, 5, D), torch.randn(2, 6, D), aux=aux).sum().backward(retain_graph=True)
    assert attn.gate.w_gate.weight.grad.abs().sum() > 0
    (gate,) = routing_losses(aux).gates  # input and memory records: one gating unit
    assert gate.n_tokens == 22 and set(gate.terms) == {"importance", "load"}
    dmb = dmb_attention(D, 4, N)
    merge_shared_(dmb)

    def count(*mods):
        return sum(p.numel() for m in mods for p in m.parameters())

    projections = ("q_proj", "k_proj", "v_proj", "out_proj")
    assert count(*(getattr(attn, p) for p in projections)) == count(
        *(getattr(dmb, p) for p in projections))
    attn.eval()
    aux = AuxOutputs()
    with torch.no_grad(), _counter() as fc:
        attn(torch.randn(2, 5, D), torch.randn(2, 7, D), aux=aux)
    expected = attn.macs(10, 7, 14, cross=True)
    assert expected["q_proj"] == 2 * 10 * D * D and expected["k_proj"] == 2 * 14 * D * D
    assert expected["gate_kv"] == 14 * D * N
    assert realized_macs_by_layer(aux) == {"attention": expected}
    assert fc.get_total_flops() / 2 == sum(expected.values())
