"""The server's real ÷ predicted factors (``dynaseq.serve.scales``), alone and as the
batcher and the deadline policy use them per batch size."""

from __future__ import annotations

import pytest

from dynaseq.metrics.latency_table import LatencyTable
from dynaseq.serve.batcher import Batcher, Job
from dynaseq.serve.metrics import ServerMetrics
from dynaseq.serve.policy import DeadlinePolicy, Work
from dynaseq.serve.scales import BatchScales, FrozenScales, scale_at

FULL, HALF = (1.0, 1.0), (0.5, 0.5)


def test_size_classes_are_powers_of_two_of_the_lines():
    assert [BatchScales.size_class(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63)] == [
        1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    with pytest.raises(ValueError, match="at least one line"):
        BatchScales.size_class(0)


def test_one_factor_for_every_size_unless_by_size():
    s = BatchScales(by_size=False)
    for _ in range(10):
        s.update(2.0, rows=32)
    s.update(1.0, rows=1)
    assert s.at(1) == s.at(32) == s.overall.value == pytest.approx(0.8 * 2.0 + 0.2 * 1.0)
    assert s.frozen() == FrozenScales(s.overall.value)


def test_a_size_class_has_its_own_factor_once_it_has_enough_batches():
    s = BatchScales(by_size=True)
    for _ in range(s.CLASS_MIN):
        s.update(0.8, rows=32)  # big batches run under their prediction
    for _ in range(s.CLASS_MIN - 1):
        s.update(2.0, rows=3)  # small ones over it, but too few yet for their own
    overall = s.overall.value
    assert s.at(32) == s.at(40) == pytest.approx(0.8)  # class 6: 32-63 lines
    assert s.at(3) == s.at(2) == s.at(1) == s.at(16) == overall  # no own factor yet
    s.update(2.0, rows=2)
    assert s.at(3) == pytest.approx(2.0) and s.at(1) == s.overall.value
    frozen = s.frozen()
    assert [frozen(n) for n in (1, 2, 3, 16, 32)] == [s.at(n) for n in (1, 2, 3, 16, 32)]
    s.update(4.0, rows=32)  # the frozen copy does not move with the live factors
    assert frozen(32) == pytest.approx(0.8) != s.at(32)
    assert s.typical_at(32) == s.at(32)  # fewer than TYPICAL_MIN: the average
    # a continuous decode's line (rows None) moves the overall factor only
    before = s.at(32)
    s.update(3.0, rows=None)
    assert s.at(32) == before


def test_scale_at_reads_a_float_or_a_factor_per_size():
    assert scale_at(1.5, 7) == 1.5
    assert scale_at(FrozenScales(1.0, ((3, 2.0),)), 5) == 2.0
    assert scale_at(FrozenScales(1.0, ((3, 2.0),)), 8) == 1.0


def _policy() -> DeadlinePolicy:
    table = LatencyTable([FULL, HALF], [1, 32], [10, 20],
                         {"1,1": [[10.0, 20.0], [100.0, 200.0]],
                          "0.5,0.5": [[6.0, 12.0], [60.0, 120.0]]}, predict="grid")
    return DeadlinePolicy(table, [FULL, HALF], max_batch_rows=32, window_ms=0.0)


def test_predictions_scale_each_batch_at_its_own_size():
    """The queue ahead (a full batch) at the full batch's factor, the request's own batch
    (one line) at one line's: against the same predictions at one factor each."""
    p = _policy()
    f = FrozenScales(1.0, ((1, 3.0), (6, 0.5)))
    ahead = [Work(FULL, 32, 10)]
    got = p.predict_ms(FULL, 1, 10, ahead, scale=f)
    assert got == pytest.approx(0.5 * p.batch_ms(ahead) + 3.0 * p.predict_ms(FULL, 1, 10))
    works = [Work(HALF, 32, 10)]
    assert p.answer_ms(works, [10], f) == [pytest.approx(0.5 * p.answer_ms(works, [10])[0])]
    assert p.utilization(FULL, 100.0, 10, f) == pytest.approx(
        0.5 * p.utilization(FULL, 100.0, 10))
    # 15 ms left for one line at the smallest (6 ms): late at one line's factor (3x) only
    assert p.late([], [Work(FULL, 1, 10)], [15.0], f) == [True]
    assert p.late([], [Work(FULL, 1, 10)], [15.0], 1.0) == [False]


def test_the_batcher_records_each_batch_at_its_lines_and_plans_with_them():
    """Each batch's real ÷ estimated time goes to its size class (the lines that ran), and
    snapshots carry the factors per size (:attr:`Load.by_size`) only when asked to."""
    import asyncio

    seen = []

    def run(jobs):
        return [None for _ in jobs]

    async def go(by_size):
        b = Batcher(ServerMetrics(), window_ms=20, max_batch_rows=8, max_queue_rows=100,
                    estimate_ms=lambda jobs: 1e-3, scale_by_size=by_size)
        b._update_scale = lambda ratio, weight=0.2, rows=None: seen.append(rows)
        futs = [b.submit(Job(group="a", run=run, payload=None, rows=n, endpoint="t"))
                for n in (3, 2)]
        b.start()
        await asyncio.gather(*futs)
        b.stop()
        return b.snapshot().by_size

    assert asyncio.run(go(False)) is None
    assert seen == [5]  # one batch of 3 + 2 lines
    assert asyncio.run(go(True)) == BatchScales(True).frozen()


def test_a_batch_its_replan_emptied_leaves_a_snapshot_that_plans():
    """A batch whose every job its replan shed runs nothing; a request planned meanwhile
    against the factors per size still gets its snapshot (the empty batch counts as one
    line, not as a size class that does not exist)."""
    import asyncio

    from dynaseq.serve.batcher import Shed

    def shed_all(jobs, scale, behind):
        for j in jobs:
            j.shed = Shed("too late", 1)

    async def go():
        b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=8, max_queue_rows=100,
                    estimate_ms=lambda jobs: 5.0, scale_by_size=True)
        job = Job(group="a", run=lambda jobs: [None] * len(jobs), payload=None, rows=2,
                  endpoint="t", replan=shed_all)
        fut = b.submit(job)
        assert await asyncio.to_thread(b._take) == []
        load = b.snapshot()
        with pytest.raises(Shed):
            await fut
        return load

    load = asyncio.run(go())
    assert load.by_size is not None and load.running_ms is not None
