"""DMB feed-forward: one branch per token, gate trained only by the auxiliary losses, merge,
MACs (analytic, realized, FlopCounterMode), drop-in for FeedForward."""

import copy

import pytest
import torch
import torch.nn.functional as F

from dynaseq.metrics.macs import _counter
from dynaseq.nn import AuxOutputs, EncoderLayer, FeedForward, dense_attention
from dynaseq.techniques.branching import (
    BranchedFeedForward,
    BranchedLinear,
    Router,
    dmb_feedforward,
    merge_shared_,
    route_traces,
    routing_losses,
)
from dynaseq.techniques.cct.layers import realized_macs_by_layer

D, F_DIM, N = 16, 24, 4


def _reference(ffn, x, branch):
    """Token by token: the dense FFN of the token's branch (θ_S + θ_Pk)."""
    w1, b1 = ffn.fc1.branch_parameters()
    w2, b2 = ffn.fc2.branch_parameters()
    rows = [F.linear(F.linear(x[i, j], w1[k], b1[k]).relu(), w2[k], b2[k])
            for i in range(x.size(0)) for j in range(x.size(1))
            for k in [int(branch[i, j])]]
    return torch.stack(rows).view(x.shape)


def _randomize_shared(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("shared_weight", "shared_bias")):
                p.normal_(std=0.1)


def test_each_token_runs_exactly_its_branch(route_to, linear_rows):
    torch.manual_seed(0)
    ffn = dmb_feedforward(D, F_DIM, N)
    _randomize_shared(ffn)
    branch = torch.tensor([[0, 2, 2, 3, 0], [2, 2, 0, 3, 3]])  # branch 1 unused
    x = route_to(ffn.router, torch.randn(2, 5, D), branch)
    aux = AuxOutputs()
    y = ffn(x, aux=aux)
    # each matrix ran once per branch on that branch's tokens: 10 rows, not N * 10
    counts = [3, 0, 4, 3]
    assert linear_rows.rows((F_DIM, D)) == counts
    assert linear_rows.rows((D, F_DIM)) == counts
    assert linear_rows.rows((N, D)) == [10]  # the gate
    torch.testing.assert_close(y, _reference(ffn, x, branch))
    assert torch.equal(route_traces(aux)[0].branch, branch)


def test_flop_counter_sees_one_branch_plus_the_gate():
    torch.manual_seed(0)
    ffn = dmb_feedforward(D, F_DIM, N).eval()
    x = torch.randn(3, 7, D)
    aux = AuxOutputs()
    with torch.no_grad(), _counter() as fc:
        ffn(x, aux=aux)
    dense = FeedForward(D, F_DIM)
    expected = {**dense.macs(21), "gate_ffn": 21 * D * N}
    assert ffn.macs(21) == expected
    assert fc.get_total_flops() / 2 == sum(expected.values())
    assert realized_macs_by_layer(aux) == {"ffn": expected}


def test_gate_learns_only_through_the_auxiliary_losses():
    torch.manual_seed(0)
    ffn = dmb_feedforward(D, F_DIM, N)
    aux = AuxOutputs()
    ffn(torch.randn(2, 6, D), aux=aux).square().sum().backward()
    assert ffn.router.proj.weight.grad is None  # the task loss does not reach W_g
    assert ffn.fc1.shared_weight.grad.abs().sum() > 0
    routing_losses(aux).total.backward()
    assert ffn.router.proj.weight.grad.abs().sum() > 0
    assert ffn.router.proj.bias.grad.abs().sum() > 0


def test_merged_equals_unmerged_and_train_equals_eval_path():
    torch.manual_seed(0)
    ffn = dmb_feedforward(D, F_DIM, N)
    _randomize_shared(ffn)
    x = torch.randn(4, 9, D)
    train_out = ffn(x)
    ffn.eval()
    unmerged = ffn(x)
    assert torch.equal(train_out, unmerged)  # no dropout: training and inference alike
    merged = copy.deepcopy(ffn)
    assert merge_shared_(merged) == 2
    assert torch.equal(merged(x), unmerged)


def test_one_branch_without_shared_part_is_the_dense_ffn():
    torch.manual_seed(0)
    ffn = dmb_feedforward(D, F_DIM, 1, shared=False)
    dense = FeedForward(D, F_DIM)
    with torch.no_grad():
        dense.fc1.weight.copy_(ffn.fc1.weight[0])
        dense.fc2.weight.copy_(ffn.fc2.weight[0])
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(ffn(x), dense(x))


def test_drop_in_for_an_encoder_layer():
    torch.manual_seed(0)
    layer = EncoderLayer(D, dense_attention(D, 2), dmb_feedforward(D, F_DIM, N))
    aux = AuxOutputs()
    out = layer(torch.randn(2, 5, D), None, aux=aux)
    assert out.shape == (2, 5, D)
    assert [t.gate for t in route_traces(aux)] == ["ffn"]


@pytest.mark.parametrize("make, match", [
    (lambda: BranchedFeedForward(Router(D, 3), BranchedLinear(D, F_DIM, 4),
                                 BranchedLinear(F_DIM, D, 4)), "3 branches"),
    (lambda: BranchedFeedForward(Router(D, 4), BranchedLinear(D + 1, F_DIM, 4),
                                 BranchedLinear(F_DIM, D, 4)), "d_model=16"),
    (lambda: BranchedFeedForward(Router(D, 4), BranchedLinear(D, F_DIM, 4),
                                 BranchedLinear(F_DIM + 1, D, 4)), "fc2 reads"),
    (lambda: dmb_feedforward(D, F_DIM, 4, activation_dropout=1.0), "activation_dropout"),
    (lambda: dmb_feedforward(D, F_DIM, 0), "n_branches"),
])
def test_bad_arguments_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()
