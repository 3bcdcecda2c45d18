"""The deadline policy's exact decisions on a synthetic latency table, and the table
itself (interpolation, JSON round trip, refusals, what ``profile --latency-table`` writes)."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest

import dynaseq
from dynaseq.core.errors import DynaseqError
from dynaseq.metrics.latency_table import LatencyTable
from dynaseq.serve.policy import DeadlinePolicy, Work

from helpers import run_cli
from serve_helpers import BUDGETS

FULL, HALF = (1.0, 1.0), (0.5, 0.5)


def table(predict: str = "grid") -> LatencyTable:
    # batch 1 / 10 x length 10 / 20 -> ms (the policy's tests read it as a grid: exact sums)
    return LatencyTable([FULL, HALF], [1, 10], [10, 20],
                        {"1,1": [[10.0, 20.0], [50.0, 100.0]],
                         "0.5,0.5": [[6.0, 12.0], [30.0, 60.0]]}, predict=predict)


def test_table_interpolates_extrapolates_and_floors():
    t = table()
    assert t.predict_ms(FULL, 1, 10) == 10.0
    assert t.predict_ms(FULL, 10, 20) == 100.0
    assert t.predict_ms(FULL, 5, 15) == pytest.approx(15 + 60 * 4 / 9)
    assert t.predict_ms(FULL, 20, 10) == pytest.approx(50 + 10 * 40 / 9)  # beyond: linear
    assert t.predict_ms(FULL, 1, 1) == 2.5  # never below a quarter of the fastest cell
    with pytest.raises(KeyError, match="0.2,0.2"):
        t.predict_ms((0.2, 0.2), 1, 10)


def test_fitted_table_recovers_a_bilinear_cost_and_smooths_a_noisy_cell():
    # the cells of t = 2 + 3n + 0.5L + 0.25nL: the fit is exact, in and beyond the grid
    def cost(n, length):
        return 2 + 3 * n + 0.5 * length + 0.25 * n * length

    sizes, lengths = [1, 4, 16], [8, 16, 32]
    cells = [[cost(n, length) for length in lengths] for n in sizes]
    t = LatencyTable([FULL], sizes, lengths, {"1,1": cells})
    assert t.predict == "fit"
    assert t.fit(FULL) == pytest.approx((2, 3, 0.5, 0.25), abs=1e-6)
    assert t.fit_error(FULL) == pytest.approx(0, abs=1e-9)
    assert t.predict_ms(FULL, 8, 20) == pytest.approx(cost(8, 20))
    assert t.predict_ms(FULL, 64, 40) == pytest.approx(cost(64, 40))
    # one cell measured 3x too slow (a noisy moment): the grid passes it on, the fit barely
    noisy = [row[:] for row in cells]
    noisy[1][1] *= 3
    grid = LatencyTable([FULL], sizes, lengths, {"1,1": noisy}, predict="grid")
    fit = LatencyTable([FULL], sizes, lengths, {"1,1": noisy})
    assert grid.predict_ms(FULL, 4, 16) == pytest.approx(3 * cost(4, 16))
    assert abs(fit.predict_ms(FULL, 4, 16) / cost(4, 16) - 1) < 0.5
    assert fit.fit_error(FULL) < 0.5
    # never decreasing in batch size or length, whatever the cells
    rough = [[30.0, 10.0, 50.0], [20.0, 60.0, 40.0], [90.0, 70.0, 80.0]]
    r = LatencyTable([FULL], sizes, lengths, {"1,1": rough})
    assert all(c >= 0 for c in r.fit(FULL))
    pred = [[r.predict_ms(FULL, n, length) for length in range(1, 40, 3)] for n in range(1, 20)]
    assert all(a <= b + 1e-9 for row in pred for a, b in itertools.pairwise(row))
    assert all(a <= b + 1e-9 for col in zip(*pred, strict=True)
               for a, b in itertools.pairwise(col))
    # one measured batch size: no slope in n is invented
    one = LatencyTable([FULL], [8], [8, 16], {"1,1": [[10.0, 20.0]]})
    assert one.predict_ms(FULL, 1, 12) == one.predict_ms(FULL, 32, 12) == pytest.approx(15)
    with pytest.raises(ValueError, match="predict must be one of fit, grid"):
        LatencyTable([FULL], [1], [10], {"1,1": [[1.0]]}, predict="spline")


def test_table_round_trips_and_refuses_bad_files(tmp_path):
    path = table().save(tmp_path / "t.json")
    back = LatencyTable.load(path)
    assert back.service_ms == table().service_ms and back.budgets == [FULL, HALF]
    assert back.predict == "grid"
    (tmp_path / "bad.json").write_text('{"budgets": [[1, 1]]}')
    with pytest.raises(DynaseqError, match="not a latency table"):
        LatencyTable.load(tmp_path / "bad.json")
    with pytest.raises(DynaseqError, match="not found"):
        LatencyTable.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="must be > 0"):
        LatencyTable([FULL], [1], [10], {"1,1": [[0.0]]})
    with pytest.raises(ValueError, match="increasing"):
        LatencyTable([FULL], [4, 1], [10], {"1,1": [[1.0], [2.0]]})


def test_idle_server_gives_the_largest_budget_that_makes_the_deadline():
    p = DeadlinePolicy(table(), [HALF, FULL], max_batch_rows=10)
    assert p.largest == FULL and p.smallest == HALF
    d = p.decide(12, rows=1, length=10)
    assert (d.budget, d.degraded, d.reject, d.predicted_ms) == (FULL, False, False, 10.0)
    d = p.decide(8, rows=1, length=10)
    assert (d.budget, d.degraded, d.reject, d.predicted_ms) == (HALF, True, False, 6.0)
    d = p.decide(5, rows=1, length=10)
    assert (d.budget, d.reject, d.retry_after_s, d.predicted_ms) == (None, True, 1, 6.0)


def test_a_fitted_table_is_fitted_when_the_policy_is_built_not_on_a_request(monkeypatch):
    """The first request's prediction must not fit the table (that imported scipy on the
    server's event loop): the policy fits every budget it serves when it is built."""
    fitted = table(predict="fit")
    p = DeadlinePolicy(fitted, [HALF, FULL], max_batch_rows=10)

    def refuse(*args, **kwargs):
        raise AssertionError("fitted on a request")

    monkeypatch.setattr("scipy.optimize.nnls", refuse)
    d = p.decide(1000, rows=3, length=15, ahead=[Work(HALF, 2, 12, True)], running_ms=5.0)
    assert d.budget == FULL and d.predicted_ms > 0


