"""Layouts chosen by timing (:mod:`dynaseq.nn.layouts`): each layout tried in turn on a key's
first calls, then the one with the least median time, per key."""

from __future__ import annotations

import pytest

from dynaseq.nn.layouts import Layouts, call_key, rows_class

from helpers import clock_of


def test_rows_classes_are_one_two_then_powers_of_two():
    assert [rows_class(r) for r in (1, 2, 3, 4, 5, 8, 9, 30, 32, 33)] == [
        1, 2, 4, 4, 8, 8, 16, 32, 32, 64]
    assert call_key(3)[0] == 4


def test_each_layout_is_tried_in_turn_then_the_least_median_runs():
    # layout 1 has the least median (2.0) though layout 2 has the least single time (0.5)
    costs = [[3.0, 3.0, 3.0], [2.0, 9.0, 2.0], [0.5, 5.0, 5.0]]
    lay = Layouts(3, clock=clock_of(costs, 9))
    ran = [lay.trial("k", lambda i: i) for _ in range(9)]
    assert ran == [0, 1, 2] * 3
    assert lay.chosen == {"k": 1} and lay.settled


def test_keys_are_timed_apart_and_one_layout_needs_no_clock():
    lay = Layouts(2, clock=clock_of([[1.0] * 3, [2.0] * 3], 6))
    for _ in range(3):
        lay.trial("a", lambda i: i)
    assert not lay.settled and "a" not in lay.chosen  # 3 of 6 trials
    for _ in range(3):
        lay.trial("a", lambda i: i)
    assert lay.chosen == {"a": 0} and lay.settled

    def no_clock() -> float:
        raise AssertionError("one layout is never timed")

    one = Layouts(1, clock=no_clock)
    assert one.trial("b", lambda i, x: (i, x), "x") == (0, "x") and one.chosen == {"b": 0}


def test_no_layouts_is_refused():
    with pytest.raises(ValueError, match="at least one layout"):
        Layouts(0)
