"""A leading ``~`` in a config or a Python call is the home directory, as on a command line."""

from __future__ import annotations

import shutil

import pytest

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


def _home_with_model(tmp_path, monkeypatch, trained_run):
    """HOME = tmp_path/home holding a copy of ``trained_run`` at ``~/d/model`` and two
    input lines at ``~/d/in.txt``; the working directory elsewhere."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    shutil.copytree(trained_run, home / "d" / "model")
    (home / "d" / "in.txt").write_text("a b\nc d\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    return home


def test_the_cli_expands_tilde_before_comparing_outputs_with_inputs(
        tmp_path, monkeypatch, trained_run):
    """Each path argument's ``~`` is expanded before a check compares it (an output given
    as ``~/in.txt`` against the input ``'~/in.txt'`` overwrote the input)."""
    from helpers import run_cli

    home = _home_with_model(tmp_path, monkeypatch, trained_run)
    d = home / "d"
    before = sorted(p.name for p in (d / "model").iterdir())
    refused = [
        (["translate", "~/d/model", "-i", "~/d/in.txt", "-o", str(d / "in.txt")],
         "is the input"),
        (["translate", "~/d/model", "-i", "~/d/in.txt", "-o", str(d / "model" / "x.txt")],
         "inside the run directory"),
    ]
    for argv, what in refused:
        r = run_cli(*argv)
        assert r.returncode == 2 and what in r.stderr.decode(), (argv, r.stderr.decode())
    assert (d / "in.txt").read_text() == "a b\nc d\n"
    assert sorted(p.name for p in (d / "model").iterdir()) == before
    r = run_cli("translate", "~/d/model", "-i", "~/d/in.txt", "-o", "~/d/out.txt")
    assert r.returncode == 0, r.stderr.decode()
    assert len((d / "out.txt").read_text().splitlines()) == 2
    r = run_cli("profile", "~/d/model", "--batch", "1", "--repeats", "1", "--tgt-len", "4")
    assert r.returncode == 0, r.stderr.decode()
    assert not (tmp_path / "cwd" / "~").exists()  # nothing under a folder named "~"


def test_a_refused_calibrate_or_train_leaves_no_lock_file(tmp_path, cct_run):
    """A command refused while it holds a run's lock removes the lock's file it made."""
    from dynaseq.core.errors import DynaseqError
    from dynaseq.core.run_lock import CALIBRATE_LOCK, LOCK_FILE
    from dynaseq.tasks.registry import load_config
    from dynaseq.train.loop import train

    from helpers import run_cli

    run = tmp_path / "cct"
    shutil.copytree(cct_run[0], run)
    (run / LOCK_FILE).unlink(missing_ok=True)
    before = sorted(p.name for p in run.iterdir())
    assert CALIBRATE_LOCK not in before
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run_cli("calibrate", str(run), "--src", str(empty), "--ref", str(empty))
    assert r.returncode == 2, r.stderr.decode()
    # a model of other dimensions resumed from this run's checkpoints: refused at loading
    cfg = load_config(run / "config.yaml", [f"run_dir={run}", "train.max_steps=16",
                                             "model.d_model=64"])
    with pytest.raises(DynaseqError, match="shape"):
        train(cfg, progress=False)
    assert sorted(p.name for p in run.iterdir()) == before
