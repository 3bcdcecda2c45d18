"""Faults that lost or misaligned data (issue 27, numbered faults 1-4 and 6): a refused
``train`` leaves the run as it was; clearing a run takes its lock; SentencePiece models and
outputs are written atomically; one line in is one line out on every input path; an output
never overwrites an input."""

from __future__ import annotations

import errno
import hashlib
import shutil
import sys
from io import BytesIO, TextIOWrapper

import pytest

from dynaseq.cli import main
from dynaseq.core import files
from dynaseq.core.config import save_config
from dynaseq.core.errors import DynaseqError
from dynaseq.core.run_lock import CALIBRATE_LOCK, LOCK_FILE, RunDirBusy, RunDirLock, clear_run_dir
from dynaseq.data import Tokenizer, read_lines, write_lines
from dynaseq.data.text import decode_lines
from dynaseq.tasks.translation.predictor import Translator

from helpers import lm_config, run_cli

# every line boundary str.splitlines knows besides "\n": none of them may split a line
ODD_LINES = ["a\u2028b", "c\x0cd", "e\rf", "g\x85h", "i\x1cj", "k\x1dl\x1em\x0bn\u2029o"]


def _snapshot(run):
    return {p.relative_to(run): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


@pytest.mark.parametrize("override, message", [
    ("model.encoder_layers=2", "encoder"),
    ("data.vocab_size=300", "data.vocab_size=300 differs from the run's 200, with which its "
                            "tokenizer was trained"),
    ("train.max_steps=5", "is at update 20, past train.max_steps=5: nothing to train"),
])
def test_a_refused_train_leaves_the_run_as_it_was(trained_run, tmp_path, capsys, override,
                                                  message):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    before = _snapshot(run)
    assert main(["train", str(run / "config.yaml"), f"run_dir={run}", override,
                 "--quiet"]) == 2
    assert message in capsys.readouterr().err
    lm = lm_config(tmp_path, f"run_dir={run}")  # another task's config into this run
    save_config(lm, tmp_path / "lm.yaml")
    assert main(["train", str(tmp_path / "lm.yaml"), "--quiet"]) == 2
    assert "holds a seq2seq run; this config is a lm run" in capsys.readouterr().err
    assert _snapshot(run) == before
    Translator.load(run)  # still loads
    assert main(["train", str(run / "config.yaml"), f"run_dir={run}", "--quiet"]) == 0  # as it


def test_a_train_refused_for_what_a_directory_holds_writes_not_even_a_lock(
        trained_run, tmp_path, capsys):
    from dynaseq.workflows.export import export_model

    exported = tmp_path / "model"
    export_model(trained_run, exported)
    before = sorted(p.name for p in exported.iterdir())
    assert main(["train", str(trained_run / "config.yaml"), f"run_dir={exported}",
                 "--quiet"]) == 2
    assert "holds a trained model (model.safetensors) but no checkpoint" in (
        capsys.readouterr().err)
    assert sorted(p.name for p in exported.iterdir()) == before  # no .train.lock
    lm = lm_config(tmp_path, f"run_dir={exported}")
    save_config(lm, tmp_path / "lm.yaml")
    assert main(["train", str(tmp_path / "lm.yaml"), "--quiet"]) == 2
    assert sorted(p.name for p in exported.iterdir()) == before


def test_a_tokenizer_left_by_a_bigger_config_is_refused(trained_run, tmp_path, capsys):
    fresh = tmp_path / "fresh"  # a tokenizer left in a new directory (a killed first run)
    fresh.mkdir()
    shutil.copy(trained_run / "spm.model", fresh / "spm.model")
    assert main(["train", str(trained_run / "config.yaml"), f"run_dir={fresh}",
                 "data.vocab_size=50", "--quiet"]) == 2
    assert "pieces, more than data.vocab_size=50" in capsys.readouterr().err
    assert [p.name for p in fresh.iterdir()] == ["spm.model"]  # not even a lock file


def test_clearing_a_run_takes_its_lock_and_keeps_the_lock_file(tmp_path):
    run = tmp_path / "run"
    held = RunDirLock(run).acquire()
    (run / "config.yaml").write_text("x: 1\n")
    inode = (run / LOCK_FILE).stat().st_ino
    with pytest.raises(RunDirBusy):
        clear_run_dir(run)
    assert (run / "config.yaml").is_file()
    held.release()
    (run / "best").mkdir()
    clear_run_dir(run)
    assert [p.name for p in run.iterdir()] == [LOCK_FILE]
    assert (run / LOCK_FILE).stat().st_ino == inode
    with pytest.raises(RunDirBusy):  # the same file still locks out a second trainer
        with RunDirLock(run), RunDirLock(run):
            pass


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_never_leaves_half_a_sentencepiece_model(tmp_path, monkeypatch):
    lines = [f"sentence number {i} with words" for i in range(200)]
    good = Tokenizer.train(lines, tmp_path / "spm.model", 60)
    data = (tmp_path / "spm.model").read_bytes()
    monkeypatch.setattr(files.os, "fsync", _disk_full)
    with pytest.raises(DynaseqError, match="cannot write"):
        Tokenizer.train(lines + ["more text"], tmp_path / "spm.model", 70)
    assert (tmp_path / "spm.model").read_bytes() == data  # the old model, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.model", "spm.vocab"]
    assert Tokenizer.load(tmp_path / "spm.model").vocab_size == good.vocab_size


def test_a_failed_output_write_keeps_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "out.txt"
    write_lines(out, ["old one", "old two"])
    monkeypatch.setattr(files.os, "replace", _disk_full)
    with pytest.raises(DynaseqError, match="cannot write"):
        write_lines(out, ["new"])
    assert read_lines(out) == ["old one", "old two"]
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_one_line_in_is_one_line_out_on_every_input_path(trained_run, tmp_path, monkeypatch):
    text = "".join(line + "\n" for line in ODD_LINES)
    assert len(decode_lines(text.encode(), "stdin")) == len(ODD_LINES)
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    assert len(read_lines(tmp_path / "in.txt")) == len(ODD_LINES)
    from dynaseq.cli import _read_input

    monkeypatch.setattr(sys, "stdin", TextIOWrapper(BytesIO(text.encode())))
    assert _read_input(None) == read_lines(tmp_path / "in.txt")
    proc = run_cli("translate", str(trained_run), "--beam", "1", stdin=text.encode())
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().count("\n") == len(ODD_LINES)


def test_an_output_that_is_an_input_is_refused(trained_run, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("kalo mintu\nsum 3 4\n")
    before = src.read_bytes()
    assert main(["translate", str(trained_run), "-i", str(src), "-o", str(src)]) == 2
    assert "is the input" in capsys.readouterr().err
    assert main(["distill-data", str(trained_run), "--src", str(src), "--out",
                 str(tmp_path / "." / "in.txt")]) == 2
    assert "is the input" in capsys.readouterr().err
    assert src.read_bytes() == before


def test_evaluate_refuses_empty_files_and_options_a_run_kind_ignores(trained_run, tmp_path,
                                                                       capsys):
    (tmp_path / "e.src").write_text("")
    (tmp_path / "e.ref").write_text("")
    assert main(["evaluate", str(trained_run), "--src", str(tmp_path / "e.src"), "--ref",
                 str(tmp_path / "e.ref")]) == 2
    assert "has no lines to evaluate" in capsys.readouterr().err
    lm = lm_config(tmp_path, "train.max_steps=1")
    from dynaseq.train.loop import train

    train(lm, progress=False)
    assert main(["evaluate", lm.run_dir, "--budget", "0.5", "--beam", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"dynaseq: error: evaluate: --budget, --beam are for translation runs; "
                   f"{lm.run_dir} is a language-model run"), err


def test_a_trainer_state_of_the_wrong_structure_is_one_line(trained_run, tmp_path, capsys):
    import torch

    from dynaseq.core import checkpoint as ckpt

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    latest = ckpt.list_checkpoints(run)[-1]
    torch.save({"unexpected": 1}, latest / ckpt.TRAINER)
    meta = ckpt.read_meta(latest)
    meta.pop("sha256")  # a well-formed file, just not this run's trainer state
    (latest / ckpt.META).write_text(__import__("json").dumps(meta))
    assert main(["train", str(run / "config.yaml"), f"run_dir={run}", "train.max_steps=30",
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not this run's trainer state" in err[0], err


def _one_line(capsys, *fragments: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def test_latest_checkpoint_deleted_while_loading_falls_back_to_the_next(trained_run, tmp_path,
                                                                         monkeypatch):
    """``--checkpoint latest`` racing a training run's keep_last: the checkpoint found first
    vanishes before it is read; the next newest loads instead."""
    from dynaseq.tasks.translation import predictor

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    real_read_meta = predictor.read_meta
    deleted = []

    def read_meta_after_pruning(ckpt):
        if not deleted:
            deleted.append(ckpt.name)
            shutil.rmtree(ckpt)  # keep_last pruned it between listing and reading
        return real_read_meta(ckpt)

    monkeypatch.setattr(predictor, "read_meta", read_meta_after_pruning)
    t = Translator.load(run, checkpoint="latest")
    assert deleted == ["step_00000020"] and t.checkpoint.name == "step_00000010"
    # a checkpoint named explicitly is not swapped for another
    deleted.clear()
    monkeypatch.setattr(predictor, "read_meta", read_meta_after_pruning)
    with pytest.raises(DynaseqError, match="no checkpoint"):
        Translator.load(run, checkpoint=str(run / "checkpoints" / "step_00000010"))


def test_average_takes_the_run_lock(trained_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    with RunDirLock(run):  # a training run, or another `average`, holds it
        assert main(["average", str(run), "-k", "2"]) == 2
    _one_line(capsys, "being trained by another process")
    assert not (run / "averaged").exists()
    assert main(["average", str(run), "-k", "2"]) == 0
    assert (run / "averaged" / "model.safetensors").is_file()


def test_a_full_disk_while_averaging_or_checkpointing_is_one_line(trained_run, tmp_path, capsys,
                                                                  monkeypatch):
    from dynaseq.core import checkpoint

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    assert main(["average", str(run), "-k", "2"]) == 0
    before = _snapshot(run)
    capsys.readouterr()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_model", full_disk)  # training checkpoints
    monkeypatch.setattr(checkpoint, "save_file", full_disk)  # averaged weights
    assert main(["average", str(run), "-k", "1"]) == 2
    _one_line(capsys, "no space left on device")
    assert _snapshot(run) == before  # the old averaged/ is whole
    assert not [p for p in run.iterdir() if p.name.startswith(".")
                and p.name not in (LOCK_FILE, CALIBRATE_LOCK)]  # no temporary directories
    assert main(["train", str(run / "config.yaml"), f"run_dir={run}", "train.max_steps=30",
                 "--quiet"]) == 2
    _one_line(capsys, "no space left on device")


def test_options_a_run_kind_ignores_are_refused_by_distill_data(trained_run, tmp_path, capsys):
    from dynaseq.train.loop import train

    cfg = lm_config(tmp_path, "train.max_steps=2")
    train(cfg, progress=False)
    lm_run = tmp_path / "run"
    for extra in (["--beam", "2"], ["--budget", "0.5"]):
        assert main(["distill-data", str(lm_run), "--out", str(tmp_path / "k"), *extra]) == 2
        _one_line(capsys, f"{extra[0]} is for translation runs",
                  "is a language-model run")
    src = tmp_path / "valid.txt"
    for extra in (["--k", "5"], ["--window", "8"]):
        assert main(["distill-data", str(trained_run), "--src", str(src), "--out",
                     str(tmp_path / "kd.txt"), *extra]) == 2
        _one_line(capsys, f"{extra[0]} is for language-model runs", "is a translation run")
    assert not (tmp_path / "k").exists() and not (tmp_path / "kd.txt").exists()


def test_warnings_are_one_line(monkeypatch, capsys):
    import warnings

    from dynaseq import cli

    def warns(args):
        warnings.warn("calibration.json was made for checkpoint best,\nnot step_10",
                      stacklevel=1)
        return 0

    monkeypatch.setitem(cli.COMMANDS, "average", cli.Command({None: warns}))
    assert main(["average", "anything"]) == 0
    assert capsys.readouterr().err == (
        "dynaseq: warning: calibration.json was made for checkpoint best, not step_10\n")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1000 KiB tmpfs (a disk that fills up), where this process may mount one."""
    import subprocess

    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1000k", "tmpfs", str(mnt)],
                          capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_full_disk_during_training_stops_cleanly_and_resumes_exactly(
        small_tmpfs, synthetic_paths, tmp_path):
    """The step-10 checkpoint fits on the small disk, the step-20 one does not: the run stops
    with one line, leaves its step-10 checkpoint whole, and resumed elsewhere it ends with
    the weights of an uninterrupted run, bit for bit."""
    from safetensors.torch import load_file

    from helpers import micro_config

    ref = tmp_path / "ref"
    save_config(micro_config(ref, synthetic_paths), tmp_path / "ref.yaml")
    assert run_cli("train", str(tmp_path / "ref.yaml"), "--quiet").returncode == 0

    full = small_tmpfs / "run"
    save_config(micro_config(full, synthetic_paths), tmp_path / "full.yaml")
    proc = run_cli("train", str(tmp_path / "full.yaml"), "--quiet")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynaseq: error: no space left on device"), err
    ckpts = sorted(p.name for p in (full / "checkpoints").iterdir())
    assert ckpts == ["step_00000010"]  # no half-written step 20, no temporary directory
    assert not [p for p in full.rglob(".tmp-*")]

    moved = tmp_path / "moved"  # space freed: the run continues on another disk
    shutil.copytree(full, moved)
    cfg = micro_config(moved, synthetic_paths)
    save_config(cfg, tmp_path / "moved.yaml")
    assert run_cli("train", str(tmp_path / "moved.yaml"), "--quiet").returncode == 0
    a = load_file(str(ref / "checkpoints" / "step_00000020" / "model.safetensors"))
    b = load_file(str(moved / "checkpoints" / "step_00000020" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
