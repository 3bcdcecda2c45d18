"""LM run -> new run: cache-search, prune, quantize (QAT) and their bad input."""

from __future__ import annotations

import json

import pytest
import torch

from dynaseq.cli import main
from dynaseq.compress.prune import prunable_parameters, sparsity_report
from dynaseq.compress.qat import check_representable
from dynaseq.tasks.lm.predictor import LanguageModel
from dynaseq.train.loop import train

from helpers import lm_config


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmrun")
    train(lm_config(tmp, "model.cache={n_cache: 20, theta: 0.1, lam: 0.1}"), progress=False)
    return tmp / "run"


def _one_line_error(capsys, *fragments: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("dynaseq: error:") and err.count("\n") == 1, err
    for f in fragments:
        assert f in err, err


def test_cache_search_writes_best_parameters(lm_run, tmp_path, capsys):
    out = tmp_path / "cs"
    assert main(["cache-search", str(lm_run), "--out", str(out), "--cache-sizes", "40",
                 "--max-evals", "12", "--valid-tokens", "300"]) == 0
    text = capsys.readouterr().out
    assert "before: ppl_cache" in text and "after:  ppl_cache" in text
    rep = json.loads((out / "cache_search.json").read_text())
    assert rep["after"]["ppl_cache"] <= rep["before"]["ppl_cache"]
    assert len(rep["evaluations"]) <= 12 and rep["valid_tokens"] <= 300 + 10
    lm = LanguageModel.load(out)
    assert lm.config.model.cache.n_cache == rep["after"]["n_cache"] == lm.model.cache.n_cache
    assert float(lm.model.cache.lam.detach()) == pytest.approx(rep["after"]["lam"], rel=1e-5)
    assert main(["cache-search", str(lm_run), "--out", str(out)]) == 2  # out exists
    _one_line_error(capsys, "already exists")


def test_cache_search_at_a_chosen_size_searches_only_that_size(lm_run, tmp_path, capsys):
    out = tmp_path / "cs7"
    assert main(["cache-search", str(lm_run), "--out", str(out), "--n-cache", "7",
                 "--max-evals", "6", "--valid-tokens", "200"]) == 0
    rep = json.loads((out / "cache_search.json").read_text())
    assert rep["before"]["n_cache"] == rep["after"]["n_cache"] == 7
    assert {e["n_cache"] for e in rep["evaluations"]} == {7}
    assert LanguageModel.load(out).model.cache.n_cache == 7
    capsys.readouterr()
    assert main(["cache-search", str(lm_run), "--out", str(tmp_path / "bad"), "--n-cache",
                 "0"]) == 2
    _one_line_error(capsys, "cache sizes must be >= 1")
    assert not (tmp_path / "bad").exists()


def test_prune_reaches_target_and_refuses_bad_sparsity(lm_run, tmp_path, capsys):
    for bad in ("1.0", "-0.1", "1.5"):
        assert main(["prune", str(lm_run), "--out", str(tmp_path / "bad"), "--sparsity",
                     bad]) == 2
        _one_line_error(capsys, "sparsity must be in [0, 1)")
        assert not (tmp_path / "bad").exists()
    before = sorted(p.name for p in lm_run.rglob("*"))
    out = tmp_path / "pruned"
    assert main(["prune", str(lm_run), "--out", str(out), "--sparsity", "0.4", "--steps", "6",
                 "--grid", "0,0.2,0.4,0.6,0.8", "--valid-tokens", "200", "--quiet"]) == 0
    assert sorted(p.name for p in lm_run.rglob("*")) == before  # RUN_DIR untouched
    rep = json.loads((out / "prune_report.json").read_text())
    assert rep["achieved_sparsity"] >= 0.4 and rep["steps"] == 6
    assert set(rep["curves"]) == set(rep["per_matrix_targets"])
    lm = LanguageModel.load(out)  # plain state dict with zeros
    names = prunable_parameters(lm.model)
    assert sparsity_report(lm.model, names).overall == pytest.approx(rep["achieved_sparsity"])
    assert not any(".parametrizations." in k for k in lm.model.state_dict())
    assert not list(tmp_path.glob(".tmp-*"))


def test_prune_reuses_sensitivity_curves_of_an_earlier_report(lm_run, tmp_path, capsys):
    """--sensitivity skips the sweep: same curves, so the same plan for the same target,
    and a new plan for another target; a report of another model or none is refused."""
    first = tmp_path / "p40"
    assert main(["prune", str(lm_run), "--out", str(first), "--sparsity", "0.4",
                 "--grid", "0,0.3,0.6,0.9", "--valid-tokens", "200", "--quiet"]) == 0
    rep1 = json.loads((first / "prune_report.json").read_text())
    again = tmp_path / "p40b"
    assert main(["prune", str(lm_run), "--out", str(again), "--sparsity", "0.4", "--steps",
                 "2", "--sensitivity", str(first / "prune_report.json"), "--quiet"]) == 0
    rep2 = json.loads((again / "prune_report.json").read_text())
    assert rep2["curves"] == rep1["curves"] and rep2["grid"] == [0.3, 0.6, 0.9]
    assert rep2["per_matrix_targets"] == rep1["per_matrix_targets"]
    assert rep2["sensitivity_from"] == str(first / "prune_report.json")
    lower = tmp_path / "p20"
    assert main(["prune", str(lm_run), "--out", str(lower), "--sparsity", "0.2",
                 "--sensitivity", str(first / "prune_report.json"), "--quiet"]) == 0
    assert json.loads((lower / "prune_report.json").read_text())["achieved_sparsity"] < 0.4
    capsys.readouterr()
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**rep1, "curves": {"x.weight": [[0, 1.0]]}}))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    for path, msg in ((wrong, "do not match"), (garbage, "not a prune report"),
                      (tmp_path / "missing.json", "not a prune report")):
        assert main(["prune", str(lm_run), "--out", str(tmp_path / "bad"), "--sparsity",
                     "0.4", "--sensitivity", str(path)]) == 2
        _one_line_error(capsys, "--sensitivity", msg)
        assert not (tmp_path / "bad").exists()