def test_a_budget_no_faster_than_a_larger_one_is_never_chosen():
    """Smaller budgets whose outputs run longer can be slower: a budget predicted no faster
    than a larger one is passed over (arrival and batch), and the fallback is the fastest."""
    small = (0.2, 0.2)
    slow_small = LatencyTable([FULL, HALF, small], [1, 10], [10, 20],
                              {"1,1": [[10.0, 20.0], [50.0, 100.0]],
                               "0.5,0.5": [[6.0, 12.0], [30.0, 60.0]],
                               "0.2,0.2": [[8.0, 16.0], [40.0, 80.0]]}, predict="grid")
    p = DeadlinePolicy(slow_small, [FULL, HALF, small], max_batch_rows=10)
    assert p.decide(7, rows=1, length=10).budget == HALF
    d = p.decide(5, rows=1, length=10)  # nothing in time: refused on the fastest's prediction
    assert (d.budget, d.reject, d.predicted_ms) == (None, True, 6.0)
    p = DeadlinePolicy(slow_small, [FULL, HALF, small], max_batch_rows=10,
                       overload="smallest")
    d = p.decide(5, rows=1, length=10)
    assert (d.budget, d.degraded, d.predicted_ms) == (HALF, True, 6.0)
    assert p.batch_budget([], [Work(FULL, 1, 10, True)], left_ms=[5.0]) == HALF
    assert p.batch_budget([], [Work(FULL, 1, 10, True)], left_ms=[7.0]) == HALF
    assert p.batch_budget([], [Work(FULL, 1, 10, True)], left_ms=[11.0]) == FULL


def test_queued_work_degrades_budgets_before_latency_grows():
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)
    ahead = [Work(FULL, 9, 10)]  # 9 lines: with ours, one batch of 10 -> 5 ms a full line
    assert p.predict_ms(FULL, 1, 10, ahead) == 50.0  # the batch of 10 lines
    assert p.decide(50, 1, 10, ahead).budget == FULL  # 45 + 5
    d = p.decide(49, 1, 10, ahead)  # 45 + 3 at half
    assert (d.budget, d.degraded, d.predicted_ms) == (HALF, True, 48.0)
    d = p.decide(47, 1, 10, ahead)
    assert d.reject and d.retry_after_s == 1
    d = p.decide(1000, 1, 10, ahead, running_ms=2000.0)  # a long batch is running
    assert d.reject and d.retry_after_s == 3  # ceil((2000 + 45) / 1000)
    assert p.decide(2100, 1, 10, ahead, running_ms=2000.0).budget == FULL


def test_slack_window_and_overload_smallest():
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10, window_ms=5, slack=0.5)
    assert p.decide(30, 1, 10).budget == FULL  # 5 + 10 <= 15
    assert p.decide(29, 1, 10).budget == HALF  # 5 + 6 <= 14.5
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10, overload="smallest")
    d = p.decide(1, 1, 10)
    assert (d.budget, d.degraded, d.reject) == (HALF, True, False)
    with pytest.raises(ValueError, match="not in the latency table"):
        DeadlinePolicy(table(), [(0.2, 0.2)], max_batch_rows=10)


