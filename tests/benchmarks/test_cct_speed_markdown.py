"""benchmarks/cct_speed.py's table: each ratio beside the target it is held against (budget 1
against the dense model), the floor's figure named an estimate, not a limit."""

from __future__ import annotations

from helpers import load_benchmark


def test_each_ratio_sits_beside_its_own_target():
    cct_speed = load_benchmark("cct_speed")
    sec = {"score": 1.0, "beam4": 2.0, "beam4_fixed": 3.0}
    rows = [{"system": "cct 1,1", "seconds": sec, "budget": [1.0, 1.0],
             "ratio_to_cct_budget_1": {"score": 1.0, "beam4": 1.0, "beam4_fixed": 1.0},
             "ratio_to_dense": {"score": 1.015, "beam4": 1.2, "beam4_fixed": 1.02},
             "target": {"vs_dense": 1.10},
             "floor_estimate": {"score": 1.0, "beam4_fixed": 1.0}},
            {"system": "cct 0.5,0.5", "seconds": sec, "budget": [0.5, 0.5],
             "ratio_to_cct_budget_1": {"score": 0.674, "beam4": 0.8, "beam4_fixed": 0.7},
             "target": {"score": 0.6, "beam4": 0.75, "beam4_fixed": 0.75},
             "floor_estimate": {"score": 0.713, "beam4_fixed": 0.66}}]
    out = {"benchmark": "cct_speed", "command": "python benchmarks/cct_speed.py",
           "runs": {"cct": "a", "dense": "b"}, "machine": {}, "test_set": "t",
           "calibrated_budgets": [], "rows": rows,
           "cct_budget_1_time_over_dense": {"score": 1.015, "beam4": 1.2, "beam4_fixed": 1.02},
           "floor_all_gates_off": {"score": 0.4, "beam4_fixed": 0.3},
           "floor_output_layer_scoring": 0.35}
    text = "\n".join(cct_speed.markdown(out))
    assert "Amdahl" not in text and "limit" not in text
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert table[0] == ("| system | scoring ratio | target | estimate from floor | beam-4 ratio "
                        "| target | fixed-length beam-4 ratio | target (free beam's b + 0.25) "
                        "| estimate from floor | scoring s | beam-4 s | fixed s |")
    assert table[1] == ("| cct 1,1 | 1.0 (1.015× dense) | ≤ 1.1× dense | 1.0 | 1.0 (1.2× dense) "
                        "| ≤ 1.1× dense | 1.0 (1.02× dense) | ≤ 1.1× dense | 1.0 | 1.0 | 2.0 "
                        "| 3.0 |")
    assert table[2] == ("| cct 0.5,0.5 | 0.674 | 0.6 | 0.713 | 0.8 | 0.75 | 0.7 | 0.75 | 0.66 "
                        "| 1.0 | 2.0 | 3.0 |")
    assert "It is an estimate, not a bound" in text


def test_results_written_before_the_targets_were_named_are_upgraded_without_new_values():
    cct_speed = load_benchmark("cct_speed")
    sec = {"score": 1.0, "beam4": 2.0, "beam4_fixed": 3.0}
    old = {"rows": [
        {"system": "cct 1,1", "seconds": sec, "budget": [1.0, 1.0],
         "target": {"score": 1.1, "beam4": 1.25}, "amdahl_limit": {"score": 1.0}},
        {"system": "cct 0.33,0.33", "seconds": sec, "budget": [0.33, 0.33],
         "target": {"score": 0.43, "beam4": 0.58}, "amdahl_limit": {"score": 0.6}},
        {"system": "cct_x5 1,1", "seconds": sec, "budget": [1.0, 1.0],
         "target": {"score": 1.1, "beam4": 1.25}},
        {"system": "dense small", "seconds": sec}],
        "cct_budget_1_time_over_dense": {"score": 1.17},
        "variant_budget_1_time_over_dense": {"cct_x5": {"score": 1.2}}}
    cct, low, x5, dense = cct_speed.upgrade(old)["rows"]
    assert cct == {"system": "cct 1,1", "seconds": sec, "budget": [1.0, 1.0],
                   "target": {"vs_dense": 1.10}, "floor_estimate": {"score": 1.0},
                   "ratio_to_dense": {"score": 1.17}}
    assert low["target"] == {"score": 0.43, "beam4": 0.58, "beam4_fixed": 0.58}
    assert low["floor_estimate"] == {"score": 0.6} and "amdahl_limit" not in low
    assert x5["ratio_to_dense"] == {"score": 1.2} and x5["target"] == {"vs_dense": 1.10}
    assert dense == {"system": "dense small", "seconds": sec}
    assert cct_speed.upgrade(old)["rows"] == [cct, low, x5, dense]  # a second pass changes nothing


def test_committed_speed_results_name_the_estimate_and_each_target():
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    for name in ("cct_speed", "cct_speed_base", "cct_speed_big"):
        text = (results / f"{name}.md").read_text()
        assert "Amdahl" not in text and "estimate from floor" in text, name
        assert "amdahl" not in (results / f"{name}.json").read_text(), name
