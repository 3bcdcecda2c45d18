"""The continuous decode's deadline policy (serve/row_policy.py): exact completions and
decisions on a synthetic latency table, rows playing forward as lines free them."""

from __future__ import annotations

import pytest

from dynaseq.metrics.latency_table import LatencyTable
from dynaseq.serve.policy import Work
from dynaseq.serve.row_policy import RowPolicy

FULL, HALF, LOW = (1.0, 1.0), (0.5, 0.5), (0.2, 0.2)


def policy(**kw) -> RowPolicy:
    # batch 1 / 10 x length 10 / 20 -> ms, read as a grid: a line of 10 tokens holds its row
    # 10 ms (FULL) / 6 (HALF) alone, 50 / 30 in a decode of 10 rows
    table = LatencyTable([FULL, HALF], [1, 10], [10, 20],
                         {"1,1": [[10.0, 20.0], [50.0, 100.0]],
                          "0.5,0.5": [[6.0, 12.0], [30.0, 60.0]]}, predict="grid")
    return RowPolicy(table, [HALF, FULL], max_batch_rows=10, **kw)


def test_an_idle_decode_runs_a_line_at_once_at_one_row():
    p = policy()
    assert p.finish_ms(FULL, 1, 10) == (10.0, 0.0)
    assert p.finish_ms(HALF, 2, 10) == (pytest.approx(6 + 24 / 9), 0.0)  # 2 rows
    assert p.decide(100.0, 1, 10).budget == FULL


def test_lines_take_the_rows_that_free_up_first_in_queue_order():
    p = policy()
    full = [20.0] * 10  # every row busy for 20 ms more
    # the request's line takes the first row free, at 20, and holds it 50 ms
    assert p.finish_ms(FULL, 1, 10, rows_left=full) == (70.0, 20.0)
    # 10 queued lines ahead take every row at 20 until 70; at HALF they hold 30
    ahead = [Work(FULL, 10, 10)]
    assert p.finish_ms(FULL, 1, 10, ahead, full) == (120.0, 70.0)
    assert p.finish_ms(HALF, 1, 10, ahead, full) == (100.0, 70.0)
    flexible = [Work(FULL, 10, 10, flexible=True)]  # a deadline's: at the budget tried
    assert p.finish_ms(HALF, 1, 10, flexible, full) == (80.0, 50.0)
    # three lines of its own, rows free at 5, 10, 60: the third takes the row its first
    # frees at 55 and ends at 105; a scale stretches each line
    assert p.finish_ms(FULL, 3, 10, rows_left=[5.0, 10.0, 60.0] + [80.0] * 7) == (105.0, 5.0)
    assert p.finish_ms(FULL, 1, 10, rows_left=full, scale=2.0) == (120.0, 20.0)


def test_decide_degrades_before_it_refuses_and_keeps_the_margin_out_of_the_fallback():
    p = policy()
    full, ahead = [20.0] * 10, [Work(FULL, 10, 10)]
    d = p.decide(100.0, 1, 10, ahead, full)  # FULL 120 misses, HALF 100 makes it
    assert (d.budget, d.degraded, d.reject, d.predicted_ms) == (HALF, True, False, 100.0)
    assert p.decide(130.0, 1, 10, ahead, full).budget == FULL
    d = p.decide(50.0, 1, 10, ahead, full)  # even HALF ends at 100: 503
    assert d.reject and d.budget is None and d.retry_after_s == 1
    # with 10 ms of overhead, 10 of it margin: HALF predicted 110 > 100, but 100 without
    # the margin is within the deadline itself: admitted at the fastest
    d = p.decide(100.0, 1, 10, ahead, full, overhead_ms=10.0, margin_ms=10.0)
    assert (d.budget, d.reject) == (HALF, False)
    assert p.decide(95.0, 1, 10, ahead, full, overhead_ms=10.0, margin_ms=10.0).reject
    assert policy(overload="smallest").decide(50.0, 1, 10, ahead, full).budget == HALF
    assert policy(slack=0.5).decide(199.0, 1, 10, ahead, full).budget == HALF  # 120 > 99.5


def test_a_budget_predicted_no_faster_than_a_larger_one_is_never_chosen():
    table = LatencyTable([FULL, LOW], [1, 10], [10, 20],
                         {"1,1": [[10.0, 20.0], [50.0, 100.0]],
                          "0.2,0.2": [[11.0, 22.0], [55.0, 110.0]]}, predict="grid")
    p = RowPolicy(table, [FULL, LOW], max_batch_rows=10)
    d = p.decide(50.0, 1, 10, rows_left=[20.0] * 10)
    assert d.reject and d.predicted_ms == 70.0  # FULL's, the fastest
    assert p.row_budget(1, 10, 80.0, [20.0] * 10) == (FULL, 70.0)


def test_lines_waiting_for_a_row_take_the_rows_before_the_queue():
    p = policy()
    full = [20.0] * 10
    # two lines wait (40 ms each): they take the rows free at 20; the request's line the
    # next one at 20 too (ten rows free then)
    assert p.finish_ms(FULL, 1, 10, rows_left=full, waiting=[40.0, 40.0]) == (70.0, 20.0)
    # ten waiting lines take every row at 20 until 60: the request's starts at 60
    assert p.finish_ms(FULL, 1, 10, rows_left=full, waiting=[40.0] * 10) == (110.0, 60.0)
    d = p.decide(100.0, 1, 10, rows_left=full, waiting=[40.0] * 10)  # HALF: 90
    assert (d.budget, d.predicted_ms) == (HALF, 90.0)


def test_a_request_taken_off_the_queue_gets_the_largest_budget_that_fits():
    p = policy()
    full = [20.0] * 10
    assert p.row_budget(1, 10, 80.0, full) == (FULL, 70.0)
    assert p.row_budget(1, 10, 60.0, full) == (HALF, 50.0)
    assert p.row_budget(1, 10, 40.0, full) == (HALF, 50.0)  # none fits: the fastest
    assert p.row_budget(1, 10, 80.0, full, scale=1.5) == (HALF, 65.0)  # FULL 95
    assert p.row_budget(1, 10, 15.0) == (FULL, 10.0)  # an idle decode: one row, fast
    assert p.line_ms(FULL, 10) == 50.0  # default: every row


def test_near_saturation_only_the_smallest_budget_runs():
    p = policy()
    # a line holds one of 10 rows 50 ms at FULL (5 ms of the rows' time), 30 at HALF (3)
    assert p.utilization(FULL, 100.0, 10) == pytest.approx(0.5)
    assert p.row_budget(1, 10, 80.0, [20.0] * 10, arrival_rate=100.0,
                        max_utilization=0.6) == (FULL, 70.0)
    assert p.row_budget(1, 10, 80.0, [20.0] * 10, arrival_rate=150.0,
                        max_utilization=0.6) == (HALF, 50.0)  # FULL would be 0.75
    assert p.row_budget(1, 10, 80.0, [20.0] * 10, arrival_rate=150.0) == (FULL, 70.0)
    # priced at the arriving lines' mean length when given (20 tokens: FULL at 1.5)
    assert p.row_budget(1, 10, 80.0, [20.0] * 10, arrival_rate=100.0, max_utilization=0.6,
                        arrival_length=20) == (HALF, 50.0)
    assert p.row_budget(1, 20, 200.0, [20.0] * 10, arrival_rate=100.0,
                        max_utilization=0.6)[0] == HALF  # None: at its own length
    assert p.row_budget(1, 20, 200.0, [20.0] * 10, arrival_rate=100.0, max_utilization=0.6,
                        arrival_length=10)[0] == FULL