def test_a_request_is_refused_only_when_even_its_median_prediction_is_late():
    """Budgets are planned with the margin and within slack x deadline; a request that no
    budget meets that way still runs at the smallest if, without the margin, it is
    predicted in time by the deadline itself."""
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10, slack=0.5)
    d = p.decide(11, 1, 10)  # 6 ms at half: not within 0.5 x 11, but within 11
    assert (d.budget, d.degraded, d.reject) == (HALF, True, False)
    d = p.decide(20, 1, 10, overhead_ms=6.0, margin_ms=4.0)  # 12 > 10 ; 12 - 4 <= 20
    assert (d.budget, d.reject, d.predicted_ms) == (HALF, False, 12.0)
    d = p.decide(7, 1, 10, overhead_ms=6.0, margin_ms=4.0)  # 12 - 4 = 8 > 7
    assert d.reject and d.predicted_ms == 12.0
    assert p.decide(5, 1, 10).reject


def test_profile_writes_the_run_latency_table(serve_run):
    t = LatencyTable.load(serve_run / "latency_table.json")
    assert t.budgets == BUDGETS and t.batch_sizes == [1, 8] and t.lengths == [8, 24]
    assert t.beam == 1 and t.checkpoint.endswith("best")
    assert t.extra["decoding"].startswith("free: real sentences")
    raw = json.loads((serve_run / "latency_table.json").read_text())
    assert set(raw["service_ms"]) == {"1,1", "0.5,0.5", "1,0.33"}


def test_fixed_length_table_without_sentences(serve_run):
    from dynaseq.metrics.latency_table import measure_latency_table

    t = dynaseq.load(serve_run)
    table = measure_latency_table(t.model, {(1.0, 1.0): 0, (0.5, 0.5): 1}, [1, 2], [4],
                                  repeats=1)
    assert table.extra["decoding"].startswith("fixed length")
    assert all(v > 0 for rows in table.service_ms.values() for r in rows for v in r)
    with pytest.raises(DynaseqError, match="no sentences"):
        measure_latency_table(t.model, {(1.0, 1.0): 0}, [1], [4], sources=[[]])


def test_table_times_what_runs_after_each_decode(serve_run, synthetic_paths):
    """``after`` runs once per timed decode and its warm-up, with the batch's hypotheses
    and, where the server's decode counts what it runs (a gated budget, greedy, lean), what
    it counted; the table names what it timed; the server's compute report fits the hook."""
    from dynaseq.metrics.latency_table import measure_latency_table
    from dynaseq.serve.compute import ServedCompute

    t = dynaseq.load(serve_run)
    calls = []
    report = ServedCompute(t.model)

    class After:
        def counts(self, control, n_rows):
            return report.counts(control, n_rows)

        def __call__(self, src, hyps, control, counted):
            calls.append((src.size(0), len(hyps), counted is not None))
            return report(src, hyps, control, counted)

    after = After()

    sources = t.tokenizer.encode(synthetic_paths["valid.src"].read_text().splitlines()[:20])
    for sentences in (None, sources):
        calls.clear()
        controls = {(1.0, 1.0): t.control_for(1.0), (0.5, 0.5): t.control_for(0.5)}
        table = measure_latency_table(t.model, controls, [1, 3], [4], repeats=2,
                                      sources=sentences, after=after,
                                      timed="decode + compute")
        assert table.extra["timed"] == "decode + compute"
        # 2 budgets x 2 batch sizes x 1 length, each 1 warm-up + 2 timed; budget 1 opens
        # every gate (nothing to count), 0.5 is counted while decoding
        assert sorted(calls) == sorted([(b, b, counted) for b in (1, 3)
                                        for counted in (False, True)] * 3)


def test_profile_latency_table_says_how_it_predicts(serve_run, tmp_path):
    assert LatencyTable.load(serve_run / "latency_table.json").predict == "fit"
    run = tmp_path / "run"
    shutil.copytree(serve_run, run)
    r = run_cli("profile", str(run), "--latency-table", "--beam", "1", "--repeats", "1",
                "--table-batches", "1,2", "--table-lengths", "8", "--table-predict", "grid")
    assert r.returncode == 0, r.stderr.decode()
    assert "fit err" in r.stdout.decode() and "predictions: grid" in r.stdout.decode()
    assert LatencyTable.load(run / "latency_table.json").predict == "grid"
    r = run_cli("profile", str(run), "--latency-table", "--table-predict", "spline")
    assert r.returncode == 2 and b"--table-predict" in r.stderr


def test_profile_latency_table_refusals(serve_run, lm_run):
    r = run_cli("profile", str(lm_run), "--latency-table")
    assert r.returncode == 2 and b"not a translation or classification run" in r.stderr
    r = run_cli("profile", str(serve_run), "--latency-table", "--table-batches", "0,2")
    assert r.returncode == 2 and b"--table-batches must be integers >= 1" in r.stderr
    r = run_cli("profile", str(serve_run), "--latency-table", "--table-lengths", "2000")
    assert r.returncode == 2 and b"max_positions" in r.stderr


