"""The batcher alone (no model): what shares a batch, limits, a raising batch, draining."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import time

import pytest

from dynaseq.serve.batcher import Batcher, Job, QueueFull, Shed
from dynaseq.serve.metrics import ServerMetrics


def make_job(group, rows, batches, budget=(1.0, 1.0), fail=False, gate=None):
    def run(jobs):
        if gate is not None:
            gate.wait(5)
        batches.append([(j.payload, j.rows, j.budget) for j in jobs])
        if fail:
            raise RuntimeError("boom")
        return [j.payload for j in jobs]

    return Job(group=group, run=run, payload=f"{group}{len(batches)}-{rows}-{budget[0]}",
               rows=rows, budget=budget, endpoint="t")


def test_same_group_jobs_share_a_batch_whatever_their_budgets():
    async def go():
        batches = []
        b = Batcher(ServerMetrics(), window_ms=100, max_batch_rows=5, max_queue_rows=100)
        jobs = [make_job("a", 2, batches, (1.0, 1.0)), make_job("b", 1, batches),
                make_job("a", 2, batches, (0.5, 0.5)), make_job("a", 2, batches, (1.0, 0.33))]
        futs = [b.submit(j) for j in jobs]
        b.start()
        results = await asyncio.gather(*futs)
        b.stop()
        return batches, results, jobs

    batches, results, jobs = asyncio.run(go())
    assert results == [j.payload for j in jobs]
    # group a: 2 + 2 lines (5 max: the third job of 2 lines waits), then group b, then a
    assert [[rows for _, rows, _ in batch] for batch in batches] == [[2, 2], [1], [2]]
    assert {budget for _, _, budget in batches[0]} == {(1.0, 1.0), (0.5, 0.5)}
    assert jobs[0].batch_rows == 4 and jobs[3].batch_rows == 2


def _batches_of(budgets, max_rows, by_budget=True, due_at=()):
    """One-line jobs at ``(b, b)`` for each b of ``budgets``, ``due_at``'s carrying a
    deadline, all submitted before the worker starts (the whole queue is there when the
    first batch forms): the budgets of each batch in the order they ran, and the jobs."""
    ran = []
    jobs = [make_job("a", 1, ran, (b, b)) for b in budgets]
    for i, job in enumerate(jobs):
        job.payload = f"{i}"
        if i in due_at:
            job.due = time.perf_counter() + 60

    async def go():
        b = Batcher(ServerMetrics(), window_ms=100, max_batch_rows=max_rows,
                    max_queue_rows=100, by_budget=by_budget)
        futs = [b.submit(j) for j in jobs]
        b.start()
        results = await asyncio.gather(*futs)
        b.stop()
        return results

    assert asyncio.run(go()) == [j.payload for j in jobs]
    return [[budget[0] for _, _, budget in batch] for batch in ran], jobs


def test_a_deep_queue_runs_single_budget_batches_a_shallow_one_mixes():
    alternating = [1.0, 0.2] * 5
    assert _batches_of(alternating, 4)[0] == [
        [1.0] * 4, [0.2] * 4, [1.0, 0.2]]  # the last two fit in one batch: mixed
    assert _batches_of(alternating, 4, by_budget=False)[0] == [
        [1.0, 0.2] * 2, [1.0, 0.2] * 2, [1.0, 0.2]]
    # the oldest job's budget makes less than half a batch: arrival order
    assert _batches_of([1.0] + [0.2] * 5, 4)[0] == [[1.0, 0.2, 0.2, 0.2], [0.2, 0.2]]


def test_nothing_behind_a_deadline_job_runs_before_it():
    batches, jobs = _batches_of([1.0, 1.0, 0.2, 0.2, 1.0, 1.0, 1.0], 4, due_at=(4,))
    # 1.0 x2 ahead of the deadline job make half a batch; the 1.0s behind it wait for it
    assert batches == [[1.0, 1.0], [0.2, 0.2], [1.0, 1.0, 1.0]]
    assert [j.batch_rows for j in jobs] == [2, 2, 2, 2, 3, 3, 3]
    # a batch headed by a deadline job keeps arrival order
    batches, _ = _batches_of([1.0, 0.2, 1.0, 0.2, 1.0, 0.2], 4, due_at=(0,))
    assert batches == [[1.0, 0.2, 1.0, 0.2], [1.0, 0.2]]


def test_queue_limit_raising_batch_and_drain():
    async def go():
        batches, gate = [], threading.Event()
        b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=4)
        b.start()
        first = b.submit(make_job("a", 1, batches, gate=gate))  # holds the worker
        await asyncio.sleep(0.05)
        bad = b.submit(make_job("a", 2, batches, fail=True))
        ok = b.submit(make_job("b", 2, batches))
        with pytest.raises(QueueFull, match="4 lines are queued"):
            b.submit(make_job("c", 1, batches))
        gate.set()
        stopper = asyncio.get_running_loop().run_in_executor(None, b.stop)  # drains
        assert await first == "a0-1-1.0"
        with pytest.raises(RuntimeError, match="boom"):
            await bad
        assert await ok == "b0-2-1.0"
        await stopper
        with pytest.raises(QueueFull, match="shutting down"):
            b.submit(make_job("a", 1, batches))
        return b

    b = asyncio.run(go())
    assert b.metrics.batch_failures.labels("t")._value.get() == 1
    assert not b.alive


def test_measured_overhead_is_a_high_quantile_of_late_answers_and_decays():
    b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=4)
    b.admission.tau_s = 0.05
    for late in range(100):  # 0 .. 99 ms late
        b.observe(predicted_ms=10.0, latency_ms=10.0 + late)
    assert 90 < b.overhead_ms <= 95  # the 95% quantile
    assert b.snapshot().overhead_ms == pytest.approx(b.overhead_ms, rel=0.1)
    time.sleep(0.3)  # six time constants without an answer
    assert b.overhead_ms < 1.0
    for _ in range(b.admission.window):  # the old errors leave the window
        b.observe(predicted_ms=50.0, latency_ms=10.0)  # early answers count 0, not less
    assert b.overhead_ms == 0.0
    b.admission.window = 10
    b.observe(predicted_ms=0.0, latency_ms=30.0)
    assert len(b.admission.errors) == 10


def test_formation_errors_have_their_own_margin():
    """Answers late against the prediction made as their batch was formed feed
    :attr:`Batcher.formation_ms`, not the admission margin, and vice versa."""
    b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=4)
    for late in range(100):
        b.observe_formed(float(late))
    assert 90 < b.formation_ms <= 95 and b.overhead_ms == 0.0
    for _ in range(b.formation.window):
        b.observe_formed(-5.0)  # early counts 0
        b.observe(predicted_ms=10.0, latency_ms=30.0)
    assert b.formation_ms == 0.0 and b.overhead_ms == pytest.approx(20.0, rel=0.01)


def test_share_above_a_slack_equals_counting_the_decayed_errors():
    """:meth:`LateAnswers.share_above`, read by bisection from the ranks kept at each
    ``add``, is the share that counting every decayed error above the slack gives."""
    import math
    import random

    from dynaseq.serve.batcher import LateAnswers, _decayed

    rng = random.Random(3)
    errors = LateAnswers(0.95, window=50, tau_s=0.05)
    assert errors.share_above(5.0, time.perf_counter()) == 0.0  # nothing observed
    for i in range(200):
        errors.add(0.0 if rng.random() < 0.2 else rng.expovariate(1 / 20) - 5,
                   time.perf_counter())
        if i % 9 == 0:
            time.sleep(0.003)
        now = time.perf_counter()
        for slack in (-1.0, 0.0, 0.5, 3.0, 10.0, 30.0, 80.0):
            want = 1.0 if slack < 0 else sum(
                _decayed(e, when, errors.tau_s, now) > slack
                for _, e, when in errors.errors) / len(errors.errors)
            assert math.isclose(errors.share_above(slack, now), want), (i, slack)


def test_overhead_quantile_ranked_on_arrival_equals_sorting_the_decayed_errors():
    """Errors observed at different times, sizes and orders (zeros and a window that
    drops the oldest included): the quantile read from the ranks kept at each ``observe``
    is the one that sorting every decayed error at the moment of reading gives."""
    import math
    import random

    from dynaseq.serve.batcher import _decayed

    rng = random.Random(7)
    b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=4)
    b.admission.tau_s, b.admission.window = 0.02, 37
    for i in range(300):
        late = 0.0 if rng.random() < 0.2 else rng.expovariate(1 / 20)
        b.observe(predicted_ms=10.0, latency_ms=10.0 + late)
        if i % 7 == 0:
            time.sleep(rng.random() * 0.01)
        now = time.perf_counter()
        brute = sorted(_decayed(e, when, 0.02, now) for _, e, when in b.admission.errors)
        want = brute[min(len(brute) - 1, int(b.OVERHEAD_QUANTILE * len(brute)))]
        assert math.isclose(b.overhead_at(now), want, rel_tol=1e-9, abs_tol=1e-12), i
        assert len(b.admission.ranked) == len(b.admission.errors) == min(i + 1, 37)


def test_arrival_rate_follows_submitted_lines():
    async def go() -> Batcher:
        b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=1000)
        b.ARRIVAL_TAU_S = 0.5
        for _ in range(100):  # 2 lines every 10 ms: 200 lines/s
            b.submit(make_job("a", 2, []))
            await asyncio.sleep(0.01)
        return b

    b = asyncio.run(go())
    assert 100 < b.arrival_rate < 260  # asyncio.sleep runs late, not early
    time.sleep(1.5)
    assert b.arrival_rate < 15


def test_arrival_length_is_the_decayed_mean_of_the_submitted_lines():
    """Each line weighs exp(-age / tau), as in :attr:`Batcher.arrival_rate`; a job's lines
    count at its length."""
    jobs = []

    async def go() -> Batcher:
        b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=1000)
        b.ARRIVAL_TAU_S = 0.1
        assert b.arrival_length == 1  # nothing submitted yet
        for rows, length, pause in [(3, 40, 0.15), (1, 10, 0.0), (2, 25, 0.0)]:
            job = make_job("a", rows, [])
            job.length = length
            b.submit(job)
            jobs.append(job)
            await asyncio.sleep(pause)
        return b

    b = asyncio.run(go())
    last = jobs[-1].enqueued
    weights = [j.rows * math.exp(-(last - j.enqueued) / b.ARRIVAL_TAU_S) for j in jobs]
    mean = sum(w * j.length for w, j in zip(weights, jobs, strict=True)) / sum(weights)
    assert 19 < mean < 25.5  # the 40-token lines have decayed (late sleeps: toward 20-25)
    assert b.arrival_length == round(mean)
    time.sleep(0.3)  # both sums decay alike: the mean stays
    assert b.arrival_length == round(mean)


def test_a_batch_is_replanned_before_it_runs():
    """The first job's ``replan`` sees the whole batch (and the scale) before ``run``, and
    the budgets it sets are those the batch runs at."""
    seen = []

    def replan(jobs, scale, behind):
        seen.append(([j.rows for j in jobs], scale, [j.rows for j in behind]))
        for j in jobs:
            j.budget = (0.5, 0.5)

    async def go():
        batches = []
        b = Batcher(ServerMetrics(), window_ms=50, max_batch_rows=8, max_queue_rows=100)
        jobs = [make_job("a", n, batches) for n in (1, 2, 3, 4)]
        jobs[1].replan = replan  # the first job with a replan (a deadline) plans the batch
        futs = [b.submit(j) for j in jobs]
        b.start()
        await asyncio.gather(*futs)
        b.stop()
        return batches

    batches = asyncio.run(go())
    assert seen == [([1, 2, 3], 1.0, [4])]  # the 4 lines wait for the next batch
    assert [[budget for _, _, budget in batch] for batch in batches][0] == [(0.5, 0.5)] * 3


def test_the_scale_follows_the_first_batches_at_once_then_moves_slowly():
    b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=4)
    b._update_scale(2.0)  # the first batch sets it
    assert b.scale == 2.0
    b._update_scale(3.0)  # the second: their mean
    assert b.scale == 2.5
    for _ in range(10):
        b._update_scale(2.5)
    b._update_scale(1.5)  # later: weight SCALE_WEIGHT
    assert b.scale == pytest.approx(2.5 - b.SCALE_WEIGHT)
    b._update_scale(100.0)
    assert b.scale == b.SCALE_RANGE[1]  # clamped


def test_jobs_shed_by_replan_get_their_exception_and_the_rest_run():
    """A job ``replan`` marks ``shed`` does not run: its future gets the :class:`Shed`;
    the batch runs without it (and a batch left empty runs nothing)."""
    def replan(jobs, scale, behind):
        for j in jobs:
            if j.rows == 2:
                j.shed = Shed("too late", 3)

    async def go():
        batches = []
        b = Batcher(ServerMetrics(), window_ms=50, max_batch_rows=8, max_queue_rows=100)
        jobs = [make_job("a", n, batches) for n in (1, 2, 3)]
        jobs[0].replan = replan
        lone = make_job("b", 2, batches)
        lone.replan = replan
        futs = [b.submit(j) for j in [*jobs, lone]]
        b.start()
        out = await asyncio.gather(*futs, return_exceptions=True)
        b.stop()
        return batches, out

    batches, out = asyncio.run(go())
    assert [[rows for _, rows, _ in batch] for batch in batches] == [[1, 3]]
    assert isinstance(out[1], Shed) and out[1].retry_after_s == 3
    assert isinstance(out[3], Shed)
    assert out[0] == batches[0][0][0] and out[2] == batches[0][1][0]


def test_a_replan_that_raises_fails_its_batch_and_the_next_batch_runs():
    """An exception in ``replan`` (a planning fault) goes to that batch's jobs, counted as
    a failed batch; the worker lives on and runs the next batch (it used to die, and the
    server then answered nothing)."""
    def replan(jobs, scale, behind):
        raise NameError("a planning bug")

    async def go():
        batches = []
        b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=8, max_queue_rows=100)
        bad = make_job("a", 2, batches)
        bad.replan = replan
        futs = [b.submit(j) for j in (bad, make_job("b", 1, batches))]
        b.start()
        out = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 10)
        after = await asyncio.wait_for(b.submit(make_job("a", 3, batches)), 10)
        alive = b.alive
        b.stop()
        return b, batches, out, after, alive

    b, batches, out, after, alive = asyncio.run(go())
    assert isinstance(out[0], NameError) and out[1] == "b0-1-1.0"
    assert after == "a1-3-1.0" and alive
    assert [[rows for _, rows, _ in batch] for batch in batches] == [[1], [3]]
    assert b.metrics.batch_failures.labels("t")._value.get() == 1


def test_a_job_its_run_marks_shed_gets_the_exception_and_the_rest_their_results():
    """``run`` may mark a job ``shed`` (it expired while the batch ran): that job's future
    gets the :class:`Shed`, the batch's other jobs their results."""
    async def go():
        b = Batcher(ServerMetrics(), window_ms=50, max_batch_rows=8, max_queue_rows=100)

        def run(jobs):
            jobs[1].shed = Shed("expired", 2)
            return [j.payload for j in jobs]

        jobs = [Job(group="a", run=run, payload=i, rows=1, endpoint="t") for i in range(3)]
        futs = [b.submit(j) for j in jobs]
        b.start()
        out = await asyncio.gather(*futs, return_exceptions=True)
        b.stop()
        return out

    out = asyncio.run(go())
    assert out[0] == 0 and out[2] == 2
    assert isinstance(out[1], Shed) and out[1].retry_after_s == 2


