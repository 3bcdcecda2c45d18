import pytest
import torch
from torch import nn

from dynaseq.nn import AuxOutputs, FeedForward
from dynaseq.techniques.cct.layers import (
    ConditionalFeedForward,
    ControlNet,
    FeedForwardPiece,
    Gate,
    conditional_feedforward,
    force_gates,
)

D, F, M = 32, 64, 4


def _modes(ffn, x):
    ffn.eval()
    hard = ffn(x)
    ffn.train()
    soft = ffn(x)
    ffn.eval()
    return hard, soft


def test_all_gates_on_hard_equals_soft():
    torch.manual_seed(0)
    ffn = conditional_feedforward(D, F, M, control_hidden=16)
    x = torch.randn(2, 5, D)
    with force_gates(ffn, 1.0):
        hard, soft = _modes(ffn, x)
    torch.testing.assert_close(hard, soft)


def test_all_gates_on_without_norms_equals_the_dense_ffn_it_splits():
    torch.manual_seed(0)
    pieces = [FeedForwardPiece(FeedForward(D, F // M), nn.Identity(), nn.Identity())
              for _ in range(M)]
    ffn = ConditionalFeedForward(pieces, ControlNet(D, M, 16), Gate())
    dense = FeedForward(D, F)
    with torch.no_grad():  # the dense FFN whose hidden units are the pieces' side by side
        dense.fc1.weight.copy_(torch.cat([p.ffn.fc1.weight for p in pieces], 0))
        dense.fc1.bias.copy_(torch.cat([p.ffn.fc1.bias for p in pieces]))
        dense.fc2.weight.copy_(torch.cat([p.ffn.fc2.weight for p in pieces], 1))
        dense.fc2.bias.copy_(sum(p.ffn.fc2.bias for p in pieces))
    x = torch.randn(2, 5, D)
    with force_gates(ffn, 1.0):
        hard, soft = _modes(ffn, x)
    torch.testing.assert_close(hard, dense(x))
    torch.testing.assert_close(soft, dense(x))


def test_hand_set_pattern_hard_equals_soft_and_off_tokens_are_zero(steer):
    torch.manual_seed(0)
    ffn = conditional_feedforward(D, F, M, control_hidden=16)
    steer(ffn.control, [0, 1, 2, 3])
    on = torch.rand(2, 5, M) < 0.5
    on[0, 1] = False  # a token with every piece off
    x = torch.randn(2, 5, D)
    x[..., :M] = on.float() * 2 - 1
    aux = AuxOutputs()
    ffn.eval()
    hard = ffn(x, aux=aux)
    assert torch.equal(aux.traces["cct.gates"][0].values, on.float())
    _, soft = _modes(ffn, x)
    torch.testing.assert_close(hard, soft)
    assert torch.equal(hard[0, 1], torch.zeros(D))
    expected = sum(on[..., i, None] * p(x) for i, p in enumerate(ffn.pieces))
    torch.testing.assert_close(hard, expected)


@pytest.mark.parametrize("args, match", [
    ((D, 66, 4), "ffn_dim=66 is not divisible by n_pieces=4"),
    ((D, 64, 0), "n_pieces must be >= 1"),
])
def test_bad_split_raises(args, match):
    with pytest.raises(ValueError, match=match):
        conditional_feedforward(*args)


def test_control_gates_must_match_pieces():
    pieces = [FeedForwardPiece(FeedForward(D, 8), nn.Identity(), nn.Identity())]
    with pytest.raises(ValueError, match="2 gates for 1 pieces"):
        ConditionalFeedForward(pieces, ControlNet(D, 2), Gate())