def test_scale_multiplies_the_table():
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)
    ahead = [Work(FULL, 9, 10)]
    assert p.predict_ms(FULL, 1, 10, ahead, running_ms=7.0, scale=2.0) == 107.0
    d = p.decide(100, 1, 10, ahead, scale=2.0)  # 90 + 10 full, 90 + 6 half
    assert (d.budget, d.predicted_ms) == (FULL, 100.0)
    assert p.decide(99, 1, 10, ahead, scale=2.0).budget == HALF


def test_overhead_is_added_to_every_prediction():
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)
    assert p.predict_ms(FULL, 1, 10) == 10.0
    assert p.predict_ms(HALF, 1, 10, overhead_ms=4.0) == 10.0
    assert p.decide(13, 1, 10, overhead_ms=4.0).budget == HALF
    d = p.decide(9, 1, 10, overhead_ms=4.0)
    assert d.reject and d.predicted_ms == 10.0


def test_lines_expected_to_join_the_batch_count_in_its_completion():
    """Lines arriving while the running batch ends join the request's batch, which ends
    when its last line does: 400 lines/s x 20 ms = 8 joiners, a batch of 9 lines."""
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)
    assert p.predict_ms(FULL, 1, 10, running_ms=20.0) == 30.0
    assert p.joiners(1, [], 20.0, 400.0) == pytest.approx(8.0)
    assert p.predict_ms(FULL, 1, 10, running_ms=20.0, arrival_rate=400.0) == pytest.approx(
        20 + 10 + 40 * 8 / 9)
    assert p.joiners(1, [], 20.0, 4000.0) == 9.0  # no more than the batch has room for
    assert p.predict_ms(FULL, 1, 10, running_ms=20.0, arrival_rate=4000.0) == 70.0
    assert p.joiners(1, [Work(FULL, 12, 10)], 20.0, 400.0) == 0.0  # a later batch
    d = p.decide(60, 1, 10, running_ms=20.0, arrival_rate=400.0)
    assert d.budget == HALF and d.predicted_ms == pytest.approx(20 + 6 + 24 * 8 / 9)
    assert p.decide(60, 1, 10, running_ms=20.0).budget == FULL


def test_a_batch_about_to_run_gives_its_deadline_lines_one_budget():
    """The largest budget whose batch time fits the time left; lines with a budget of
    their own count at theirs (a budget the table lacks at the largest)."""
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)
    flexible = [Work(HALF, 2, 10), Work(FULL, 3, 10)]
    fixed = [Work(FULL, 5, 10)]  # 10 lines: 5 ms a line at full, 3 at half
    assert p.batch_budget(fixed, flexible, left_ms=[50.0, 50.0]) == FULL  # 25 + 25
    assert p.batch_budget(fixed, flexible, left_ms=[49.0, 60.0]) == HALF  # 25 + 15
    assert p.batch_budget(fixed, flexible, left_ms=[10.0, 10.0]) == HALF  # none fits
    assert p.batch_budget(fixed, flexible, left_ms=[80.0, 80.0], scale=2.0) == HALF  # 2 x 40
    assert p.batch_budget([Work((0.2, 0.2), 5, 10)], flexible, left_ms=[50.0, 50.0]) == FULL


def test_a_batch_lasts_as_long_as_its_longest_line_and_a_short_line_costs_its_own_steps():
    """A batch decodes as many steps as its longest line, but drops a line that ends: a
    batch of a 10- and a 20-token line costs a 2-line batch at length 20 less what the
    10-token line's steps past its end would cost (the table's per-line cost
    ``(t(2, L) - t(1, L)) / 1`` at 20 less at 10), and so does a 10-token request behind
    a 20-token one."""
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)
    at20, at10 = 20 + 80 / 9, 10 + 40 / 9  # t(2, 20), t(2, 10) at the full budget
    assert p.line_cost_ms(FULL, 20, 2) == pytest.approx(at20 - 20)
    assert p.line_cost_ms(FULL, 20, 1) == 0.0
    two = at20 - ((at20 - 20) - (at10 - 10))
    assert p.batch_ms([Work(FULL, 1, 10), Work(FULL, 1, 20)]) == pytest.approx(two)
    assert p.batch_ms([Work(FULL, 1, 20), Work(FULL, 1, 20)]) == pytest.approx(at20)
    half20, half10 = 12 + 48 / 9, 6 + 24 / 9
    assert p.batch_ms([Work(FULL, 1, 10), Work(FULL, 1, 20)], HALF) == pytest.approx(
        half20 - ((half20 - 12) - (half10 - 6)))
    assert p.predict_ms(FULL, 1, 10, [Work(FULL, 1, 20)]) == pytest.approx(two)
    assert p.batch_budget([Work(FULL, 1, 20)], [Work(FULL, 1, 10)], [two]) == FULL
    assert p.batch_budget([Work(FULL, 1, 20)], [Work(FULL, 1, 10)], [two - 1]) == HALF