def test_a_job_settled_by_its_run_is_answered_while_the_batch_goes_on():
    """``run`` may answer a job early (:meth:`Job.settle`): its request has its answer
    while the batch still runs, and the batcher does not answer it again."""
    async def go():
        b = Batcher(ServerMetrics(), window_ms=50, max_batch_rows=8, max_queue_rows=100)
        release = threading.Event()

        def run(jobs):
            jobs[0].settle("early")
            assert release.wait(5), "the early answer did not arrive while the batch ran"
            return ["late: not sent", *(j.payload for j in jobs[1:])]

        jobs = [Job(group="a", run=run, payload=i, rows=1, endpoint="t") for i in range(2)]
        futs = [b.submit(j) for j in jobs]
        b.start()
        first = await futs[0]
        running = not futs[1].done()
        release.set()
        second = await futs[1]
        b.stop()
        return first, running, second

    assert asyncio.run(go()) == ("early", True, 1)


def test_the_typical_scale_is_the_median_of_recent_batches():
    b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=4)
    b._update_scale(2.0)
    assert b.typical_scale == b.scale  # too few batches yet
    for r in range(b.TYPICAL_MIN_BATCHES - 1):
        b._update_scale(1.0 + r / 10)
    ratios = sorted([2.0, *(1.0 + r / 10 for r in range(b.TYPICAL_MIN_BATCHES - 1))])
    assert b.typical_scale == ratios[len(ratios) // 2] != b.scale
    for _ in range(b.RATIO_WINDOW):
        b._update_scale(0.7)
    assert b.typical_scale == 0.7  # only the last RATIO_WINDOW batches count


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice: Linux")
def test_the_batch_thread_runs_at_a_lower_priority_than_the_event_loop():
    """``nice``: the worker thread's nice value is the process's plus ``nice`` (the event
    loop's thread keeps the process's); 0 leaves it alone; a negative one is refused."""
    def batch_nice(nice: int) -> int:
        async def go():
            seen = []

            def run(jobs):
                seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                return [None for _ in jobs]

            b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=4,
                        nice=nice)
            fut = b.submit(Job(group="g", run=run, payload=None, rows=1, budget=(1.0, 1.0),
                               endpoint="t"))
            b.start()
            await fut
            b.stop()
            return seen[0]

        return asyncio.run(go())

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert batch_nice(0) == own
    assert batch_nice(7) == min(19, own + 7)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    with pytest.raises(ValueError, match="nice must be >= 0"):
        Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=4, nice=-1)


def test_a_job_s_expiry_is_minus_inf_once_its_client_has_gone():
    """What a decode reads at every step: a job whose client went away stops being
    decoded at the next step, not at the end of its batch."""
    job = Job(group="a", run=lambda jobs: None, payload=0, rows=1, endpoint="t")
    assert job.expiry() == math.inf
    job.expires = 12.5
    assert job.expiry() == 12.5
    job.cancel()
    assert job.expiry() == -math.inf
