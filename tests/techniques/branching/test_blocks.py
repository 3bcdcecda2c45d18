"""Tokens laid out in blocks by branch (``techniques/branching/blocks.py``): the layout of a
hand-worked routing, when blocks are refused, and outputs equal to the grouped layout's and
to each branch's own product for several routing patterns (the DMB lean encoder, which
lays its tokens out in blocks, is tested with the other lean parts)."""

from __future__ import annotations

import pytest
import torch

from dynaseq.techniques.branching.blocks import BlockDispatch, block_dispatch
from dynaseq.techniques.branching.branched_linear import BranchedLinear
from dynaseq.techniques.branching.routing import BranchGroups, Route, Router, Top1Dispatch

from helpers import count_ops


def decision(branch: list[int], n: int = 4) -> Route:
    b = torch.tensor(branch, dtype=torch.long)
    return Route(torch.nn.functional.one_hot(b, n).float(), b)


def test_a_hand_worked_routing_is_laid_out_in_padded_blocks():
    # counts per branch [2, 1, 3, 0]: P = 3; padding rows read token 0
    route = decision([2, 0, 2, 1, 0, 2])
    x = torch.arange(6.0)[:, None] * torch.ones(6, 2)
    laid = BlockDispatch.of(route, x, 4)
    assert laid is not None and laid.block_rows == 3
    assert laid.index.tolist() == [1, 4, 0, 3, 0, 0, 0, 2, 5, 0, 0, 0]
    assert laid.slot.tolist() == [6, 0, 7, 3, 1, 8]
    assert laid.input_rows()[:, 0].tolist() == [1, 4, 0, 3, 0, 0, 0, 2, 5, 0, 0, 0]
    assert torch.equal(laid.combine(laid.input_rows()), x)  # padding dropped, token order


def test_blocks_are_refused_for_one_branch_no_tokens_and_more_than_small_rows():
    x = torch.randn(100, 8)
    assert BlockDispatch.of(decision([1] * 10), x[:10], 4) is None  # one plain matmul
    assert BlockDispatch.of(decision([]), x[:0], 4) is None
    spread = [0, 1, 2, 3] * 25  # 4 x 25 rows for 100 tokens: no padding, but large
    assert BlockDispatch.of(decision(spread), x, 4) is None
    assert BlockDispatch.of(decision(spread), x, 4, small=100) is not None
    # a small call: blocks whatever the padding (9 + 1 tokens: 36 rows)
    assert BlockDispatch.of(decision([0] * 9 + [1]), x[:10], 4) is not None
    assert BlockDispatch.of(decision([0] * 9 + [1]), x[:10], 4, small=35) is None