def test_a_batch_leaves_the_time_that_later_requests_were_admitted_on():
    """A batch takes a larger budget only if the lines queued behind it still answer in
    time, their flexible lines at the smallest budget; admission counts queued flexible
    lines at the budget it tries."""
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)
    mine = [Work(FULL, 1, 10)]
    assert p.batch_budget([], mine, [100.0]) == FULL  # 10 ms
    assert p.batch_budget([], mine, [100.0], behind=[(Work(FULL, 1, 10, True), 17.0)]) == FULL
    assert p.batch_budget([], mine, [100.0], behind=[(Work(FULL, 1, 10, True), 15.0)]) == HALF
    assert p.batch_budget([], mine, [100.0], behind=[(Work(FULL, 1, 10), None)]) == FULL
    # 12 lines behind: two batches (10 lines, then 2), the second one due at 60 ms
    behind = [(Work(FULL, 10, 10, True), 100.0), (Work(FULL, 2, 10, True), 60.0)]
    assert p.batch_budget([], mine, [100.0], behind=behind) == FULL  # 10 + 30 + 8.7 ≤ 60
    behind[1] = (Work(FULL, 2, 10, True), 48.0)
    assert p.batch_budget([], mine, [100.0], behind=behind) == HALF  # 6 + 30 + 8.7 ≤ 48
    flexible_ahead = [Work(FULL, 9, 10, True)]
    assert p.predict_ms(HALF, 1, 10, flexible_ahead) == 30.0  # the 10 lines at half
    assert p.predict_ms(HALF, 1, 10, [Work(FULL, 9, 10)]) == pytest.approx(45 + 3)


def test_in_the_fitted_model_a_batch_is_its_steps_plus_each_line_at_its_own_length():
    """Through the table's fit ``t = c0 + c1 n + c2 L + c3 n L``, a batch of lines of
    lengths ``L_i`` costs ``c0 + c2 max L + sum_i (c1 + c3 L_i)``: the per-step part at the
    longest line, each line's own part at its own length."""
    c0, c1, c2, c3 = 3.0, 0.5, 0.8, 0.05
    sizes, lengths = [1, 4, 16], [8, 16, 32]
    cells = {"1,1": [[c0 + c1 * n + c2 * L + c3 * n * L for L in lengths] for n in sizes]}
    p = DeadlinePolicy(LatencyTable([FULL], sizes, lengths, cells, predict="fit"), [FULL],
                       max_batch_rows=16)
    works = [Work(FULL, 3, 8), Work(FULL, 2, 24), Work(FULL, 4, 12)]
    want = c0 + c2 * 24 + sum(w.rows * (c1 + c3 * w.length) for w in works)
    assert p.batch_ms(works) == pytest.approx(want, rel=1e-6)
    assert p.answer_ms(works, [24]) == pytest.approx([want], rel=1e-6)


def test_the_queue_ahead_runs_in_the_batches_the_batcher_will_form():
    """Each batch ahead at its own longest source; the request joins the last if it has
    room, else it starts the next."""
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)
    ahead = [Work(FULL, 6, 20), Work(FULL, 4, 10), Work(FULL, 5, 10)]
    assert [[w.rows for w in b] for b in p.batches(ahead)] == [[6, 4], [5]]
    # 10 lines at length 20 (100 ms, less the 4 lines' 10 steps past their end at the
    # per-line cost (t(10, L) - t(1, L)) / 9: 80 / 9 at 20, 40 / 9 at 10), then 5 + 1 lines
    # at length 10
    assert p.predict_ms(FULL, 1, 10, ahead) == pytest.approx(
        100 - 4 * 40 / 9 + 10 + 40 * 5 / 9)
    assert p.predict_ms(FULL, 1, 10, [Work(FULL, 10, 10)]) == pytest.approx(50 + 10)
    assert p.batches([]) == []


def test_lines_that_cannot_answer_in_time_even_at_the_smallest_are_dropped():
    """``late``: a flexible line is dropped when the batch at the smallest budget (scaled)
    takes longer than its time left; dropping it shortens the batch, and the others are
    checked again."""
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)
    fixed = [Work(FULL, 5, 10)]  # 25 ms of a 10-line batch
    flexible = [Work(FULL, 5, 10, True)]  # 15 ms at half
    assert p.late(fixed, flexible, [40.0]) == [False]  # 25 + 15
    assert p.late(fixed, flexible, [39.0]) == [True]
    assert p.late(fixed, flexible, [79.0], scale=2.0) == [True]
    # two lines: in one 2-line batch at half (length 20) they take 12 + 48/9 ms less the
    # 10-token line's steps past its end (24/9): 14.7 ms; the 10-token line alone (the
    # other dropped) takes 6, the 20-token one 12
    two = [Work(FULL, 1, 20, True), Work(FULL, 1, 10, True)]
    assert p.late([], two, [15.0, 15.0]) == [False, False]
    assert p.late([], two, [14.0, 14.0]) == [True, False]  # the first in line goes first
    assert p.late([], two, [14.0, 13.0]) == [False, True]  # the least time left goes first
    assert p.late([], two, [11.0, 5.0]) == [True, True]  # 12 > 11 once the other is gone
    assert p.late([], two, [12.0, 5.0]) == [False, True]