def test_prune_distills_from_the_unpruned_model(lm_run, tmp_path, capsys):
    """--distill: the fine-tuning loss is (1−λ)·hard + λ·soft with the run's own top-k;
    the new run's config stays without distillation."""
    topk = tmp_path / "top5"
    assert main(["distill-data", str(lm_run), "--out", str(topk), "--k", "5"]) == 0
    out = tmp_path / "p30kd"
    assert main(["prune", str(lm_run), "--out", str(out), "--sparsity", "0.3", "--steps", "3",
                 "--grid", "0.3,0.6", "--valid-tokens", "200", "--distill", str(topk),
                 "--quiet"]) == 0
    assert json.loads((out / "prune_report.json").read_text())["distill_from"] == str(topk)
    last = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()
            if '"train"' in line][-1]
    assert last["step"] == 3 and last["soft"] > 0 and 0.05 <= last["distill_lambda"] <= 0.5
    assert LanguageModel.load(out).config.train.distill is None
    capsys.readouterr()
    assert main(["prune", str(lm_run), "--out", str(tmp_path / "bad"), "--sparsity", "0.3",
                 "--steps", "2", "--grid", "0.3", "--valid-tokens", "200", "--distill",
                 str(tmp_path)]) == 2
    _one_line_error(capsys, "not a teacher top-k directory")
    assert not (tmp_path / "bad").exists()


def test_prune_at_sparsity_zero_is_dense_fine_tuning(lm_run, tmp_path):
    """The fair control for pruning: the same updates, nothing pruned, no sensitivity sweep
    (one validation pass for the baseline, none per matrix and sparsity)."""
    out = tmp_path / "control"
    assert main(["prune", str(lm_run), "--out", str(out), "--sparsity", "0", "--steps", "4",
                 "--valid-tokens", "200", "--quiet"]) == 0
    rep = json.loads((out / "prune_report.json").read_text())
    assert rep["achieved_sparsity"] == 0.0 and rep["steps"] == 4
    assert all(len(curve) == 1 for curve in rep["curves"].values())
    assert set(rep["per_matrix_targets"].values()) == {0.0}
    before = LanguageModel.load(lm_run).model.state_dict()
    after = LanguageModel.load(out).model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it did train


def test_quantize_lm_keeps_zeros_and_reloads_exact(lm_run, tmp_path, capsys):
    for bad in ("1", "17"):
        assert main(["quantize", str(lm_run), "--out", str(tmp_path / "bad"), "--bits",
                     bad]) == 2
        _one_line_error(capsys, "2..16")
        assert not (tmp_path / "bad").exists()
    pruned = tmp_path / "pruned"
    assert main(["prune", str(lm_run), "--out", str(pruned), "--sparsity", "0.3",
                 "--grid", "0.3,0.6", "--valid-tokens", "200"]) == 0  # one shot
    zeros = sparsity_report(LanguageModel.load(pruned).model).zeros
    out = tmp_path / "q9"
    assert main(["quantize", str(pruned), "--out", str(out), "--bits", "9", "--steps", "4",
                 "--quiet"]) == 0
    lm = LanguageModel.load(out)
    assert lm.config.model.qat_bits == 9
    rep = check_representable(lm.model, 9)
    assert rep.ok, rep.failures
    assert all(m["max_distinct_per_scale"] <= 2 ** 9 for m in rep.modules.values())
    assert sparsity_report(lm.model).zeros >= zeros  # pruned zeros kept
    ppl = lm.evaluate("valid")["ppl"]
    assert ppl == pytest.approx(json.loads((out / "quantize_report.json").read_text())
                                ["valid_ppl_after"], rel=1e-6)
    rep9 = json.loads((out / "quantize_report.json").read_text())
    assert [s for s, _ in rep9["valid_curve"]] == [1, 2, 3, 4]  # validated every step
    assert rep9["valid_ppl_after"] <= rep9["valid_ppl_calibrated"] * (1 + 1e-6)
    wild = tmp_path / "q9wild"  # a destructive lr: no step beats the calibrated start
    assert main(["quantize", str(pruned), "--out", str(wild), "--bits", "9", "--steps", "3",
                 "--lr", "3", "--quiet"]) == 0
    repw = json.loads((wild / "quantize_report.json").read_text())
    assert repw["kept_step"] == 0
    assert min(p for _, p in repw["valid_curve"]) > repw["valid_ppl_calibrated"]
    assert repw["valid_ppl_after"] == pytest.approx(repw["valid_ppl_calibrated"], rel=1e-5)
    assert sparsity_report(LanguageModel.load(wild).model).zeros >= zeros
    q3 = tmp_path / "q3"  # no fine-tuning: calibrate and convert
    assert main(["quantize", str(pruned), "--out", str(q3), "--bits", "3"]) == 0
    for m in LanguageModel.load(q3).model.modules():
        if hasattr(m, "weight_scale") and isinstance(m, torch.nn.Linear):
            k = torch.round(m.weight / m.weight_scale.view(-1, 1))
            assert all(torch.unique(row).numel() <= 2 ** 3 for row in k)
    assert main(["quantize", str(out), "--out", str(tmp_path / "again")]) == 2
    _one_line_error(capsys, "already quantized")
