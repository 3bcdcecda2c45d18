"""benchmarks/serve_load.py's bookkeeping: a cell's summary of what was answered, for a
translation run (BLEU) and a classification run (accuracy; budgets are fractions, the
full budget the largest trained one), and the request bodies each policy sends."""

from __future__ import annotations

import pytest

from helpers import load_benchmark

pytest.importorskip("aiohttp", reason="serve_load's load generator (the bench extra)")


def _rec(status, ms, hyp="", ref="", budget=None, **kw):
    return {"status": status, "ms": ms, "hyp": hyp, "ref": ref, "budget": budget,
            "server_ms": ms - 1, **kw}


def test_a_classify_cell_scores_accuracy_and_counts_the_full_budget_by_its_own_value():
    sl = load_benchmark("serve_load")
    task = sl.TASKS["classify"]
    records = [_rec(200, 10, "1", "1", [0.8]), _rec(200, 30, "0", "1", [0.8]),
               _rec(200, 12, "0", "0", [0.2], degraded=True), _rec(503, 2, shed=True),
               _rec("timeout", 10_000)]
    s = sl.summarize(records, seconds=2.0, deadline_ms=20, full=[0.8], task=task)
    assert s["accuracy"] == round(100 * 2 / 3, 2) and "bleu" not in s
    assert (s["sent"], s["answered"], s["rejected_503"], s["shed_late"], s["timeouts"]) == (
        5, 3, 1, 1, 1)
    assert s["slo_attainment"] == 0.4 and s["accepted_within_deadline"] == round(2 / 3, 4)
    assert s["goodput_rps"] == 1.0 and s["degraded"] == 1
    assert s["mean_budget"] == 0.6 and s["full_budget_share"] == round(2 / 3, 4)


def test_a_translate_cell_scores_bleu_over_budget_pairs():
    sl = load_benchmark("serve_load")
    records = [_rec(200, 5, "a cat sat on the mat", "a cat sat on the mat", [1.0, 1.0]),
               _rec(200, 5, "a cat sat on the mat", "a cat sat on the mat", [0.5, 0.2])]
    s = sl.summarize(records, seconds=1.0, deadline_ms=10)
    assert s["bleu"] == 100.0 and s["mean_budget"] == round((1.0 + 0.35) / 2, 3)
    assert s["full_budget_share"] == 0.5


def test_bodies_give_a_pair_as_a_list_and_one_fraction_as_a_number():
    sl = load_benchmark("serve_load")
    assert sl.body_for("full", "x", [0.8], [0.2], 50) == {"text": "x", "budget": 0.8}
    assert sl.body_for("smallest", "x", [1.0, 1.0], [0.2, 0.2], 50) == {
        "text": "x", "budget": [0.2, 0.2]}
    assert sl.body_for("deadline", "x", [0.8], [0.2], 50) == {"text": "x", "deadline_ms": 50}


def test_mixed_clients_at_a_middle_budget_average_to_it():
    """The "same mean budget" comparison: the diagonal budget nearest the midpoint of the
    full and the smallest, and closed-loop clients mixing the two whose mean is that
    budget's, spread so that every batch holds both."""
    sl = load_benchmark("serve_load")
    full, small = [1.0, 1.0], [0.2, 0.2]
    budgets = [full, [0.5, 0.5], [0.33, 0.33], small, [1.0, 0.5]]
    middle = sl.middle_budget(budgets, full, small)
    assert middle == [0.5, 0.5]
    mix = sl.mix_at(middle, full, small, 32)
    assert len(mix) == 32 and mix.count(full) == 12 and mix.count(small) == 20
    assert sum(sum(b) for b in mix) / 32 == pytest.approx(sum(middle), abs=0.05)
    assert all(full in mix[k: k + 3] for k in range(0, 30, 3))  # no long run of one kind
    assert sl.middle_budget([[0.8], [0.5], [0.33], [0.2]], [0.8], [0.2]) == [0.5]
    assert sl.mix_at([0.5], [0.8], [0.2], 32).count([0.8]) == 16
    assert sl.middle_budget([full, small, [1.0, 0.5]], full, small) is None
    with pytest.raises(ValueError, match="not between"):
        sl.mix_at([1.0, 1.0], full, small, 32)


def test_deadline_variants_run_side_by_side_after_the_other_policies():
    sl = load_benchmark("serve_load")
    assert sl.deadline_cells(["full", "deadline"], []) == [
        ("full", "full", []), ("deadline", "deadline", [])]
    assert sl.deadline_cells(["full", "deadline", "smallest"],
                             ["plain=", "u09=--max-utilization 0.9"]) == [
        ("full", "full", []), ("deadline", "deadline plain", []),
        ("deadline", "deadline u09", ["--max-utilization", "0.9"]),
        ("smallest", "smallest", [])]
    with pytest.raises(SystemExit, match="NAME=ARGS"):
        sl.deadline_cells(["deadline"], ["--max-utilization 0.9"])


def test_a_variant_may_run_the_server_of_another_checkout(tmp_path):
    sl = load_benchmark("serve_load")
    (tmp_path / "dynaseq").mkdir()
    (tmp_path / "dynaseq" / "__init__.py").write_text("")
    names = ["full", "deadline old", "deadline new"]
    assert sl.variant_sources([f"old={tmp_path}"], names) == {"deadline old": tmp_path}
    with pytest.raises(SystemExit, match="NAME a --deadline-variant"):
        sl.variant_sources([f"gone={tmp_path}"], names)
    with pytest.raises(SystemExit, match="holds no dynaseq package"):
        sl.variant_sources([f"old={tmp_path / 'dynaseq'}"], names)


def test_a_rates_cells_run_in_turn_and_back_over_the_rounds():
    sl = load_benchmark("serve_load")
    assert sl.interleaved(["a", "b", "c"], 1) == [(0, "a"), (0, "b"), (0, "c")]
    assert [c for _, c in sl.interleaved(["a", "b", "c"], 3)] == list("abccbaabc")
    assert [r for r, _ in sl.interleaved(["a", "b"], 2)] == [0, 0, 1, 1]
    with pytest.raises(SystemExit, match="--cell-rounds must be >= 1"):
        sl.interleaved(["a"], 0)


def test_a_row_of_several_rounds_shows_each_rounds_slo():
    sl = load_benchmark("serve_load")
    assert sl.slo_cell({"slo_attainment": 0.9}) == "0.9"
    assert sl.slo_cell({"slo_attainment": 0.9, "slo_by_round": [0.9]}) == "0.9"
    assert sl.slo_cell({"slo_attainment": 0.9, "slo_by_round": [0.95, 0.85]}) == (
        "0.9 (0.95, 0.85)")