def test_with_early_answers_a_line_ends_at_its_own_longest_source():
    """A server that answers each request when its own lines end (``early_answers``): the
    request's batch ends for it at its own length (the batch's lines at length 10, not the
    20-token line's), while the batches ahead still cost theirs at their longest; the same
    in a batch about to run (``batch_budget``) and for what is dropped (``late``)."""
    early = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10, early_answers=True)
    whole = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)
    at10, at20 = 10 + 40 / 9, 20 + 80 / 9  # 2 full-budget lines at length 10, 20
    mixed = at20 - ((at20 - 20) - (at10 - 10))  # one of each: the short one ends at 10
    assert early.predict_ms(FULL, 1, 10, [Work(FULL, 1, 20)]) == pytest.approx(at10)
    assert whole.predict_ms(FULL, 1, 10, [Work(FULL, 1, 20)]) == pytest.approx(mixed)
    ahead = [Work(FULL, 10, 10), Work(FULL, 1, 20)]  # a 10-line batch (50 ms), then ours
    assert early.predict_ms(FULL, 1, 10, ahead) == pytest.approx(50 + at10)
    assert whole.predict_ms(FULL, 1, 10, ahead) == pytest.approx(50 + mixed)
    assert early.predict_ms(FULL, 1, 20, [Work(FULL, 1, 10)]) == pytest.approx(mixed)
    assert early.decide(at10, 1, 10, [Work(FULL, 1, 20)]).budget == FULL
    assert whole.decide(at10, 1, 10, [Work(FULL, 1, 20)]).reject  # 14.7 ms even at half
    for p, want in ((early, FULL), (whole, HALF)):
        assert p.batch_budget([Work(FULL, 1, 20)], [Work(FULL, 1, 10)], [at10]) == want
    # at half, two lines: 12 + 48/9 - 24/9 = 14.7 ms at length 20, 6 + 24/9 = 8.7 at 10
    two = [Work(FULL, 1, 20, True), Work(FULL, 1, 10, True)]
    assert early.late([], two, [14.0, 9.0]) == [True, False]
    assert whole.late([], two, [14.0, 9.0]) == [False, True]  # 14.7 > 9; then 12 alone
    assert early.answers_in_time([Work(HALF, 1, 20), Work(HALF, 1, 10)], [20, 10],
                                 [14.7, 8.7]) == [True, True]
    assert early.answers_in_time([Work(HALF, 1, 20), Work(HALF, 1, 10)], [20, 10],
                                 [14.6, 8.6]) == [False, False]
    with pytest.raises(ValueError, match="2 times left for 1 flexible"):
        early.batch_budget([], [Work(FULL, 1, 10)], [1.0, 2.0])


def test_the_server_plans_early_answers_where_it_gives_them(serve_run):
    """Greedy answers each request as its lines end, so the policy plans that way; with
    ``--answer-at-batch-end`` (``early_answers=False``) or beam search on a CCT (its gates
    decide, so the batch is counted once it ends) every line waits for the batch."""
    from dynaseq.serve.app import build_state
    from dynaseq.serve.config import ServeConfig

    run = dynaseq.load(serve_run)
    t = LatencyTable.load(serve_run / "latency_table.json")
    plans = {(beam, early): build_state(run, "seq2seq", ServeConfig(beam=beam,
                                                                    early_answers=early),
                                        t, log_stream=None).policy.early_answers
             for beam, early in ((1, True), (1, False))}
    assert plans == {(1, True): True, (1, False): False}
    t.beam = 2  # a table measured at the server's beam
    assert not build_state(run, "seq2seq", ServeConfig(beam=2), t,
                           log_stream=None).policy.early_answers


