"""benchmarks/batch1_latency.py's trained-CCT rows: every trained (b, b) budget timed as
``translate --budget b`` runs it, beside the floor's estimate, and the markdown shows them."""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq

from helpers import load_benchmark


def test_trained_cct_rows_time_each_budget_against_budget_1(cct_run, monkeypatch):
    b1 = load_benchmark("batch1_latency")
    monkeypatch.setattr(b1, "SRC_LEN", 4)
    monkeypatch.setattr(b1, "TGT_LEN", 3)
    monkeypatch.setattr(b1, "SETTLE_S", 0.0)
    dense = build_seq2seq(ModelConfig(d_model=16, ffn_dim=32, n_heads=2, encoder_layers=1,
                                      decoder_layers=1), 40).eval()
    monkeypatch.setattr(b1, "build_dense_like", lambda size: dense)
    run, _ = cct_run
    args = Namespace(cct_run=str(run), batches=[1], rounds=1, repeats=1)
    rows = b1.trained_cct_rows(args)
    assert [(r["batch"], r["search"]) for r in rows] == [(1, "greedy"), (1, "beam4")]
    for r in rows:  # the run's (b, b) budgets: 1 and 0.5 ((1, 0.33) is not one)
        assert set(r["ms"]) == {"dense lean", "floor", "floor, no decisions", "b=1", "b=0.5"}
        assert r["ratio"]["1"] == 1.0 and r["estimate"]["1"] == 1.0
        # (from the unrounded floors)
        assert r["estimate"]["0.5"] == pytest.approx(r["floor"] + 0.5 * (1 - r["floor"]),
                                                     abs=1e-3)
        bare = r["floor_no_decisions"]
        assert r["estimate_no_decisions"]["0.5"] == pytest.approx(bare + 0.5 * (1 - bare),
                                                                  abs=1e-3)
        assert r["above_estimate"]["0.5"] == pytest.approx(
            r["ratio"]["0.5"] - r["estimate"]["0.5"], abs=1e-9)
    made_by = {"command": "c", "commit": "abc", "dirty": False, "date": "d", "machine": {},
               "rounds": 1, "repeats": 1}
    lines = b1.cct_markdown({"made_by": made_by, "rows": [], "trained_run": str(run),
                             "trained": rows})
    table = [line for line in lines if line.startswith("| 1 |")]
    assert len(table) == 2 and all(
        f"{r['ratio']['0.5']} ({r['estimate']['0.5']}; {r['above_estimate']['0.5']:+})" in line
        for r, line in zip(rows, table, strict=True))


def test_the_floor_runs_the_control_nets_and_the_bare_floor_does_not(cct_run):
    """The floor the target is held against is every gate closed *by its control net*, as
    ``cct_speed`` measures it (the control nets run, as at any budget below 1); the bare
    floor (offset -inf) decides nothing. Both close every gate, so they translate alike;
    the floor runs more matrix-product FLOPs (its control nets), through the lean step."""
    from torch.utils.flop_counter import FlopCounterMode

    from dynaseq.models.lean import LeanDecoder
    from dynaseq.tasks.translation.predictor import Translator
    from dynaseq.techniques.cct.gating import BudgetControl

    b1 = load_benchmark("batch1_latency")
    run, _ = cct_run
    model = Translator.load(run, device="cpu").model
    lean = LeanDecoder.prepare(model)
    src = torch.tensor([[5, 6, 7, 8, model.eos_id]])
    out, flops = {}, {}
    for name, off in (("floor", b1.FLOOR_OFFSET), ("bare", b1.BARE_OFFSET)):
        control = BudgetControl(0, {"encoder": off, "decoder": off})
        with FlopCounterMode(display=False) as counter:
            out[name] = b1.greedy_search(lean, src, control=control, max_len_a=0.0,
                                         max_len_b=4, min_len=3)
        flops[name] = counter.get_total_flops()
    assert out["floor"] == out["bare"]
    assert flops["floor"] > flops["bare"] > 0


def test_only_a_section_without_the_results_it_updates_is_refused(tmp_path):
    """``--only cct`` keeps the other sections as committed: with no results file there it
    is refused before measuring (it used to time every budget for minutes, then fail on the
    missing sections), and writes nothing."""
    script = Path(__file__).parents[2] / "benchmarks" / "batch1_latency.py"
    r = subprocess.run([sys.executable, str(script), "--only", "cct", "--results",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "does not exist" in r.stderr.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []
