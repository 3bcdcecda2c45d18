import pytest
import torch
from torch import nn

from dynaseq.adaptive.cct import (
    ConditionalFeedForward,
    ControlNet,
    FeedForwardPiece,
    Gate,
    conditional_feedforward,
    force_gates,
)
from dynaseq.nn import AuxOutputs, FeedForward

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


@pytest.mark.parametrize("out_norms", [True, False])
def test_fused_all_on_tokens_equal_the_pieces_and_skip_them(steer, out_norms):
    """Tokens with every gate on take the folded pass (no piece module runs when all do);
    outputs equal the M pieces summed, with non-trivial LayerNorm affines folded in."""
    torch.manual_seed(0)
    ffn = conditional_feedforward(D, F, M, control_hidden=16, out_norms=out_norms)
    with torch.no_grad():
        for p in ffn.pieces:
            for norm in (p.in_norm, p.out_norm):
                for w in norm.parameters():
                    w.uniform_(-1.5, 1.5)
    steer(ffn.control, [0, 1, 2, 3])
    calls = []
    for p in ffn.pieces:
        p.register_forward_hook(lambda m, i, o: calls.append(i[0].size(0)))
    ffn.eval()
    x = torch.randn(2, 5, D)

    def reference(on):
        return sum(on[..., i, None] * p(x) for i, p in enumerate(ffn.pieces))

    on = torch.ones(2, 5, M, dtype=torch.bool)
    x[..., :M] = 1.0
    out = ffn(x)
    assert calls == []
    torch.testing.assert_close(out, reference(on), rtol=1e-5, atol=1e-5)
    on[0, 0] = False  # every gate off
    on[0, 1, 2] = on[1, 4, 0] = False  # partly on: those tokens go piece by piece
    x[..., :M] = on.float() * 2 - 1
    calls.clear()
    out = ffn(x)
    assert calls == [1, 2, 1, 2]  # pieces 0..3 ran on their partly-on tokens only
    assert torch.equal(out[0, 0], torch.zeros(D))
    torch.testing.assert_close(out, reference(on), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the folded weights follow a parameter change
        ffn.pieces[1].in_norm.bias.add_(0.5)
    torch.testing.assert_close(ffn(x), reference(on), rtol=1e-5, atol=1e-5)
