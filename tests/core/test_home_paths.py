"""A leading ``~`` in a config or a Python call is the home directory, as on a command line."""

from __future__ import annotations

import shutil

import dynaseq
from dynaseq.core.files import user_path
from dynaseq.data import read_lines

from helpers import micro_config


def test_user_path_expands_a_leading_tilde_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_path("~/runs/x") == tmp_path / "runs" / "x"
    assert user_path("~") == tmp_path
    assert str(user_path("runs/~x")) == "runs/~x"
    assert str(user_path("~no_such_user_here/x")) == "~no_such_user_here/x"  # no home: as is


def test_a_run_dir_under_tilde_trains_in_the_home_directory_and_loads_from_there(
        tmp_path, monkeypatch, synthetic_paths):
    from dynaseq.train.loop import train

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    shutil.copy(synthetic_paths["valid.src"], home / "valid.src")
    paths = {**synthetic_paths, "valid.src": "~/valid.src"}  # a data file under ~ too
    cfg = micro_config("~/runs/micro", paths, max_steps=2, valid_every=2, save_every=2,
                       valid_bleu_lines=4)
    result = train(cfg, progress=False)
    assert result.run_dir == home / "runs" / "micro"
    assert (home / "runs" / "micro" / "config.yaml").is_file()
    assert not (cwd / "~").exists()  # before: a folder named "~" in the working directory
    t = dynaseq.load("~/runs/micro")
    assert t.translate(["a b"]) == dynaseq.load(home / "runs" / "micro").translate(["a b"])
    assert read_lines("~/valid.src") == read_lines(synthetic_paths["valid.src"])


def test_calibrating_and_exporting_a_run_under_tilde_write_in_the_home_directory(
        tmp_path, monkeypatch, cct_run, synthetic_paths):
    from dynaseq.workflows.export import export_model

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    shutil.copytree(cct_run[0], home / "runs" / "cct")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    t = dynaseq.load("~/runs/cct")
    src, ref = read_lines(synthetic_paths["valid.src"])[:8], read_lines(synthetic_paths[
        "valid.tgt"])[:8]
    t.calibrate(src, ref, budgets=[0.4])
    assert t.save_calibration("~/runs/cct") == home / "runs" / "cct" / "calibration.json"
    again = dynaseq.load("~/runs/cct")  # the calibration is read back, tied to its weights
    assert [c.budget for c in again.calibrations] == [c.budget for c in t.calibrations]
    export_model("~/runs/cct", "~/exported")
    assert (home / "exported" / "config.json").is_file()
    assert not (cwd / "~").exists()
