"""Sequence-level knowledge distillation data: ``dynaseq distill-data``."""

from __future__ import annotations

import gzip

import pytest

from dynaseq.cli import main
from dynaseq.data import read_lines, write_lines
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.workflows.distill_data import distill_lines

from helpers import run_cli


@pytest.fixture(scope="module")
def src_file(synthetic_paths, tmp_path_factory):
    lines = read_lines(synthetic_paths["test.src"])[:25]
    lines[3] = ""
    lines[10] = "   "
    path = tmp_path_factory.mktemp("kd") / "src.txt"
    write_lines(path, lines)
    return path


def test_distill_data_is_aligned_and_equals_beam_search(trained_run, src_file, tmp_path):
    out = tmp_path / "kd.txt"
    assert main(["distill-data", str(trained_run), "--src", str(src_file), "--out", str(out),
                 "--beam", "2", "--batch-size", "4", "--quiet"]) == 0
    src = read_lines(src_file)
    got = read_lines(out)
    assert len(got) == len(src)
    assert got[3] == "" and got[10] == ""
    # read_lines strips each line (as the training data reader does)
    assert got == [h.strip() for h in Translator.load(trained_run).translate(src, beam=2)]
    assert not list(tmp_path.glob(".*tmp*"))


def test_distill_data_gzip_output_reads_back(trained_run, src_file, tmp_path):
    out = tmp_path / "kd.de.gz"
    assert main(["distill-data", str(trained_run), "--src", str(src_file), "--out", str(out),
                 "--beam", "1", "--quiet"]) == 0
    assert out.read_bytes()[:2] == b"\x1f\x8b"
    gzip.decompress(out.read_bytes())
    t = Translator.load(trained_run)
    assert read_lines(out) == distill_lines(t, read_lines(src_file), beam=1)


def test_distill_data_bad_input(trained_run, src_file, tmp_path, capsys):
    out = tmp_path / "kd.txt"
    assert main(["distill-data", str(trained_run), "--src", str(tmp_path / "nope.txt"),
                 "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynaseq: error:") and err.count("\n") == 1
    assert main(["distill-data", str(tmp_path / "norun"), "--src", str(src_file),
                 "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynaseq: error:") and err.count("\n") == 1
    assert not out.exists()


def test_distill_data_cli_process_exit_code(tmp_path, src_file):
    proc = run_cli("distill-data", str(tmp_path / "norun"), "--src", str(src_file),
                   "--out", str(tmp_path / "o.txt"))
    assert proc.returncode == 2
    assert proc.stderr.decode().startswith("dynaseq: error:")
    assert proc.stderr.decode().count("\n") == 1
