"""Refusals a new user's sweep of the command line found missing: outputs inside the run
directory, a new run over a trained model, beams and length penalties out of range, running
out of memory, overrides after the options, options a run kind would ignore, unreachable
calibrated budgets, exported layouts of another version. Each is one line and exit status
2, and leaves the files as they were."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from dynaseq.cli import main
from dynaseq.core.errors import DynaseqError
from dynaseq.core.run_lock import LOCK_FILE
from dynaseq.data import read_lines
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.workflows.export import export_model
from dynaseq.workflows.quantize import quantize_run

from helpers import calibrated_cct


def _snapshot(folder):
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def _status(argv: list[str]) -> int:
    """``main``'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code)


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture
def run_copy(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    return run


def test_outputs_inside_the_run_directory_are_refused(run_copy, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("kalo mintu\nsum 3 4\n")
    before = _snapshot(run_copy)
    for argv in (["translate", str(run_copy), "-i", str(src), "-o",
                  str(run_copy / "config.yaml")],
                 ["translate", str(run_copy), "-i", str(src), "-o",
                  str(run_copy / "best" / "new.txt")],
                 ["distill-data", str(run_copy), "--src", str(src), "--out",
                  str(run_copy / "spm.model")],
                 ["analyze", str(run_copy), "--src", str(src), "--out", str(run_copy)]):
        assert main(argv) == 2, argv
        assert f"is inside the run directory {run_copy}" in _err(capsys)
    assert _snapshot(run_copy) == before
    out = tmp_path / "analysis"
    out.mkdir()
    shutil.copy(src, out / "analysis.json")  # an input analyze would write over
    assert main(["analyze", str(run_copy), "--src", str(out / "analysis.json"), "--out",
                 str(out)]) == 2
    assert "is the input" in _err(capsys)
    assert read_lines(out / "analysis.json") == read_lines(src)


def test_a_new_run_over_a_trained_model_without_checkpoints_is_refused(run_copy, tmp_path,
                                                                       capsys):
    shutil.rmtree(run_copy / "checkpoints")
    before = _snapshot(run_copy)
    assert main(["train", str(run_copy / "config.yaml"), f"run_dir={run_copy}",
                 "model.d_model=16", "--quiet"]) == 2
    assert "holds a trained model (best/) but no checkpoint to resume from" in _err(capsys)
    assert _snapshot(run_copy) == before
    exported = tmp_path / "model"
    export_model(run_copy, exported)
    before = _snapshot(exported)
    assert main(["train", str(run_copy / "config.yaml"), f"run_dir={exported}", "--quiet"]) == 2
    assert "holds a trained model (model.safetensors)" in _err(capsys)
    assert _snapshot(exported) == before


def test_beams_and_length_penalties_out_of_range_are_one_line(trained_run, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("kalo mintu\n")
    vocab = Translator.load(trained_run).model.decoder.output_proj.out_features
    cases = {("--beam", str(vocab + 1)): f"wider than the target vocabulary ({vocab} tokens)",
             ("--length-penalty", "1000"): "length penalty must be within +-100",
             ("--length-penalty=-1e308", None): "length penalty must be within +-100"}
    for (flag, value), message in cases.items():
        assert _status(["translate", str(trained_run), "-i", str(src), flag,
                        *([value] if value else [])]) == 2
        assert message in _err(capsys)
    assert main(["translate", str(trained_run), "-i", str(src), "--beam", str(vocab),
                 "--length-penalty", "100", "-o", str(tmp_path / "out.txt")]) == 0
    assert len(read_lines(tmp_path / "out.txt")) == 1
    # greedy search has no use for the penalty; a config refuses one beam search cannot take
    assert main(["translate", str(trained_run), "-i", str(src), "--beam", "1",
                 "--length-penalty", "1000"]) == 0
    capsys.readouterr()
    assert _status(["train", str(trained_run / "config.yaml"), "--print-config",
                    "decode.length_penalty=101"]) == 2
    assert "decode.length_penalty must be within +-100 for model.max_positions 1024" in \
        _err(capsys)


def test_running_out_of_memory_is_one_line_and_other_errors_still_raise(trained_run, tmp_path,
                                                                        monkeypatch, capsys):
    src = tmp_path / "in.txt"
    src.write_text("kalo mintu\n")

    def fails(message):
        def translate(self, *args, **kwargs):
            raise RuntimeError(message)
        return translate

    monkeypatch.setattr(Translator, "translate", fails(
        "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
        "tried to allocate 96000000000 bytes. Error code 12 (Cannot allocate memory)"))
    assert main(["translate", str(trained_run), "-i", str(src)]) == 2
    assert _err(capsys) == ("dynaseq: error: out of memory (89.4 GiB at once): ask for "
                            "smaller sizes, batches or beams")
    monkeypatch.setattr(Translator, "translate", fails("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["translate", str(trained_run), "-i", str(src)])


def test_overrides_may_follow_the_options(trained_run, capsys):
    config = str(trained_run / "config.yaml")
    assert main(["train", config, "--print-config", "train.max_steps=7", "model.dropout=0.2"]
                ) == 0
    printed = capsys.readouterr().out
    assert "max_steps: 7" in printed and "dropout: 0.2" in printed
    assert _status(["train", config, "--print-config", "--nonsense", "train.max_steps=7"]) == 2
    assert _err(capsys) == "dynaseq: error: unrecognized arguments: --nonsense"
    assert _status(["translate", str(trained_run), "--beam", "2", "x=1"]) == 2
    assert "unrecognized arguments: x=1" in _err(capsys)


def test_options_a_run_kind_would_ignore_are_refused(trained_run, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("kalo mintu\n")
    missing = str(tmp_path / "no_run")  # checked before the run is read
    for argv, message in (
            (["prune", missing, "--out", str(tmp_path / "p"), "--sparsity", "0.4", "--lr",
              "-1"], "--lr must be > 0, got -1.0"),
            (["quantize", missing, "--out", str(tmp_path / "q"), "--lr", "0"],
             "--lr must be > 0, got 0.0"),
            (["quantize", str(trained_run), "--out", str(tmp_path / "q"), "--lr", "0.1"],
             "--bits, --steps and --lr are for language-model runs"),
            (["calibrate", str(trained_run), "--src", str(src), "--ref", str(src), "--data",
              str(src)], "--data is for classification runs")):
        assert _status(argv) == 2, argv
        assert message in _err(capsys)
    assert not (tmp_path / "q").exists() and not (tmp_path / "p").exists()


def test_an_evaluated_language_model_refuses_a_data_file(tmp_path, capsys):
    from dynaseq.train.loop import train

    from helpers import lm_config

    lm = lm_config(tmp_path, "train.max_steps=1")
    train(lm, progress=False)
    assert main(["evaluate", lm.run_dir, "--data", str(tmp_path / "x.txt")]) == 2
    assert "--data is for classification and MLM runs" in _err(capsys)
    for flag in ("--budget", "--keep-layers"):
        assert main(["profile", lm.run_dir, flag, "1"]) == 2
        assert (f"profile: {flag} is for translation and encoder runs; "
                f"{lm.run_dir} is a language model") in _err(capsys)
    for flag, runs in (("--src-len", "translation and encoder"), ("--tgt-len", "translation"),
                       ("--batch", "translation")):  # they were ignored
        assert main(["profile", lm.run_dir, flag, "3"]) == 2
        assert f"profile: {flag} is for {runs} runs" in _err(capsys)
    assert main(["serve", lm.run_dir, "--beam", "2"]) == 2  # refused before it listens
    assert "serve: --beam is for translation runs" in _err(capsys)


def test_average_and_serve_settings_refused_before_anything_is_written(run_copy, tmp_path,
                                                                      capsys):
    from dynaseq.serve.config import ServeConfig

    exported = tmp_path / "model"
    export_model(run_copy, exported)
    before = sorted(p.name for p in exported.iterdir())
    assert main(["average", str(exported), "-k", "1"]) == 2
    assert "no step checkpoints (checkpoints/step_*) to average" in _err(capsys)
    assert sorted(p.name for p in exported.iterdir()) == before  # no lock file either
    assert main(["average", str(run_copy), "-k", "100"]) == 0
    assert "averaged 2 checkpoints into" in (err := capsys.readouterr().err)
    assert err.rstrip().endswith("(-k 100: the run has 2)")
    with pytest.raises(DynaseqError, match="--max-batch-lines must be >= 1"):
        ServeConfig(max_batch_rows=0)
    src = tmp_path / "in.txt"
    src.write_text("kalo mintu\n")
    (tmp_path / "adir").mkdir()
    assert main(["distill-data", str(run_copy), "--src", str(src), "--out",
                 str(tmp_path / "adir")]) == 2
    assert "is a directory: give a file" in _err(capsys)


def test_an_unreachable_calibrated_budget_is_warned_about(cct_run, synthetic_paths, tmp_path,
                                                          capsys):
    run = tmp_path / "run"
    shutil.copytree(cct_run[0], run)
    args = ["calibrate", str(run), "--src", str(synthetic_paths["valid.src"]), "--ref",
            str(synthetic_paths["valid.tgt"]), "--lines", "8", "--budgets"]
    assert main([*args, "1e-9"]) == 0
    err = capsys.readouterr().err
    assert "dynaseq: warning: budget 1e-09, 1e-09 is out of reach: the closest realized " \
           "compute is" in err
    assert main([*args, "1"]) == 0
    assert "out of reach" not in capsys.readouterr().err


def test_a_quantized_cct_keeps_its_calibration(cct_run, synthetic_paths, tmp_path):
    run, t, _, _ = calibrated_cct(cct_run, synthetic_paths, tmp_path, lines=8)
    rep = quantize_run(run, tmp_path / "q")
    q = Translator.load(tmp_path / "q")
    assert rep.calibrated == 1
    assert [(c.budget, c.offsets) for c in q.calibrations] == [
        (c.budget, c.offsets) for c in t.calibrations]
    assert q.control_for(0.4) == t.control_for(0.4)


def test_exported_layouts_of_another_version_or_with_unknown_keys_are_refused(
        trained_run, tmp_path, capsys):
    out = tmp_path / "model"
    export_model(trained_run, out)
    payload = json.loads((out / "config.json").read_text())
    for changed, message in (({**payload, "version": 999},
                              "has layout version 999; this dynaseq reads version 1"),
                             ({**payload, "extra": 1}, "has unknown keys: extra")):
        (out / "config.json").write_text(json.dumps(changed))
        assert main(["translate", str(out), "-i", str(tmp_path / "none.txt")]) == 2
        assert message in _err(capsys)


def test_an_empty_saved_config_is_one_line(run_copy, tmp_path, capsys):
    (run_copy / "config.yaml").write_text("")
    assert main(["translate", str(run_copy), "-i", str(tmp_path / "none.txt")]) == 2
    assert _err(capsys) == f"dynaseq: error: {run_copy / 'config.yaml'} is empty"


def test_an_empty_run_dir_is_refused_not_the_working_directory(trained_run, tmp_path,
                                                               monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine\n")
    for args, message in ((["run_dir="], "run_dir must name a directory, got ''"),
                          (["run_dir= "], "run_dir: expected a string, got None"),
                          (["run_dir=''"], "run_dir must name a directory, got ''"),
                          (["--run-dir", ""], "run_dir must name a directory, got ''"),
                          (["--run-dir", " "], "run_dir must name a directory, got ''")):
        assert main(["train", str(trained_run / "config.yaml"), *args, "--quiet"]) == 2
        assert message in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    # --run-dir is a name as it is, never read as YAML (yes: a bool, 1: an int)
    assert main(["train", str(trained_run / "config.yaml"), "--run-dir", "yes",
                 "--print-config"]) == 0
    assert "run_dir: 'yes'" in capsys.readouterr().out


def test_an_empty_output_path_and_a_target_past_the_positions_are_refused(trained_run,
                                                                          cct_run, tmp_path,
                                                                          monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "in.txt"
    src.write_text("kalo sum 3 4 end\n")
    for args in (["translate", str(trained_run), "-i", str(src), "-o", ""],
                 ["analyze", str(cct_run[0]), "--src", str(src), "--out", ""]):
        assert main(args) == 2
        assert "an output path must not be empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]
    cfg = Translator.load(trained_run).config.model
    assert main(["profile", str(trained_run), "--src-len", "5", "--tgt-len",
                 str(cfg.max_positions), "--repeats", "1"]) == 2
    assert "(--src-len, or --tgt-len + 1 for the decoder's bos) exceed" in (
        capsys.readouterr().err)


def test_the_demo_refuses_a_run_directory_as_its_folder(trained_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    before = _snapshot(run)
    assert main(["demo", "--out", str(run)]) == 2
    assert "is a run or model directory (config.yaml)" in capsys.readouterr().err
    assert _snapshot(run) == before


def test_options_a_translation_evaluate_or_a_latency_table_would_ignore_are_refused(
        trained_run, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("kalo sum 3 4 end\n")
    assert main(["evaluate", str(trained_run), "--src", str(src), "--ref", str(src),
                 "--data", str(src)]) == 2
    assert "evaluate: --data is for classification and MLM runs" in capsys.readouterr().err
    assert main(["evaluate", str(trained_run), "--src", str(src), "--ref", str(src),
                 "--split", "test"]) == 2
    assert (f"evaluate: --split is for language-model and MLM runs; {trained_run} is a "
            "translation run") in capsys.readouterr().err
    assert main(["profile", str(trained_run), "--latency-table", "--src-len", "5"]) == 2
    assert "--table-batches; --src-len is for one profile" in capsys.readouterr().err
    assert main(["profile", str(trained_run), "--latency-table", "--budget", "0.5"]) == 2
    assert "--latency-table times every trained and calibrated budget" in (
        capsys.readouterr().err)


def test_branch_usage_is_for_branching_models(trained_run):
    with pytest.raises(DynaseqError, match="branch_usage is for DMB and MoE models; this is a "
                                           "dense model"):
        Translator.load(trained_run).branch_usage(["kalo end"], ["kalo end"])


def test_a_closed_standard_stream_is_one_line(trained_run, tmp_path, monkeypatch, capsys):
    """Started with standard output or input closed (cron, a daemon: Python's ``sys.stdout``
    is None), a command that needs it says so in one line (before: an AttributeError
    traceback); with ``-o``/``-i`` it runs."""
    src = tmp_path / "in.txt"
    src.write_text("kalo sum 3 4 end\n")
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["translate", str(trained_run), "-i", str(src), "--quiet"]) == 2
    assert "standard output is closed: give --output FILE" in capsys.readouterr().err
    assert main(["translate", str(trained_run), "-i", str(src), "-o",
                 str(tmp_path / "out.txt"), "--quiet"]) == 0
    assert (tmp_path / "out.txt").read_text().count("\n") == 1
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["translate", str(trained_run), "-o", str(tmp_path / "o2.txt")]) == 2
    assert "standard input is closed: give --input FILE" in capsys.readouterr().err
    assert not (tmp_path / "o2.txt").exists()
    assert main(["translate", str(trained_run), "--stream"]) == 2  # it takes no --input
    assert capsys.readouterr().err.strip() == "dynaseq: error: standard input is closed"


def test_an_empty_output_path_is_refused_before_anything_runs(trained_run, capsys):
    """``--out ""`` is the current folder to ``Path``: never what was meant."""
    for argv in (["export", str(trained_run), "--out", ""],
                 ["translate", str(trained_run), "-o", " "]):
        assert main(argv) == 2
        assert "an output path must not be empty" in capsys.readouterr().err


def test_the_shipped_model_is_never_written_into(tmp_path, capsys):
    """``calibrate`` and ``profile --latency-table`` on the model inside the package are
    refused before any work: a file there changed what ``dynaseq demo`` shows, outlived
    ``pip uninstall`` and, in a checkout, entered the next wheel."""
    from dynaseq.workflows.demo import DEMO_MODEL

    before = sorted(p.name for p in Path(DEMO_MODEL).iterdir())
    src = tmp_path / "in.txt"
    src.write_text("kalo sum 3 4 end\n")
    for argv, what in ((["calibrate", str(DEMO_MODEL), "--src", str(src), "--ref", str(src)],
                        "calibration.json"),
                       (["profile", str(DEMO_MODEL), "--latency-table"], "latency_table.json")):
        assert main(argv) == 2
        assert (f"is the model shipped with dynaseq, which is read only: write {what} into a "
                "copy (dynaseq export") in capsys.readouterr().err
    assert sorted(p.name for p in Path(DEMO_MODEL).iterdir()) == before


def test_a_folder_output_that_is_a_file_or_unwritable_names_the_output(run_copy, tmp_path,
                                                                      capsys):
    """The error line names ``--out`` as given: not its temporary sibling, not ``out/_``."""
    src = tmp_path / "in.txt"
    src.write_text("kalo mintu\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for argv, said in (
            (["analyze", str(run_copy), "--src", str(src), "--out", str(a_file)],
             f"the output {a_file} is a file: give a folder"),
            (["export", str(run_copy), "--out", str(a_file)],
             f"{a_file} is a file, not a folder")):
        assert main(argv) == 2, argv
        assert said in _err(capsys)
    assert a_file.read_text() == ""
    if os.path.isdir("/sys/kernel"):  # sysfs: nothing can be created there, even by root
        assert main(["export", str(run_copy), "--out", "/sys/exported"]) == 2
        err = _err(capsys)
        assert "cannot write /sys/exported" in err and ".tmp-" not in err, err
