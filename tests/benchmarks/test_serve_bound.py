"""benchmarks/serve_bound.py: the steady-cycle bound and the FIFO simulation, on a grid
table whose times are exact sums (one line of 10 tokens: 10 ms alone at the full budget,
a batch of n: 10 + (n - 1) 40/9 ms, 50 at 10 lines)."""

from __future__ import annotations

from dynaseq.metrics.latency_table import LatencyTable
from dynaseq.serve.policy import DeadlinePolicy

from helpers import load_benchmark

FULL, HALF = (1.0, 1.0), (0.5, 0.5)


def policy() -> DeadlinePolicy:
    table = LatencyTable([FULL, HALF], [1, 10], [10, 20],
                         {"1,1": [[10.0, 20.0], [50.0, 100.0]],
                          "0.5,0.5": [[6.0, 12.0], [30.0, 60.0]]}, predict="grid")
    return DeadlinePolicy(table, [FULL, HALF], max_batch_rows=10, early_answers=True)


def test_the_cycle_holds_the_lines_that_arrive_while_the_one_before_runs():
    sb, p = load_benchmark("serve_bound"), policy()
    assert sb.cycle_ms(p, FULL, 50.0, 10, 10) == 10.0  # under a line per batch time
    assert sb.cycle_ms(p, FULL, 200.0, 10, 10) == 50.0  # 10 lines in 50 ms: capacity
    assert sb.cycle_ms(p, FULL, 201.0, 10, 10) is None  # would need 11 lines a batch
    assert sb.cycle_ms(p, FULL, 180.0, 10, 10) is not None
    assert sb.cycle_ms(p, FULL, 50.0, 10, 10, scale=2.0) == 20.0  # every batch twice as long
    assert sb.cycle_ms(p, FULL, 101.0, 10, 10, scale=2.0) is None  # capacity halves: 100/s


def test_the_cycle_bound_is_the_fastest_rate_whose_two_batches_fit_the_deadline():
    sb, p = load_benchmark("serve_bound"), policy()
    # 2 T <= 100: T = 50, the full batch: the bound is the capacity, 200 lines a second
    assert 199.8 <= sb.cycle_bound_rps(p, FULL, 10, 10, 100.0, 0.0) <= 200.0
    # 2 T + 0 <= 60: five lines in 27.8 ms, six would take 32.2: 5 / 27.8 ms = 180 a second
    assert 179.5 <= sb.cycle_bound_rps(p, FULL, 10, 10, 60.0, 0.0) <= 180.05
    assert 179.5 <= sb.cycle_bound_rps(p, FULL, 10, 10, 65.0, 5.0) <= 180.05  # the window
    assert sb.cycle_bound_rps(p, FULL, 10, 10, 19.0, 0.0) == 0.0  # one line alone: 2 x 10
    assert sb.cycle_bound_rps(p, HALF, 10, 10, 60.0, 0.0) > 300  # a smaller budget: faster


def test_fifo_keeps_light_load_in_time_and_misses_most_lines_past_capacity():
    sb, p = load_benchmark("serve_bound"), policy()
    assert sb.fifo_in_time(p, FULL, [10], 1.0, 20.0, 0.0, 10, 100.0, seed=0) == 1.0
    # one line alone: 10 ms, or 20 at twice the table's time, against a 15 ms deadline
    assert sb.fifo_in_time(p, FULL, [10], 1.0, 20.0, 0.0, 10, 15.0, seed=0) == 1.0
    assert sb.fifo_in_time(p, FULL, [10], 1.0, 20.0, 0.0, 10, 15.0, seed=0, scale=2.0) == 0.0
    assert sb.fifo_in_time(p, FULL, [10, 20], 1000.0, 2.0, 0.0, 10, 100.0, seed=0) < 0.2
    a = sb.fifo_in_time(p, FULL, [10, 20], 150.0, 5.0, 5.0, 10, 100.0, seed=3)
    assert a == sb.fifo_in_time(p, FULL, [10, 20], 150.0, 5.0, 5.0, 10, 100.0, seed=3)
    assert a >= sb.fifo_in_time(p, FULL, [10, 20], 190.0, 5.0, 5.0, 10, 100.0, seed=3)
