"""The argument checks of the public API take numpy's integers and numbers as Python's (a
budget also a torch scalar: ``tests/tasks/test_translator_arguments.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from dynaseq.core.arguments import check_int, check_number
from dynaseq.core.errors import DynaseqError


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3)])
def test_an_integer_of_any_kind_is_an_int(value):
    got = check_int("beam", value)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("value", [True, np.bool_(True), 3.0, np.float32(3), "3", None])
def test_bools_floats_and_strings_are_not_integers(value):
    with pytest.raises(DynaseqError, match="beam must be an integer >= 1, got"):
        check_int("beam", value)


def test_a_number_of_any_kind_is_a_float():
    for value in (0.5, np.float32(0.5), np.float64(0.5)):
        got = check_number("temperature", value)
        assert got == 0.5 and type(got) is float
