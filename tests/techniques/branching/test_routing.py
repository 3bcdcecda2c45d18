"""Router, token grouping, BranchedLinear: one branch per row, shared-private gradients, merge."""

import copy

import pytest
import torch
import torch.nn.functional as F

from dynaseq.techniques.branching import BranchedLinear, BranchGroups, Router, merge_shared_


def test_router_picks_the_argmax_of_the_softmax():
    torch.manual_seed(0)
    router = Router(8, n_branches=3)
    x = torch.randn(2, 5, 8)
    route = router(x)
    probs = torch.softmax(x @ router.proj.weight.T + router.proj.bias, -1)
    torch.testing.assert_close(route.probs, probs)
    assert torch.equal(route.branch, probs.argmax(-1))
    assert route.branch.shape == (2, 5) and route.logits.shape == (2, 5, 3)
    assert router.macs(10) == 10 * 8 * 3


def test_groups_sort_stably_and_scatter_back():
    branch = torch.tensor([2, 0, 2, 1, 0, 2])
    g = BranchGroups.of(branch, 4)
    assert g.sizes == [2, 1, 3, 0]
    assert g.order.tolist() == [1, 4, 3, 0, 2, 5]
    x = torch.arange(6.0)[:, None]
    assert g.gather(x)[:, 0].tolist() == [1, 4, 3, 0, 2, 5]
    assert torch.equal(g.scatter(g.gather(x)), x)


def test_branched_linear_applies_each_rows_branch(linear_rows):
    torch.manual_seed(0)
    lin = BranchedLinear(6, 5, n_branches=4)
    with torch.no_grad():
        lin.shared_weight.normal_()
        lin.shared_bias.normal_()
    x = torch.randn(3, 7, 6)
    branch = torch.randint(0, 4, (3, 7))
    y = lin(x, branch)
    w, b = lin.shared_weight + lin.weight, lin.shared_bias + lin.bias
    ref = torch.stack([F.linear(x[i, j], w[branch[i, j]], b[branch[i, j]])
                       for i in range(3) for j in range(7)]).view(3, 7, 5)
    torch.testing.assert_close(y, ref)
    # one matmul per branch over its own rows: 21 rows in total, not 4 * 21
    rows = linear_rows.rows((5, 6))[:4]
    assert rows == torch.bincount(branch.flatten(), minlength=4).tolist()
    assert lin.macs(21) == 21 * 6 * 5


def test_inference_runs_only_the_branches_that_have_rows(linear_rows):
    torch.manual_seed(0)
    lin = BranchedLinear(6, 5, n_branches=4)
    x = torch.randn(9, 6)
    with torch.no_grad():
        # one token (a greedy decoding step): no sort, no split, one matmul
        g = BranchGroups.of(torch.tensor([3]), 4)
        assert g.in_order and g.sizes == [0, 0, 0, 1]
        row = x[:1]
        assert g.gather(row) is row and g.scatter(row) is row
        y1 = lin(x[:1], torch.tensor([3]))
        assert linear_rows.calls == [((5, 6), 1)]
        torch.testing.assert_close(y1, F.linear(x[:1], lin.weight[3], lin.bias[3]))
        linear_rows.calls.clear()
        branch = torch.tensor([1, 3, 1, 1, 3, 3, 1, 1, 3])  # branches 0 and 2 empty
        y = lin(x, branch)
        assert linear_rows.calls == [((5, 6), 5), ((5, 6), 4)]
    with torch.enable_grad():
        torch.testing.assert_close(lin(x, branch), y)  # training path: every branch runs
    assert len(linear_rows.calls) == 2 + 4


def test_inference_runs_several_branches_as_one_grouped_matmul(linear_rows):
    """Widths that are multiples of 16 bytes take F.grouped_mm (each group against its own
    weight, bias added per row); other widths one F.linear per group: the same outputs."""
    torch.manual_seed(0)
    branch = torch.tensor([2, 0, 2, 2, 0, 3, 0, 2, 3, 0, 0])  # branch 1 empty
    for d_in, d_out, grouped in ((8, 12, True), (6, 12, False), (8, 5, False)):
        lin = BranchedLinear(d_in, d_out, n_branches=4)
        with torch.no_grad():
            lin.shared_weight.normal_()
            lin.shared_bias.normal_()
        x = torch.randn(11, d_in)
        w, b = lin.shared_weight + lin.weight, lin.shared_bias + lin.bias
        ref = torch.stack([F.linear(x[i], w[k], b[k]) for i, k in enumerate(branch.tolist())])
        linear_rows.calls.clear()
        linear_rows.grouped_calls = 0
        with torch.no_grad():
            y = lin(x, branch)
        torch.testing.assert_close(y, ref)
        assert linear_rows.grouped_calls == int(grouped)
        assert linear_rows.calls == [((d_out, d_in), 5), ((d_out, d_in), 4),
                                     ((d_out, d_in), 2)]  # the empty branch runs nothing