def test_a_formed_batch_keeps_the_formation_margin_for_its_lines_and_the_admission_one_behind():
    """``replan_budgets`` with ``batch_margin="formation"`` takes the margin of the
    predictions made as batches were formed off the batch's own lines and the admission
    margin off those queued behind; with ``"admission"`` both keep the admission margin.
    Each replanned line records when its answer is predicted (``formed_due``)."""
    import time
    from types import SimpleNamespace

    from dynaseq.serve.batcher import Job
    from dynaseq.serve.config import ServeConfig
    from dynaseq.serve.endpoints import replan_budgets

    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)  # 10 lines: 50 / 30 ms

    def replan(mode: str, due_ms: float, behind_due_ms: float | None = None):
        batcher = SimpleNamespace(loop_lag_ms=0.0, overhead_ms=30.0, formation_ms=0.0,
                                  typical_scale=1.0, typical_at=lambda n: 1.0, arrival_rate=0.0, arrival_length=1)
        state = SimpleNamespace(policy=p, batcher=batcher,
                                config=ServeConfig(batch_margin=mode))
        now = time.perf_counter()

        def job(due: float) -> Job:
            return Job(group="g", run=lambda jobs: [], payload=None, rows=10, length=10,
                       budget=FULL, deadline_ms=due, due=now + due / 1000.0)

        own = job(due_ms)
        behind = [] if behind_due_ms is None else [job(behind_due_ms)]
        changed = []
        replan_budgets(state, [own], 1.0, behind,
                       rebudget=lambda j, b, degraded: changed.append((b, degraded)))
        return own, changed, now

    # 70 ms left: 40 after the admission margin (only half's 30 ms fits), 70 after none
    own, changed, _ = replan("admission", 70.0)
    assert (own.budget, changed) == (HALF, [(HALF, True)])
    own, changed, now = replan("formation", 70.0)
    assert (own.budget, changed) == (FULL, [])
    assert own.formed_due == pytest.approx(now + 0.050, abs=0.01)  # the full batch's 50 ms
    # a batch behind due in 100 ms: after the full batch and its own 30 at the smallest it
    # answers at 80, past 100 - 30; after a half batch at 60, in time: both modes go half
    for mode in ("admission", "formation"):
        own, _, now = replan(mode, 200.0, behind_due_ms=100.0)
        assert own.budget == HALF, mode
        assert own.formed_due == pytest.approx(now + 0.030, abs=0.01)
    own, _, _ = replan("formation", 200.0, behind_due_ms=120.0)  # 80 <= 120 - 30
    assert own.budget == FULL
    # "risk": no margin off the batch's lines; a line's chance of answering late is the
    # share of recent answers later than predicted by more than its slack
    def risky(slack_ms: float) -> float:
        return 0.5 if slack_ms < 10 else 0.0

    for due, want in ((55.0, HALF), (65.0, FULL), (45.0, HALF)):
        batcher = SimpleNamespace(loop_lag_ms=0.0, overhead_ms=30.0, formation_ms=99.0,
                                  typical_scale=1.0, typical_at=lambda n: 1.0, formation_late_share=risky,
                                  arrival_rate=0.0, arrival_length=1)
        state = SimpleNamespace(policy=p, batcher=batcher,
                                config=ServeConfig(batch_margin="risk"))
        own = Job(group="g", run=lambda jobs: [], payload=None, rows=10, length=10,
                  budget=FULL, deadline_ms=due, due=time.perf_counter() + due / 1000.0)
        replan_budgets(state, [own], 1.0, [], rebudget=lambda j, b, degraded: None)
        assert own.budget == want, due
    # --max-utilization reaches the batch with the batcher's arrival rate and mean length:
    # at 200 lines a second of 10 tokens, or 100 of 20, the full budget (5 / 10 ms a line
    # in a full batch) would take all of the time, whatever the batch's own length
    for rate, mean, length, want in ((100.0, 10, 10, FULL), (200.0, 10, 10, HALF),
                                     (100.0, 20, 10, HALF), (100.0, 10, 20, FULL)):
        batcher = SimpleNamespace(loop_lag_ms=0.0, overhead_ms=0.0, formation_ms=0.0,
                                  typical_scale=1.0, typical_at=lambda n: 1.0, arrival_rate=rate, arrival_length=mean)
        state = SimpleNamespace(policy=p, batcher=batcher,
                                config=ServeConfig(max_utilization=0.9))
        own = Job(group="g", run=lambda jobs: [], payload=None, rows=10, length=length,
                  budget=FULL, deadline_ms=500.0, due=time.perf_counter() + 0.5)
        replan_budgets(state, [own], 1.0, [], rebudget=lambda j, b, degraded: None)
        assert own.budget == want, (rate, mean, length)
    assert ServeConfig().batch_margin == "formation"
    with pytest.raises(DynaseqError, match="--batch-margin must be one of admission, "
                                           "formation, risk"):
        ServeConfig(batch_margin="none")


def test_batch_budget_within_risk_weighs_each_lines_chance_of_answering_late():
    """With ``late_share``, a budget is taken when no line is predicted late and the
    expected share of late lines (each line's chance at its slack, weighted by its
    lines) is within the tolerance."""
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)  # 10 lines: 50 / 30 ms

    def share(slack_ms: float) -> float:
        return 0.5 if slack_ms < 10 else 0.0

    works = [Work(FULL, 9, 10, True), Work(FULL, 1, 10, True)]
    # the one-line request has 5 ms to spare at the full budget: 0.5 x 1 / 10 lines late
    assert p.batch_budget([], works, [100.0, 55.0], late_share=share) == HALF
    assert p.batch_budget([], works, [100.0, 55.0], late_share=share,
                          late_tolerance=0.05) == FULL
    assert p.batch_budget([], works, [100.0, 61.0], late_share=share) == FULL
    # predicted past its time left: not taken, whatever the tolerance
    assert p.batch_budget([], works, [100.0, 49.0], late_share=share,
                          late_tolerance=1.0) == HALF


