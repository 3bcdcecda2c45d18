"""The lean step's projections (:class:`dynaseq.nn.lean_step.StepLinear`): the same map as
``F.linear`` in each of its layouts (``F.linear``, an ``(in, out)`` copy, the weight on the
left), the layout a size class's timed trials chose afterwards, and the copy kept only while
it is tried or chosen."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from dynaseq.nn.layouts import Layouts
from dynaseq.nn.lean_step import StepLinear, float_linear, linear_fn

from helpers import AtenMode, clock_of


class _Products(AtenMode):
    """Records ``(left, right)`` operand data pointers of every ``mm`` / ``addmm``."""

    def __init__(self) -> None:
        super().__init__()
        self.operands: list[tuple[int, int]] = []

    def seen(self, func, args, kwargs) -> None:
        name = func.__name__
        if name.startswith("addmm"):
            self.operands.append((args[1].data_ptr(), args[2].data_ptr()))
        elif name.startswith("mm"):
            self.operands.append((args[0].data_ptr(), args[1].data_ptr()))


def _weight(out: int = 48, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(out, 16, generator=gen), torch.randn(out, generator=gen) if bias else None


def _products(fn: StepLinear, rows: int) -> list[tuple[int, int]]:
    with _Products() as seen:
        fn(torch.randn(rows, 1, 16))
    return seen.operands


@pytest.mark.parametrize("shape", [(1, 16), (1, 1, 16), (2, 16), (4, 1, 16), (8, 16),
                                   (9, 16), (2, 7, 16), (2, 3, 16)])
@pytest.mark.parametrize("out", [48, 16, 8])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", [*StepLinear.LAYOUTS, None])
def test_equals_f_linear_in_every_layout_row_count_and_shape(shape, out, bias, layout):
    weight, b = _weight(out, bias)
    fn = StepLinear(weight, b, layout=layout)
    x = torch.randn(*shape)
    for _ in range(3 * Layouts.TRIALS + 1):  # unpinned: the trials, then the chosen one
        y = fn(x)
        assert y.shape == (*shape[:-1], out) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fastest", [0, 1, 2])
def test_the_trials_choose_the_fastest_layout_and_its_operands_run_after(fastest):
    weight, b = _weight(48)
    costs = [[5.0] * 3 for _ in range(3)]
    costs[fastest] = [1.0] * 3
    fn = StepLinear(weight, b, layouts=Layouts(3, clock=clock_of(costs, 9)))
    for _ in range(9):
        fn(torch.randn(4, 1, 16))
    assert fn.layouts.chosen == {(4, torch.get_num_threads()): fastest}
    left, right = _products(fn, 3)[0]  # 3 rows: the class of 4, no more trials
    if fastest == 1:
        assert fn.weight_t is not None and right == fn.weight_t.data_ptr()  # x @ Wᵀ copy
    else:
        assert fn.weight_t is None  # dropped: no class reads it
        assert (left if fastest == 2 else right) == weight.data_ptr()  # W xᵀ / F.linear


def test_a_new_size_class_is_timed_anew():
    weight, b = _weight(48)
    fn = StepLinear(weight, b, layouts=Layouts(3, clock=clock_of([[1.0] * 6, [2.0] * 6,
                                                                 [3.0] * 6], 18)))
    for rows in (1, 32):
        for _ in range(9):
            fn(torch.randn(rows, 16))
    threads = torch.get_num_threads()
    assert fn.layouts.chosen == {(1, threads): 0, (32, threads): 0}


def test_a_weight_off_float32_cpu_runs_f_linear_only_and_copies_nothing():
    weight = torch.randn(48, 16, dtype=torch.bfloat16)
    fn = StepLinear(weight, None)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    for _ in range(4):
        torch.testing.assert_close(fn(x), F.linear(x, weight))
    assert fn.weight_t is None and fn.layouts.chosen == {}


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="layout must be one of"):
        StepLinear(torch.randn(4, 4), None, layout="diagonal")


def test_float_linear_takes_step_linear_for_float32_cpu_weights():
    assert isinstance(float_linear(torch.randn(32, 16), None), StepLinear)
    assert isinstance(float_linear(torch.randn(15, 16), torch.randn(15)), StepLinear)
    bf16 = float_linear(torch.randn(32, 16, dtype=torch.bfloat16), None)
    assert isinstance(bf16, partial) and bf16.func is F.linear
    assert isinstance(linear_fn(torch.nn.Linear(16, 64)), StepLinear)
    assert isinstance(linear_fn(torch.nn.Linear(64, 16)), StepLinear)
