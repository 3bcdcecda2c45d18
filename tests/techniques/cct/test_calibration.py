"""Budget calibration: gate threshold offsets that make a budget's realized compute meet it."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import dynaseq
from dynaseq.core.errors import DynaseqError
from dynaseq.techniques.cct.calibration import _Meter, _solve, calibrate_budget, nearest_control
from dynaseq.techniques.cct.gating import ALL_GATES_ON, BudgetControl, Gate
from dynaseq.techniques.cct.layers import force_gates, realized_fraction

from helpers import lm_config, run_cli


@pytest.fixture
def run_copy(cct_run, tmp_path):
    """A private copy of the shared CCT run (calibration writes into the run directory)."""
    run, _ = cct_run
    return shutil.copytree(run, tmp_path / "run")


def _one_at_a_time(t, src, ref):
    """``(src (1, S), tgt_in (1, T))`` of each pair, in line order (batch 1)."""
    one = sorted(t._pair_batches(src, ref, 1), key=lambda b: int(b[2]))
    return [(s, tgt) for s, tgt, _ in one]


def _lines(paths, split: str, n: int) -> tuple[list[str], list[str]]:
    src = paths[f"{split}.src"].read_text().splitlines()[:n]
    return src, paths[f"{split}.tgt"].read_text().splitlines()[:n]


def test_gate_offset_moves_the_inference_threshold_only():
    gate = Gate().eval()
    logits = torch.tensor([-2.0, -0.5, 0.0, 1.0])
    assert gate(logits).tolist() == [0, 0, 1, 1]
    assert gate(logits, 1.0).tolist() == [0, 1, 1, 1]
    assert gate(logits, -1.5).tolist() == [0, 0, 0, 0]
    # one offset per row (B,), broadcast over the row's tokens and gates
    rows = torch.stack([logits, logits, logits])[:, :, None]  # (B=3, T=4, 1)
    per_row = gate(rows, torch.tensor([0.0, 1.0, -1.5]))[..., 0].tolist()
    assert per_row == [[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0]]
    gate.train()  # training: noisy soft gates, no offset (α = 0 at step 0: σ(logits))
    torch.testing.assert_close(gate(logits, 1.0), torch.sigmoid(logits))


def test_offset_extremes_equal_forced_gates_and_leave_the_model_alone(cct_run):
    run, _ = cct_run
    model = dynaseq.load(run).model
    src, tgt = torch.tensor([[5, 6, 7, 8, 3]]), torch.tensor([[2, 9, 10, 11]])
    with torch.no_grad():
        for offset, forced in ((1e9, 1.0), (-1e9, 0.0), (float("inf"), 1.0)):
            shifted = model(src, tgt, BudgetControl(1, {"encoder": offset,
                                                        "decoder": offset})).logits
            with force_gates(model, forced):
                pinned = model(src, tgt, 1).logits
            torch.testing.assert_close(shifted, pinned, rtol=0, atol=0)
        # a decoder offset leaves the encoder's gates as they are
        plain = model.encode(src, 1)
        shifted = model.encode(src, BudgetControl(1, {"decoder": 1e9}))
        torch.testing.assert_close(shifted.out, plain.out, rtol=0, atol=0)
        assert shifted.gate_offset.tolist() == [1e9] and plain.gate_offset is None
    assert not any(hasattr(m, "offset") for m in model.modules() if isinstance(m, Gate))
    with pytest.raises(ValueError, match=r"no gates in sub-network\(s\) \['middle'\]"):
        model(src, tgt, BudgetControl(1, {"middle": 1.0}))
    with pytest.raises(ValueError, match=r"one per row, shape \(1,\), got \(2,\)"):
        model(src, tgt, BudgetControl(1, {"encoder": torch.zeros(2)}))


def test_solve_brackets_and_bisects_a_step_function():
    calls = []

    def f(x: float) -> float:  # fraction of 100 evenly spread logits opened at offset x
        calls.append(x)
        return sum(1 for i in range(100) if (i - 50) / 10 + x >= 0) / 100

    x, fx = _solve(f, 0.3, tol=0.005, max_calls=30)
    assert fx == 0.3 and f(x) == 0.3
    calls.clear()
    x, fx = _solve(f, 0.503, tol=0.005, max_calls=30)
    assert x == 0.0 and fx == 0.5 and calls == [0.0]  # already within tol: no search
    calls.clear()
    x, fx = _solve(f, 0.3, tol=0.005, max_calls=4)
    assert len(calls) == 4  # stops at max_calls with the best point seen
    assert abs(fx - 0.3) == min(abs(f(c) - 0.3) for c in calls[:4])


def test_calibration_meets_the_budget_on_its_data(cct_run, synthetic_paths):
    run, _ = cct_run
    t = dynaseq.load(run)
    src, ref = _lines(synthetic_paths, "valid", 40)
    pairs = _one_at_a_time(t, src, ref)
    cal = calibrate_budget(t.model, pairs, control=1, budget=(0.5, 0.4), tol=0.01,
                           max_calls=24)
    assert abs(cal.realized["encoder"] - 0.5) <= 0.02
    assert abs(cal.realized["decoder"] - 0.4) <= 0.02
    # the offsets, passed the way inference passes them, reproduce the reported fractions
    frac = realized_fraction(t.model, pairs, control=cal.control_for())["fraction"]
    assert frac["encoder"] == pytest.approx(cal.realized["encoder"], abs=1e-4)
    assert frac["decoder"] == pytest.approx(cal.realized["decoder"], abs=1e-4)
    with pytest.raises(ValueError, match="an \\(encoder, decoder\\) pair of fractions"):
        calibrate_budget(t.model, pairs, control=1, budget=(0.0, 0.5))


def test_batched_calibration_counts_what_one_pair_at_a_time_counts(cct_run, synthetic_paths):
    """Translator.calibrate's padded batches count each pair over its own tokens: the same
    fractions at every offset it tries, so the same offsets, as one pair at a time."""
    run, _ = cct_run
    t = dynaseq.load(run)
    src, ref = _lines(synthetic_paths, "valid", 40)
    one = t.calibrate(src, ref, budgets=[(0.5, 0.4), 0.7], tol=0.01, batch_size=1)
    t.calibrations = []
    batched = t.calibrate(src, ref, budgets=[(0.5, 0.4), 0.7], tol=0.01, batch_size=16)
    for a, b in zip(one, batched, strict=True):
        assert a.offsets == b.offsets and a.realized == b.realized
        assert a.uncalibrated == b.uncalibrated
    opened = BudgetControl(1, {"encoder": ALL_GATES_ON, "decoder": ALL_GATES_ON})
    pairs = _one_at_a_time(t, src, ref)
    batches = t._pair_batches(src, ref, 16)
    assert t._macs_ran(batches, opened) == _Meter(t.model, pairs, 1).full  # every gate open
    # the realized compute evaluate reports: batched as one pair at a time
    t.calibrations = batched
    for budget in (None, 0.5, 0.7):
        want = realized_fraction(t.model, pairs, t.control_for(budget))
        assert t.realized_compute(src, ref, budget, batch_size=16) == want
    per_line = [(0.5, 0.7, None)[i % 3] for i in range(len(src))]  # each pair its own
    rows = t.control_for(per_line, len(src))
    want = realized_fraction(t.model, pairs, [rows.select(torch.tensor([i]))
                                              for i in range(len(src))])
    assert t.realized_compute(src, ref, per_line, batch_size=16) == want
    with pytest.raises(DynaseqError, match="batch_size must be an integer >= 1, got 0"):
        t.calibrate(src, ref, budgets=[0.7], batch_size=0)


def test_nearest_control():
    trained = [(1.0, 1.0), (0.5, 0.5), (1.0, 0.33)]
    assert nearest_control(trained, (0.6, 0.6)) == 1
    assert nearest_control(trained, (1.0, 0.4)) == 2
    assert nearest_control(trained, (0.75, 0.75)) == 0  # a tie goes to the larger budget


def test_calibrated_budgets_are_saved_reloaded_and_used(run_copy, synthetic_paths):
    t = dynaseq.load(run_copy)
    src, ref = _lines(synthetic_paths, "valid", 30)
    lines = synthetic_paths["test.src"].read_text().splitlines()[:3]
    with pytest.raises(DynaseqError, match=r"was not trained; .* \(dynaseq calibrate --budgets "
                                           r"0.7,0.7 can fit it\)"):
        t.translate(lines, budget=0.7)
    fitted = t.calibrate(src, ref, budgets=[0.7, (1.0, 0.33)], tol=0.02)
    assert [c.budget for c in fitted] == [(0.7, 0.7), (1.0, 0.33)]
    assert [c.control for c in fitted] == [1, 2]  # nearest trained (0.5, 0.5); its own
    t.save_calibration(run_copy, {"lines": 30})
    again = dynaseq.load(run_copy)
    assert again.calibrations == t.calibrations
    control, cal = again.budget_setting(0.7)
    assert control == 1 and cal.offsets == fitted[0].offsets
    assert len(again.translate(lines, budget=0.7)) == 3
    with again.at_budget((1.0, 0.33)) as control:  # the offsets travel with the call
        assert control.ids == 2
        assert control.offsets["decoder"] == fitted[1].offsets["decoder"]
    # the encoder's budget of 1 opens every encoder gate, whatever its fitted offset
    assert again.control_for((1.0, 0.33)) == BudgetControl(
        2, {"encoder": ALL_GATES_ON, "decoder": fitted[1].offsets["decoder"]})
    assert again.budget_setting(0.5) == (1, None)  # trained, not calibrated: no offsets
    assert again.control_for(0.5) == 1
    assert again.control_for(1.0) == again.control_for() == BudgetControl(
        0, {"encoder": ALL_GATES_ON, "decoder": ALL_GATES_ON})
    with pytest.raises(DynaseqError, match=r"was not trained; .*calibrated: \(0.7, 0.7\)"):
        again.translate(lines, budget=0.9)
    # the evaluation reports what it ran with
    res = again.evaluate(src[:5], ref[:5], beam=1, budget=0.7)
    assert res["budget"] == [0.7, 0.7] and res["gate_offsets"] == fitted[0].offsets


def test_a_calibration_of_another_checkpoint_is_not_used(run_copy, synthetic_paths):
    t = dynaseq.load(run_copy)
    src, ref = _lines(synthetic_paths, "valid", 10)
    t.calibrate(src, ref, budgets=[0.7], tol=0.05)
    path = t.save_calibration(run_copy)
    payload = json.loads(path.read_text())
    payload["checkpoint"] = "checkpoints/step_00000004"
    path.write_text(json.dumps(payload))
    with pytest.warns(UserWarning, match="was made for checkpoint checkpoints/step_00000004"):
        again = dynaseq.load(run_copy)
    assert again.calibrations == []
    path.write_text("{not json")
    with pytest.raises(DynaseqError, match="is not a calibration file"):
        dynaseq.load(run_copy)
    # saved elsewhere than a run or model directory: refused, nothing written or made
    with pytest.raises(DynaseqError, match="run directory not found"):
        t.save_calibration(run_copy.parent / "new_dir")
    with pytest.raises(DynaseqError, match="no config.yaml"):
        t.save_calibration(run_copy / "checkpoints")
    assert not (run_copy.parent / "new_dir").exists()
    assert not (run_copy / "checkpoints" / "calibration.json").exists()
    # a hand-edited file: a NaN offset or a budget outside (0, 1] is refused at load (before,
    # every later call at that budget failed deep inside, the file unnamed)
    for key, value, words in (("offsets", {"encoder": math.nan, "decoder": 0.1}, "NaN"),
                              ("budget", [5, -1], r"\[5.0, -1.0\] is not fractions")):
        path.write_text(json.dumps({**payload, "budgets": [{**payload["budgets"][0],
                                                             key: value}]}))
        with pytest.raises(DynaseqError, match=f"{path}.* is not a calibration file.*{words}"):
            dynaseq.load(run_copy)


def test_a_calibration_of_weights_rewritten_since_is_not_used(run_copy, synthetic_paths):
    """Training on (or ``dynaseq average``) rewrites ``best/`` / ``averaged/`` in place: the
    same checkpoint name, other weights. Offsets fitted on the old ones are ignored."""
    import torch

    from dynaseq.core.checkpoint import read_meta, write_checkpoint

    t = dynaseq.load(run_copy)
    src, ref = _lines(synthetic_paths, "valid", 10)
    t.calibrate(src, ref, budgets=[0.7], tol=0.05)
    t.save_calibration(run_copy)
    assert len(dynaseq.load(run_copy).calibrations) == 1  # the same weights: used
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(1e-3)
    write_checkpoint(t.checkpoint, t.model, read_meta(t.checkpoint))
    with pytest.warns(UserWarning, match="was fitted on other weights of checkpoint "):
        again = dynaseq.load(run_copy)
    assert again.calibrations == []
    # rewritten while a calibration was being fitted (a training run replacing the
    # checkpoint): saving it is refused, not tied to weights it was not fitted on
    again.calibrate(src, ref, budgets=[0.7], tol=0.05)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(1e-3)
    write_checkpoint(t.checkpoint, t.model, read_meta(t.checkpoint))
    with pytest.raises(DynaseqError, match="was rewritten .* after it was loaded: its "
                                           "calibration would not fit it; calibrate again"):
        again.save_calibration(run_copy)


def test_two_calibrations_of_one_run_at_once_are_refused(run_copy, synthetic_paths, capsys):
    """The second ``calibrate`` of a run is refused in one line while the first holds the
    run's calibration lock (two at once each wrote what they had read plus their own
    budgets: one's were lost)."""
    from dynaseq.cli import main
    from dynaseq.core.run_lock import CALIBRATE_LOCK, RunDirLock

    args = ["calibrate", str(run_copy), "--src", str(synthetic_paths["valid.src"]), "--ref",
            str(synthetic_paths["valid.tgt"]), "--lines", "8", "--budgets", "0.7", "--quiet"]
    assert main(args[:4]) == 2  # no --ref: refused, and not even the lock's file written
    assert "--src and --ref are required" in capsys.readouterr().err
    assert not (run_copy / CALIBRATE_LOCK).exists()
    with RunDirLock(run_copy, CALIBRATE_LOCK, "calibrated"):
        assert main(args) == 2
        assert "is being calibrated by another process" in capsys.readouterr().err
        assert not (run_copy / "calibration.json").exists()
    assert main(args) == 0
    assert (run_copy / "calibration.json").exists()


def test_calibrate_refuses_a_language_model_run(tmp_path, synthetic_paths):
    from dynaseq.core.config import save_config

    run = tmp_path / "run"
    run.mkdir()
    save_config(lm_config(tmp_path), run / "config.yaml")
    proc = run_cli("calibrate", str(run), "--src", str(synthetic_paths["valid.src"]), "--ref",
                   str(synthetic_paths["valid.tgt"]))
    assert proc.returncode == 2 and proc.stderr.count(b"\n") == 1, proc.stderr
    assert (b"is a language-model run; calibrate takes translation or classification runs"
            in proc.stderr)


def _no_constant(name: str):
    raise ValueError(f"not JSON: {name}")


def test_calibrate_command(run_copy, synthetic_paths, trained_run):
    src, ref = str(synthetic_paths["valid.src"]), str(synthetic_paths["valid.tgt"])
    proc = run_cli("calibrate", str(run_copy), "--src", src, "--ref", ref, "--lines", "20",
                   "--tol", "0.02")
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode().splitlines()
    assert out[0].startswith("budget (enc, dec)") and len(out) == 4  # the 3 trained budgets
    payload = json.loads((run_copy / "calibration.json").read_text())
    assert [b["budget"] for b in payload["budgets"]] == [[1.0, 1.0], [0.5, 0.5], [1.0, 0.33]]
    assert payload["data"]["lines"] == 20
    proc = run_cli("evaluate", str(run_copy), "--src", src, "--ref", ref, "--json",
                   "--beam", "1", "--budget", "0.5")
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["gate_offsets"] == payload["budgets"][1]["offsets"]
    proc = run_cli("evaluate", str(run_copy), "--src", src, "--ref", ref, "--json",
                   "--beam", "1", "--budget", "1")
    assert proc.returncode == 0, proc.stderr.decode()  # strict JSON: a budget of 1 is open
    assert json.loads(proc.stdout, parse_constant=_no_constant)["gate_offsets"] == {
        "encoder": "+inf", "decoder": "+inf"}
    for args, message in (
            ([str(trained_run)], b"this is a dense model, which has no compute-budget knob"),
            ([str(run_copy), "--budgets", "1.5"], b"a budget is a fraction in (0, 1]"),
            ([str(run_copy), "--ref", src + ".missing"], b"dynaseq: error:")):
        cmd = ["calibrate", *args[:1], "--src", src, "--ref", ref, *args[1:]]
        proc = run_cli(*cmd)
        assert proc.returncode == 2 and proc.stderr.count(b"\n") == 1, proc.stderr
        assert message in proc.stderr and b"Traceback" not in proc.stderr


def test_analyze_runs_a_calibrated_budget_with_its_offsets(run_copy, synthetic_paths):
    from dynaseq.workflows.analyze import analyze

    t = dynaseq.load(run_copy)
    src, ref = _lines(synthetic_paths, "valid", 12)
    with pytest.raises(DynaseqError, match="was not trained"):
        analyze(t, src, ref, budgets=[0.7])
    (fitted,) = t.calibrate(src, ref, budgets=[0.7], tol=0.02)
    result = analyze(t, src, ref, budgets=[0.7, 0.5])
    calibrated, trained = result["budgets"]
    assert calibrated["budget"] == [0.7, 0.7] and calibrated["control"] == 1
    assert calibrated["gate_offsets"] == fitted.offsets
    assert trained["budget"] == [0.5, 0.5] and trained["gate_offsets"] is None
    # same control symbol, other thresholds: the gates the analysis saw differ
    assert fitted.offsets != {"encoder": 0.0, "decoder": 0.0}
    assert calibrated["gated_fraction"] != trained["gated_fraction"]