def test_batch_budget_passes_over_a_budget_the_arrivals_would_outrun():
    """With ``max_utilization``, a budget above the smallest is taken only if the arrival
    rate x its time per line in a full batch stays within it; the smallest always is."""
    p = DeadlinePolicy(table(), [FULL, HALF], max_batch_rows=10)  # 10 lines: 5 / 3 ms each
    assert p.utilization(FULL, 200.0, 10) == pytest.approx(1.0)
    assert p.utilization(HALF, 200.0, 10, scale=2.0) == pytest.approx(1.2)
    works = [Work(FULL, 1, 10, True)]
    assert p.batch_budget([], works, [1000.0]) == FULL  # no limit
    assert p.batch_budget([], works, [1000.0], arrival_rate=100.0, max_utilization=0.9) == FULL
    assert p.batch_budget([], works, [1000.0], arrival_rate=200.0, max_utilization=0.9) == HALF
    assert p.batch_budget([], works, [1000.0], arrival_rate=1000.0, max_utilization=0.9) == HALF
    # priced at the arriving lines' mean length, not the batch's longest source
    long_batch, short_batch = [Work(FULL, 1, 20, True)], [Work(FULL, 1, 10, True)]
    assert p.utilization(FULL, 100.0, 20) == pytest.approx(1.0)
    assert p.batch_budget([], long_batch, [1000.0], arrival_rate=100.0,
                          max_utilization=0.9) == HALF  # None: at the longest, 20
    assert p.batch_budget([], long_batch, [1000.0], arrival_rate=100.0, max_utilization=0.9,
                          arrival_length=10) == FULL
    assert p.batch_budget([], short_batch, [1000.0], arrival_rate=100.0,
                          max_utilization=0.9, arrival_length=20) == HALF
    from dynaseq.serve.config import ServeConfig

    with pytest.raises(DynaseqError, match="--max-utilization must be > 0"):
        ServeConfig(max_utilization=0.0)


def test_the_server_batches_by_budget_unless_told_to_mix(serve_run):
    """``--mixed-batches`` (``batch_by_budget=False``) reaches the batcher."""
    from dynaseq.serve.app import build_state
    from dynaseq.serve.config import ServeConfig

    run = dynaseq.load(serve_run)
    assert {mix: build_state(run, "seq2seq", ServeConfig(batch_by_budget=not mix),
                             log_stream=None).batcher.by_budget
            for mix in (False, True)} == {False: True, True: False}


def test_a_table_names_the_loaded_checkpoint_whatever_folder_it_was_profiled_from(tmp_path):
    """A latency table records its checkpoint as ``profile`` was given it; the server's
    stale-table warning compares the checkpoint, not the text (``profile m3`` from one
    folder, ``serve /abs/m3`` from another: no warning)."""
    from dynaseq.serve.app import _same_checkpoint

    run = tmp_path / "m3"
    best, step = run / "best", run / "checkpoints" / "step_00000008"
    for d in (best, step):
        d.mkdir(parents=True)
    assert _same_checkpoint(str(best), best, run)
    assert _same_checkpoint("m3/best", best, run)  # relative to the folder it ran in
    assert _same_checkpoint("/elsewhere/m3/best", best, run)  # the run since moved
    assert _same_checkpoint("m3/checkpoints/step_00000008", step, run)
    assert not _same_checkpoint("m3/checkpoints/step_00000008", best, run)
    assert not _same_checkpoint(str(best), step, run)
    assert _same_checkpoint("exported/m3", run, run)  # an exported model: the run itself


def test_the_batches_ahead_are_priced_once_not_on_every_request(monkeypatch):
    """Planning a request prices each batch it waits behind at each budget once: the next
    request behind the same batches reads those prices (the same decision as a policy that
    never saw them) instead of pricing every line again."""
    priced = []
    summary = DeadlinePolicy._summary

    def counted(self, *args):
        priced.append(args)
        return summary(self, *args)

    monkeypatch.setattr(DeadlinePolicy, "_summary", counted)
    ahead = [Work(FULL, 1, 10 + i % 7, True) for i in range(12)]  # 3 batches of 4 ahead
    p = DeadlinePolicy(table("fit"), [FULL, HALF], max_batch_rows=4)
    first = p.decide(500.0, 1, 10, ahead, running_ms=5.0)
    n = len(priced)
    assert n == 3  # each batch ahead, at the full budget (in time: no other tried)
    assert p.decide(500.0, 1, 10, ahead, running_ms=5.0) == first
    assert len(priced) == n  # nothing priced again
    fresh = DeadlinePolicy(table("fit"), [FULL, HALF], max_batch_rows=4)
    assert fresh.decide(500.0, 1, 10, ahead, running_ms=5.0) == first
