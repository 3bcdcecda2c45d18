"""Hebbian softmax (Rae et al. 2018): hand-computed updates, counts, smoothing limit,
adaptive-softmax clusters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dynaseq.core.errors import DynaseqError
from dynaseq.nn.adaptive_io import AdaptiveSoftmax
from dynaseq.nn.hebbian import HebbianSoftmax, adaptive_hebbian_update_, make_adaptive_hebbian


def test_hand_computed_update():
    w = torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 3.0], [4.0, 4.0]])
    hebb = HebbianSoftmax(4, gamma=0.3, max_count=20)
    hebb.counts[2] = 1  # word 2 was seen once before
    h = torch.tensor([[2.0, 4.0], [4.0, 0.0], [1.0, 1.0]])
    y = torch.tensor([0, 0, 2])
    updated = hebb.update_(w, h, y)

    assert updated.tolist() == [True, False, True, False]
    # word 0: first seen twice -> c = 2, λ = max(1/2, 0.3) = 0.5, h̄ = (3, 2)
    # word 2: c = 1 + 1 = 2, λ = 0.5, h̄ = (1, 1)
    expected = torch.tensor([[0.5 * 1 + 0.5 * 3, 0.5 * 1 + 0.5 * 2],
                             [2.0, 0.0],
                             [0.5 * 0 + 0.5 * 1, 0.5 * 3 + 0.5 * 1],
                             [4.0, 4.0]])
    torch.testing.assert_close(w, expected)
    assert hebb.counts.tolist() == [2, 0, 2, 0]

    # first ever sighting writes the activation outright (λ = 1/1)
    hebb.update_(w, torch.tensor([[7.0, -7.0]]), torch.tensor([1]))
    torch.testing.assert_close(w[1], torch.tensor([7.0, -7.0]))
    # the floor: word 0 at c = 12 -> λ = max(1/12, 0.3) = 0.3
    hebb.counts[0] = 11
    before = w[0].clone()
    hebb.update_(w, torch.tensor([[10.0, 0.0]]), torch.tensor([0]))
    torch.testing.assert_close(w[0], 0.7 * before + 0.3 * torch.tensor([10.0, 0.0]))


def test_running_mean_of_single_sightings():
    torch.manual_seed(0)
    hebb = HebbianSoftmax(3, gamma=1e-6, max_count=100)
    w = torch.randn(3, 5)
    hs = torch.randn(6, 5)
    for h in hs:
        hebb.update_(w, h[None], torch.tensor([1]))
    torch.testing.assert_close(w[1], hs.mean(0))
    assert hebb.counts.tolist() == [0, 6, 0]


def test_unseen_rows_and_rows_past_limit_unchanged():
    torch.manual_seed(0)
    hebb = HebbianSoftmax(5, gamma=0.01, max_count=3)
    w = torch.randn(5, 4)
    hebb.counts.copy_(torch.tensor([0, 3, 2, 7, 0]))
    before = w.clone()
    y = torch.tensor([1, 2, 2, 3, -100])  # -100: padding, ignored
    updated = hebb.update_(w, torch.randn(5, 4), y)
    assert updated.tolist() == [False, False, True, False, False]
    for row in (0, 1, 3, 4):  # unseen (0, 4) or past T (1, 3): SGD only
        assert torch.equal(w[row], before[row])
    assert not torch.equal(w[2], before[2])
    assert hebb.counts.tolist() == [0, 4, 4, 8, 0]  # counts still grow past T


def test_parameter_row_slice_and_dtype():
    lin = nn.Linear(3, 6, bias=False)
    lin.weight.data = lin.weight.data.to(torch.bfloat16)
    hebb = HebbianSoftmax(4)
    before = lin.weight.detach().clone()
    hebb.update_(lin.weight[:4], torch.ones(1, 3), torch.tensor([2]))
    assert torch.equal(lin.weight[2].detach(), torch.ones(3, dtype=torch.bfloat16))
    assert torch.equal(lin.weight[[0, 1, 3, 4, 5]].detach(), before[[0, 1, 3, 4, 5]])
    assert lin.weight.dtype == torch.bfloat16 and lin.weight.requires_grad
    assert "counts" in hebb.state_dict()


def test_match_norm_rescales_hidden():
    w = torch.tensor([[3.0, 4.0]])  # norm 5
    hebb = HebbianSoftmax(1, gamma=0.01, max_count=10, match_norm=True)
    hebb.update_(w, torch.tensor([[0.0, 2.0]]), torch.tensor([0]))
    torch.testing.assert_close(w[0], torch.tensor([0.0, 5.0]))


def test_validation():
    for kwargs in (dict(num_rows=0), dict(num_rows=3, gamma=0.0), dict(num_rows=3, gamma=1.5),
                   dict(num_rows=3, max_count=0)):
        with pytest.raises(DynaseqError):
            HebbianSoftmax(**kwargs)
    hebb = HebbianSoftmax(3)
    w = torch.zeros(3, 2)
    with pytest.raises(DynaseqError):
        hebb.update_(torch.zeros(4, 2), torch.zeros(1, 2), torch.tensor([0]))
    with pytest.raises(DynaseqError):
        hebb.update_(w, torch.zeros(1, 3), torch.tensor([0]))
    with pytest.raises(DynaseqError):
        hebb.update_(w, torch.zeros(2, 2), torch.tensor([0]))
    with pytest.raises(DynaseqError):
        hebb.update_(w, torch.zeros(1, 2), torch.tensor([3]))
    with pytest.raises(DynaseqError):
        hebb.update_(w, torch.zeros(1, 2), torch.tensor([0.0]))


def test_adaptive_softmax_per_cluster():
    torch.manual_seed(0)
    d, V, cutoffs = 8, 20, [6, 12]
    sm = AdaptiveSoftmax(d, V, cutoffs, dims=[8, 4, 2])
    states = make_adaptive_hebbian(sm, gamma=0.01, max_count=500)
    assert [s.num_rows for s in states] == [6, 6, 8]
    head0 = sm.head.weight.detach().clone()
    outs0 = [t[1].weight.detach().clone() for t in sm.tails]
    h = torch.randn(5, d)
    y = torch.tensor([2, 2, 7, 13, 19])
    adaptive_hebbian_update_(sm, h, y, states)

    head = sm.head.weight.detach()
    # two sightings in the first batch: c = 2, λ = 1/2
    torch.testing.assert_close(head[2], 0.5 * head0[2] + 0.5 * h[:2].mean(0))
    keep = [i for i in range(8) if i != 2]  # other words and the 2 cluster logits
    assert torch.equal(head[keep], head0[keep])
    with torch.no_grad():
        p0 = sm.tails[0][0](h[2:3])
        p1 = sm.tails[1][0](h[3:5])
    out0, out1 = sm.tails[0][1].weight.detach(), sm.tails[1][1].weight.detach()
    torch.testing.assert_close(out0[7 - 6], p0[0])
    torch.testing.assert_close(out1[13 - 12], p1[0])
    torch.testing.assert_close(out1[19 - 12], p1[1])
    changed0 = {7 - 6}
    changed1 = {13 - 12, 19 - 12}
    for r in range(6):
        if r not in changed0:
            assert torch.equal(out0[r], outs0[0][r])
    for r in range(8):
        if r not in changed1:
            assert torch.equal(out1[r], outs0[1][r])
    assert states[0].counts[2] == 2 and states[1].counts[1] == 1 and states[2].counts[7] == 1
    assert sm.tails[0][0].weight.requires_grad  # parameters stay trainable

    # still trains with an optimizer afterwards
    opt = torch.optim.SGD(sm.parameters(), lr=0.1)
    (-sm(h, y).mean()).backward()
    opt.step()
    adaptive_hebbian_update_(sm, h, y, states)
    assert states[0].counts[2] == 4


def test_adaptive_hebbian_with_stand_in_module():
    class StandIn(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 3 + 1, bias=False)
            self.tails = nn.ModuleList([nn.Sequential(nn.Linear(4, 2, bias=False),
                                                      nn.Linear(2, 5, bias=False))])
            self.cutoffs = [3, 8]  # torch-style: V at the end

    m = StandIn()
    states = make_adaptive_hebbian(m)
    h = torch.randn(2, 4)
    adaptive_hebbian_update_(m, h, torch.tensor([1, 6]), states)
    torch.testing.assert_close(m.head.weight[1].detach(), h[0])
    with torch.no_grad():
        torch.testing.assert_close(m.tails[0][1].weight[3], m.tails[0][0](h[1:2])[0])
    with pytest.raises(DynaseqError):
        adaptive_hebbian_update_(m, h, torch.tensor([1, 6]), states[:1])
