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
from dynaseq.core.run_lock import LOCK_FILE, RunDirBusy, RunDirLock, clear_run_dir
from dynaseq.data import Tokenizer, read_lines, write_lines
from dynaseq.data.text import decode_lines
from dynaseq.tasks.translation.predictor import Translator

from helpers import lm_config, run_cli

# every line boundary str.splitlines knows besides "\n": none of them may split a line
ODD_LINES = ["a\u2028b", "c\x0cd", "e\rf", "g\x85h", "i\x1cj", "k\x1dl\x1em\x0bn\u2029o"]


def _snapshot(run):
    return {p.relative_to(run): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def test_a_refused_train_leaves_the_run_as_it_was(trained_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    before = _snapshot(run)
    assert main(["train", str(run / "config.yaml"), f"run_dir={run}",
                 "model.encoder_layers=2", "--quiet"]) == 2
    assert "encoder" in capsys.readouterr().err
    lm = lm_config(tmp_path, f"run_dir={run}")  # another task's config into this run
    save_config(lm, tmp_path / "lm.yaml")
    assert main(["train", str(tmp_path / "lm.yaml"), "--quiet"]) == 2
    assert "holds a seq2seq run; this config is a lm run" in capsys.readouterr().err
    assert _snapshot(run) == before
    Translator.load(run)  # still loads


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
