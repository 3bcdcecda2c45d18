"""The lean step's wide projections (:class:`dynaseq.nn.lean_step.WideLinear`): the same map
as ``F.linear``, through an ``(in, out)`` copy for a few rows only, chosen by shape."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dynaseq.nn.lean_step import FEW_ROWS, WideLinear, float_linear, linear_fn


class _Products(TorchDispatchMode):
    """Records where the weight operand of every ``mm`` / ``addmm`` lives (its data pointer)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if name.startswith("addmm"):
            self.weights.append(args[2].data_ptr())
        elif name.startswith("mm"):
            self.weights.append(args[1].data_ptr())
        return func(*args, **(kwargs or {}))


def _wide(bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(48, 16, generator=gen), torch.randn(48, generator=gen) if bias else None


@pytest.mark.parametrize("shape", [(1, 16), (1, 1, 16), (4, 1, 16), (5, 16), (2, 7, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_f_linear_at_every_row_count_and_shape(shape, bias):
    weight, b = _wide(bias)
    x = torch.randn(*shape)
    y = WideLinear(weight, b)(x)
    assert y.shape == (*shape[:-1], 48)
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_few_rows_read_the_in_out_copy_and_more_rows_the_weight():
    weight, b = _wide()
    wide = WideLinear(weight, b)
    with _Products() as few:
        wide(torch.randn(FEW_ROWS, 1, 16))
    assert wide.weight_t is not None and wide.weight_t.shape == (16, 48)
    assert wide.weight_t.is_contiguous()  # Wᵀ stored (in, out)
    assert few.weights == [wide.weight_t.data_ptr()]
    with _Products() as many:
        wide(torch.randn(FEW_ROWS + 1, 1, 16))
    assert many.weights == [weight.data_ptr()]  # the (out, in) weight itself, no copy


def test_the_copy_is_made_once_and_only_when_few_rows_ask():
    weight, b = _wide()
    wide = WideLinear(weight, b)
    wide(torch.randn(32, 16))
    assert wide.weight_t is None  # many rows: no copy
    wide(torch.randn(1, 16))
    first = wide.weight_t
    wide(torch.randn(2, 16))
    assert wide.weight_t is first


def test_float_linear_takes_the_copy_for_wide_float32_cpu_weights_only():
    assert isinstance(float_linear(torch.randn(32, 16), None), WideLinear)  # out = 2·in
    narrow = float_linear(torch.randn(31, 16), torch.randn(31))
    assert isinstance(narrow, partial) and narrow.func is F.linear
    bf16 = float_linear(torch.randn(32, 16, dtype=torch.bfloat16), None)
    assert isinstance(bf16, partial) and bf16.func is F.linear
    fc1 = torch.nn.Linear(16, 64)
    assert isinstance(linear_fn(fc1), WideLinear)
    fc2 = torch.nn.Linear(64, 16)
    assert isinstance(linear_fn(fc2), partial)
