"""``dynaseq export``: a model directory that loads like its run, with bit-identical outputs,
for a translation model (dense, CCT with calibrated budgets, int8) and a language model."""

from __future__ import annotations

import json

import pytest

import dynaseq
from dynaseq.cli import main
from dynaseq.data import read_lines
from dynaseq.tasks.lm.predictor import LanguageModel
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.train.loop import train
from dynaseq.workflows.export import export_model
from dynaseq.workflows.quantize import quantize_run

from helpers import calibrated_cct, lm_config


def _no_paths(out, *path_fields: str) -> dict:
    payload = json.loads((out / "config.json").read_text())
    assert payload["format"] == "dynaseq-model" and payload["version"] == 1
    cfg = payload["config"]
    assert "run_dir" not in cfg and "train" not in cfg
    for name in path_fields:
        assert name not in cfg["data"], name
    return cfg


def test_exported_translation_model_is_bit_identical(trained_run, synthetic_paths, tmp_path,
                                                      capsys):
    out = tmp_path / "model"
    assert main(["export", str(trained_run), "--out", str(out)]) == 0
    capsys.readouterr()
    cfg = _no_paths(out, "train_src", "train_tgt", "valid_src", "valid_tgt")
    assert cfg["decode"] and cfg["data"]["vocab_size"]
    assert {"model.safetensors", "meta.json", "spm.model", "README.md"} <= {
        p.name for p in out.iterdir()}
    card = (out / "README.md").read_text()
    assert "## Validation scores" in card and "- optimiser: lr " in card
    again = tmp_path / "again"  # an exported model exported: its training was not kept
    assert main(["export", str(out), "--out", str(again)]) == 0
    capsys.readouterr()
    card = (again / "README.md").read_text()
    assert "- optimiser: not recorded" in card and "- data: not recorded" in card
    assert f"an exported model of `{trained_run}`" in card
    src = read_lines(synthetic_paths["valid.src"])[:24]
    ref = read_lines(synthetic_paths["valid.tgt"])[:24]
    a, b = Translator.load(trained_run), dynaseq.load(out)
    assert isinstance(b, Translator)
    assert b.translate(src, beam=2) == a.translate(src, beam=2)
    assert b.score(src, ref) == a.score(src, ref)
    # every command takes the directory: translate on the CLI as well
    (tmp_path / "in.txt").write_text("\n".join(src) + "\n")
    assert main(["translate", str(out), "-i", str(tmp_path / "in.txt"), "--beam", "2",
                 "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines() == a.translate(src, beam=2)
    # a second export into the same place, or into the run itself, is refused (exit 2)
    assert main(["export", str(trained_run), "--out", str(out)]) == 2
    assert main(["export", str(trained_run), "--out", str(trained_run / "m")]) == 2
    assert not (trained_run / "m").exists()


def test_exported_cct_keeps_its_calibrated_budgets(cct_run, synthetic_paths, tmp_path):
    run, t, src, ref = calibrated_cct(cct_run, synthetic_paths, tmp_path)
    out = tmp_path / "model"
    export_model(run, out)
    e = Translator.load(out)
    assert [c.budget for c in e.calibrations] == [c.budget for c in t.calibrations]
    per_row = [0.4, 1.0, 0.5, 0.4] * 4
    assert e.translate(src, budget=per_row) == t.translate(src, budget=per_row)
    assert e.realized_compute(src, ref, 0.4) == t.realized_compute(src, ref, 0.4)
    assert "calibrated (0.4, 0.4)" in (out / "README.md").read_text()


def test_exported_int8_model_is_bit_identical(trained_run, synthetic_paths, tmp_path):
    q = tmp_path / "int8"
    quantize_run(trained_run, q)
    out = tmp_path / "model"
    export_model(q, out)
    src = read_lines(synthetic_paths["valid.src"])[:16]
    assert Translator.load(out).translate(src) == Translator.load(q).translate(src)
    assert "weights: int8" in (out / "README.md").read_text()


def test_exported_language_model_is_bit_identical(tmp_path):
    cfg = lm_config(tmp_path, "model.cache={n_cache: 20, theta: 0.1, lam: 0.1}",
                    "train.max_steps=6")
    train(cfg, progress=False)
    run, out = tmp_path / "run", tmp_path / "model"
    export_model(run, out)
    _no_paths(out, "train", "valid", "test")
    a, b = LanguageModel.load(run), dynaseq.load(out)
    assert isinstance(b, LanguageModel)
    test = str(tmp_path / "test.txt")
    assert b.evaluate(test, with_cache=True) == a.evaluate(test, with_cache=True)
    assert b.generate("w1 w2", n_tokens=12, seed=5) == a.generate("w1 w2", n_tokens=12, seed=5)
    with pytest.raises(dynaseq.DynaseqError, match="no data.valid"):
        b.evaluate("valid")  # the model directory carries no data paths
