"""The lean step's projections (:class:`dynaseq.nn.lean_step.StepLinear`): the same map as
``F.linear``, in the layout chosen by the call's rows and the projection's shape: one row of
a wide one against an ``(in, out)`` copy, 2 to LEFT_ROWS rows with the weight on the left,
otherwise ``F.linear``."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from dynaseq.nn.lean_step import LEFT_ROWS, StepLinear, float_linear, linear_fn

from helpers import AtenMode


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


@pytest.mark.parametrize("shape", [(1, 16), (1, 1, 16), (2, 16), (4, 1, 16), (LEFT_ROWS, 16),
                                   (LEFT_ROWS + 1, 16), (2, 7, 16), (2, 3, 16)])
@pytest.mark.parametrize("out", [48, 16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("always", [False, True])
def test_equals_f_linear_at_every_row_count_and_shape(shape, out, bias, always):
    weight, b = _weight(out, bias)
    x = torch.randn(*shape)
    y = StepLinear(weight, b, always=always)(x)
    assert y.shape == (*shape[:-1], out) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_a_wide_projection_reads_the_copy_at_one_row_the_weight_on_the_left_at_a_few():
    weight, b = _weight(48)
    fn = StepLinear(weight, b)
    assert fn.weight_t is None
    one = _products(fn, 1)
    assert fn.weight_t is not None and fn.weight_t.shape == (16, 48)
    assert fn.weight_t.is_contiguous() and one[0][1] == fn.weight_t.data_ptr()  # x Wᵀ
    for rows in (2, LEFT_ROWS):
        assert _products(fn, rows)[0][0] == weight.data_ptr()  # W xᵀ: W itself, on the left
    assert _products(fn, LEFT_ROWS + 1)[0][1] == weight.data_ptr()  # F.linear: a view of W


def test_a_square_projection_makes_no_copy():
    weight, b = _weight(16)
    fn = StepLinear(weight, b)
    assert _products(fn, 1)[0][1] == weight.data_ptr()  # F.linear
    assert _products(fn, 4)[0][0] == weight.data_ptr()  # on the left
    assert _products(fn, LEFT_ROWS + 1)[0][1] == weight.data_ptr()
    assert fn.weight_t is None


def test_always_reads_the_copy_but_at_a_few_rows():
    weight, _ = _weight(48, bias=False)
    fn = StepLinear(weight, None, always=True)
    assert _products(fn, LEFT_ROWS + 1)[0][1] == fn.weight_t.data_ptr()
    assert _products(fn, 1)[0][1] == fn.weight_t.data_ptr()
    assert _products(fn, 3)[0][0] == weight.data_ptr()


def test_the_copy_is_made_once_and_only_when_one_row_asks():
    weight, b = _weight(48)
    fn = StepLinear(weight, b)
    fn(torch.randn(32, 16))
    fn(torch.randn(4, 16))
    assert fn.weight_t is None  # many rows and a few: no copy
    fn(torch.randn(1, 16))
    first = fn.weight_t
    fn(torch.randn(1, 1, 16))
    assert fn.weight_t is first


def test_float_linear_takes_step_linear_for_float32_cpu_weights_as_wide_out_as_in():
    assert isinstance(float_linear(torch.randn(32, 16), None), StepLinear)
    assert isinstance(float_linear(torch.randn(16, 16), None), StepLinear)
    narrow = float_linear(torch.randn(15, 16), torch.randn(15))
    assert isinstance(narrow, partial) and narrow.func is F.linear
    bf16 = float_linear(torch.randn(32, 16, dtype=torch.bfloat16), None)
    assert isinstance(bf16, partial) and bf16.func is F.linear
    assert isinstance(linear_fn(torch.nn.Linear(16, 64)), StepLinear)
    assert isinstance(linear_fn(torch.nn.Linear(64, 16)), partial)