def test_inference_views_follow_parameter_updates():
    """The per-branch views kept for inference never serve stale weights."""
    torch.manual_seed(0)
    lin = BranchedLinear(6, 5, n_branches=4, shared=False)
    x, branch = torch.randn(9, 6), torch.tensor([1, 3, 1, 0, 3, 3, 1, 1, 3])

    def reference() -> torch.Tensor:
        return torch.stack([F.linear(x[i], lin.weight[k], lin.bias[k])
                            for i, k in enumerate(branch.tolist())])

    with torch.no_grad():
        torch.testing.assert_close(lin(x, branch), reference())
        other = BranchedLinear(6, 5, n_branches=4, shared=False)
        lin.load_state_dict(other.state_dict())  # in place
        torch.testing.assert_close(lin(x, branch), reference())
        lin.weight.data = torch.randn(4, 5, 6)  # new storage
        torch.testing.assert_close(lin(x, branch), reference())
        lin.bias.mul_(2.0)
        torch.testing.assert_close(lin(x[:1], branch[:1]), reference()[:1])


def test_groups_reject_ids_outside_the_branches():
    with pytest.raises(ValueError, match=r"\[0, 4\), got id 4"):
        BranchGroups.of(torch.tensor([0, 4]), 4)
    with pytest.raises(ValueError, match=r"got id -1"):
        BranchGroups.of(torch.tensor([0, -1]), 4)
    for bad in (-1, 4):  # the one-token path checks too
        with pytest.raises(ValueError, match=rf"got id {bad}"):
            BranchGroups.of(torch.tensor([bad]), 4)


def test_shared_part_gets_every_branchs_gradient_private_only_its_own():
    torch.manual_seed(0)
    lin = BranchedLinear(4, 3, n_branches=4)
    x = torch.randn(10, 4)
    branch = torch.tensor([0, 2, 2, 0, 2, 0, 0, 2, 2, 0])  # branches 1 and 3 get no rows
    lin(x, branch).square().sum().backward()
    gw, gb = lin.weight.grad, lin.bias.grad
    for k in (1, 3):  # unused: a zero gradient (not None: DDP sees every parameter used)
        assert torch.count_nonzero(gw[k]) == 0 and torch.count_nonzero(gb[k]) == 0
    for k in (0, 2):
        assert gw[k].abs().sum() > 0
        # θ_Pk's gradient comes from the rows of branch k only (eq. 23)
        w = (lin.shared_weight + lin.weight[k]).detach().requires_grad_()
        F.linear(x[branch == k], w, (lin.shared_bias + lin.bias[k]).detach()).square().sum() \
            .backward()
        torch.testing.assert_close(gw[k], w.grad)
    # θ_S collects the gradient of whichever branch ran, for every row (eq. 22)
    torch.testing.assert_close(lin.shared_weight.grad, gw.sum(0))
    torch.testing.assert_close(lin.shared_bias.grad, gb.sum(0))


def test_shared_starts_at_zero_and_merge_gives_identical_outputs():
    torch.manual_seed(0)
    lin = BranchedLinear(6, 5, n_branches=3)
    assert torch.count_nonzero(lin.shared_weight) == 0 and torch.count_nonzero(lin.shared_bias) == 0
    with torch.no_grad():  # as after training
        lin.shared_weight.normal_()
        lin.shared_bias.normal_()
    x, branch = torch.randn(4, 9, 6), torch.randint(0, 3, (4, 9))
    before = lin(x, branch)
    merged = copy.deepcopy(lin)
    assert merge_shared_(torch.nn.Sequential(merged)) == 1
    assert not merged.has_shared
    assert set(merged.state_dict()) == {"weight", "bias"}
    assert sum(p.numel() for p in merged.parameters()) == 3 * (6 * 5 + 5)
    assert torch.equal(merged(x, branch), before)
    assert merge_shared_(merged) == 0  # already merged: nothing to do


def test_without_shared_part():
    lin = BranchedLinear(4, 2, n_branches=2, shared=False, bias=False)
    assert not lin.has_shared and lin.bias is None
    assert [n for n, _ in lin.named_parameters()] == ["weight"]
    y = lin(torch.ones(3, 4), torch.tensor([0, 1, 1]))
    torch.testing.assert_close(y[0], lin.weight[0].sum(1).detach())


@pytest.mark.parametrize("make, match", [
    (lambda: Router(0), "d_model"),
    (lambda: Router(8, n_branches=0), "n_branches"),
    (lambda: BranchedLinear(0, 4), "in_features"),
    (lambda: BranchedLinear(4, 4, n_branches=0), "n_branches"),
    (lambda: BranchGroups.of(torch.tensor([0, 4]), 4), r"\[0, 4\)"),
    (lambda: BranchGroups.of(torch.tensor([0.0]), 4), "integer"),
    (lambda: BranchedLinear(4, 4)(torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long)),
     "must match"),
    (lambda: BranchedLinear(4, 4)(torch.randn(2, 5), torch.zeros(2, dtype=torch.long)),
     "width 5"),
])
def test_bad_arguments_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()