PATTERNS = {"spread": lambda g: torch.randint(0, 4, (37,), generator=g),
            "two-branches": lambda g: torch.randint(1, 3, (37,), generator=g),
            "skewed-small": lambda g: torch.tensor([3] * 12 + [0, 1]),
            "every-branch-once": lambda g: torch.tensor([2, 0, 3, 1])}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_a_projection_in_blocks_equals_the_grouped_layout(pattern, shared, bias):
    g = torch.Generator().manual_seed(3)
    branch = PATTERNS[pattern](g)
    torch.manual_seed(4)
    proj = BranchedLinear(16, 24, 4, bias=bias, shared=shared).eval()
    if shared:
        with torch.no_grad():
            proj.shared_weight.normal_()
    x = torch.randn(branch.numel(), 16)
    route = Route(torch.zeros(branch.numel(), 4), branch)
    laid = BlockDispatch.of(route, x, 4, small=4 * branch.numel())  # whatever the size
    assert laid is not None
    grouped = Top1Dispatch.of(route, x, 4)
    with torch.no_grad():
        want = grouped.project(proj, grouped.input_rows())
        got = laid.project(proj, laid.input_rows())
        for k in range(4):  # and each token against its own branch, by hand
            weight, b = proj.branch_parameters()
            rows = branch == k
            ref = x[rows] @ weight[k].T + (0 if b is None else b[k])
            torch.testing.assert_close(got[rows], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_blocked_refuses_blocks_of_the_wrong_shape():
    proj = BranchedLinear(8, 8, 4)
    with pytest.raises(ValueError, match=r"blocks must be \(N=4, P, in\), got \(3, 2, 8\)"):
        proj.blocked(torch.randn(3, 2, 8))


def test_block_dispatch_keeps_the_grouped_layout_without_fast_paths_or_when_asked():
    torch.manual_seed(0)
    x = torch.randn(20, 8)
    spread = Router(8, 4)
    with torch.no_grad():
        spread.proj.weight.mul_(20)
    assert len(set(spread(x).branch.tolist())) > 1
    assert isinstance(block_dispatch(spread, x), BlockDispatch)
    assert isinstance(block_dispatch(spread, x, blocks=False), Top1Dispatch)
    spread.fast_paths = False
    assert isinstance(block_dispatch(spread, x), Top1Dispatch)


def test_a_refused_layout_counts_the_tokens_once_for_the_grouped_one():
    torch.manual_seed(0)
    router = Router(8, 4)
    x = torch.randn(200, 8)
    with torch.no_grad():
        router.proj.bias.copy_(torch.tensor([2.0, 0, 0, 0]))  # 150 of 200 tokens to branch 0
        route = router(x)
        assert torch.bincount(route.branch, minlength=4).tolist() == [150, 21, 17, 12]
        with count_ops() as ops:
            laid = block_dispatch(router, x)
    assert isinstance(laid, Top1Dispatch)
    assert ops.names.count("bincount.default") == 1
    own = BranchGroups.of(route.branch, 4)
    counts = torch.bincount(route.branch, minlength=4)
    given = BranchGroups.of(route.branch, 4, counts=(counts, counts.tolist()))
    assert given.sizes == own.sizes == [150, 21, 17, 12]
    assert torch.equal(given.order, own.order) and torch.equal(given.ends, own.ends)
    # the given counts are what it uses (no second count)
    wrong = torch.tensor([100, 50, 25, 25])
    assert BranchGroups.of(route.branch, 4, counts=(wrong, wrong.tolist())).sizes == [
        100, 50, 25, 25]


def test_int32_ids_and_batched_rows_lay_out_as_int64_ids_and_flat_rows():
    branch = torch.tensor([[2, 0, 2], [1, 0, 3]])  # (B, S)
    x = torch.randn(2, 3, 5)
    flat = BlockDispatch.of(Route(torch.zeros(6, 4), branch.reshape(-1)), x.reshape(6, 5), 4)
    ints = BlockDispatch.of(Route(torch.zeros(2, 3, 4), branch.int()), x, 4)
    assert flat is not None and ints is not None
    assert torch.equal(ints.index, flat.index) and torch.equal(ints.slot, flat.slot)
    assert torch.equal(ints.input_rows(), flat.input_rows())


def test_bfloat16_blocks_match_each_branchs_own_product():
    torch.manual_seed(5)
    proj = BranchedLinear(16, 32, 4, shared=False).to(torch.bfloat16).eval()
    blocks = torch.randn(4, 3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        got = proj.blocked(blocks)
        for k in range(4):
            want = torch.nn.functional.linear(blocks[k], proj.weight[k], proj.bias[k])
            torch.testing.assert_close(got[k], want, rtol=2e-2, atol=2e-2)


def test_an_int8_projection_is_refused_by_blocks_with_one_line():
    from dynaseq.techniques.branching.branched_linear import Int8BranchedLinear

    proj = Int8BranchedLinear.from_float(BranchedLinear(8, 8, 4).eval())
    laid = BlockDispatch.of(decision([0, 1, 2, 3]), torch.randn(4, 8), 4)
    with pytest.raises(TypeError, match="blocks run float BranchedLinear projections, got "
                                        "Int8BranchedLinear"):
        laid.run(proj, laid.input_rows())
