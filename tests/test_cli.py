"""The dynaseq command: outputs, and one-line errors with a non-zero exit for bad input."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys

import pytest

import dynaseq
from dynaseq.cli import main
from dynaseq.core.config import save_config

from helpers import micro_config, run_cli


def assert_clean_error(proc, *fragments: str) -> None:
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dynaseq: error:"), err
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def test_lines(synthetic_paths):
    return synthetic_paths["test.src"].read_text().splitlines()[:12]


def test_translate_stdin_keeps_order_and_matches_python_api(trained_run, test_lines):
    proc = run_cli("translate", str(trained_run), "--beam", "2",
                   stdin=("\n".join(test_lines) + "\n").encode())
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode().splitlines()
    assert out == dynaseq.load(trained_run).translate(test_lines, beam=2)
    # batch composition does not change results: one at a time gives the same lines
    t = dynaseq.load(trained_run)
    assert [t.translate([x], beam=2)[0] for x in test_lines[:4]] == out[:4]


def test_translate_stream_answers_each_line_before_the_next_arrives(trained_run, test_lines):
    """``--stream``: a line written to standard input is translated and printed while the
    input stays open (interactive use), as ``translate`` gives it; empty lines stay empty."""
    lines = [test_lines[0], "", test_lines[1], test_lines[2]]
    want = dynaseq.load(trained_run).translate(lines, beam=1)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynaseq", "translate", str(trained_run),
                             "--stream", "--beam", "1"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        for line, expected in zip(lines, want, strict=True):
            proc.stdin.write((line + "\n").encode())
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready, "no answer while the input stays open"
            assert proc.stdout.readline().decode().rstrip("\n") == expected
        proc.stdin.close()
        assert proc.wait(60) == 0, proc.stderr.read().decode()
    finally:
        proc.kill()


def test_translate_stream_bad_input(trained_run, test_lines, tmp_path):
    out = tmp_path / "out.txt"
    proc = run_cli("translate", str(trained_run), "--stream", "-o", str(out), stdin=b"a\n")
    assert_clean_error(proc, "--stream", "drop --output")
    assert not out.exists()
    proc = run_cli("translate", str(trained_run), "--stream", "-i", str(out), stdin=b"")
    assert_clean_error(proc, "drop --input")
    # a bad line ends the stream with its number; the lines before it were answered
    proc = run_cli("translate", str(trained_run), "--stream", "--beam", "1",
                   stdin=(test_lines[0] + "\n").encode() + b"\xff\xfe\n")
    assert_clean_error(proc, "stdin: line 2 is not valid UTF-8")
    assert proc.stdout.decode().splitlines() == dynaseq.load(trained_run).translate(
        [test_lines[0]], beam=1)


def test_empty_lines_translate_to_empty_lines(trained_run, test_lines):
    out = dynaseq.load(trained_run).translate([test_lines[0], "", "   ", test_lines[1]], beam=1)
    assert out[1:3] == ["", ""] and out[0] and out[3]


def test_translate_files(trained_run, test_lines, tmp_path):
    (tmp_path / "in.txt").write_text("\n".join(test_lines) + "\n")
    proc = run_cli("translate", str(trained_run), "-i", str(tmp_path / "in.txt"),
                   "-o", str(tmp_path / "out.txt"), "--beam", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    assert len((tmp_path / "out.txt").read_text().splitlines()) == len(test_lines)


def test_evaluate_json(trained_run, synthetic_paths):
    proc = run_cli("evaluate", str(trained_run), "--src", str(synthetic_paths["test.src"]),
                   "--ref", str(synthetic_paths["test.tgt"]), "--json", "--beam", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    res = json.loads(proc.stdout)
    assert res["signature"].startswith("nrefs:1") and 0 <= res["bleu"] <= 100
    assert res["loss"] > 0 and res["ppl"] > 1 and res["n_sentences"] == 60


def test_profile_json_for_run_and_config(trained_run):
    for target in (str(trained_run), "configs/multi30k_tiny.yaml"):
        proc = run_cli("profile", target, "--json", "--repeats", "1")
        assert proc.returncode == 0, proc.stderr.decode()
        res = json.loads(proc.stdout)
        assert res["params"] > 0 and set(res["latency_ms"]) >= {"greedy", "beam4"}
        for key in ("macs_per_token", "macs_per_token_flop_counter"):
            assert set(res[key]) == {"encoder", "decoder", "total"}
        assert res["macs_per_token_flop_counter"] == res["macs_per_token"]


def test_profile_json_at_a_budget_records_it(cct_run, synthetic_paths, tmp_path, capsys):
    from helpers import calibrated_cct

    run, _, _, _ = calibrated_cct(cct_run, synthetic_paths, tmp_path, lines=8)
    for budget, offsets in (("0.5", None), ("0.4", True)):  # trained; calibrated
        assert main(["profile", str(run), "--budget", budget, "--json", "--repeats", "1"]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["budget"] == [float(budget)] * 2
        assert (res["gate_offsets"] is None) == (offsets is None)
        if offsets:
            assert set(res["gate_offsets"]) == {"encoder", "decoder"}


def test_average_command(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    proc = run_cli("average", str(run), "-k", "2")
    assert proc.returncode == 0, proc.stderr.decode()
    assert (run / "averaged" / "model.safetensors").is_file()
    assert dynaseq.load(run).checkpoint.name == "averaged"


def test_missing_input_file(trained_run):
    assert_clean_error(run_cli("translate", str(trained_run), "-i", "/nonexistent/file.txt"),
                       "/nonexistent/file.txt")


def test_line_count_mismatch(trained_run, synthetic_paths, tmp_path):
    (tmp_path / "ref").write_text("one\ntwo\n")
    assert_clean_error(run_cli("evaluate", str(trained_run), "--src",
                               str(synthetic_paths["test.src"]), "--ref", str(tmp_path / "ref")),
                       "60 lines", "2")


def test_invalid_utf8(trained_run, tmp_path):
    (tmp_path / "bad").write_bytes(b"fine line\nbad \xff\xfe line\n")
    assert_clean_error(run_cli("translate", str(trained_run), "-i", str(tmp_path / "bad")),
                       "line 2", "UTF-8")
    # a real child: how Python itself sets up a piped stdin is part of what is checked
    assert_clean_error(run_cli("translate", str(trained_run), stdin=b"ok\n\xff\n",
                               process=True), "stdin", "line 2")


def test_bad_config_keys_and_types(tmp_path, synthetic_paths):
    cfg = micro_config(tmp_path / "r", synthetic_paths)
    save_config(cfg, tmp_path / "c.yaml")
    assert_clean_error(run_cli("train", str(tmp_path / "c.yaml"), "model.nheads=4"),
                       "unknown config key model.nheads")
    assert_clean_error(run_cli("train", str(tmp_path / "c.yaml"), "train.max_steps=lots"),
                       "train.max_steps: expected an integer")
    text = (tmp_path / "c.yaml").read_text().replace("max_steps: 20", "max_steps: [1]")
    (tmp_path / "d.yaml").write_text(text)
    assert_clean_error(run_cli("train", str(tmp_path / "d.yaml")), "train.max_steps")
    assert_clean_error(run_cli("train", str(tmp_path / "none.yaml")), "config file not found")
    assert not (tmp_path / "r").exists()  # nothing half-written on a config error


def test_training_data_errors(tmp_path, synthetic_paths):
    (tmp_path / "short.tgt").write_text("a\nb\n")
    cfg = micro_config(tmp_path / "r", {**synthetic_paths, "train.tgt": tmp_path / "short.tgt"})
    save_config(cfg, tmp_path / "c.yaml")
    assert_clean_error(run_cli("train", str(tmp_path / "c.yaml")), "has 1500 lines", "has 2")


def test_run_dir_without_checkpoint(trained_run, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(trained_run / "config.yaml", run)
    shutil.copy(trained_run / "spm.model", run)
    assert_clean_error(run_cli("translate", str(run), stdin=b"x\n"), "no checkpoint")
    assert_clean_error(run_cli("translate", str(tmp_path / "nope"), stdin=b"x\n"),
                       "run directory not found")


def test_corrupt_checkpoint(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    weights = run / "best" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_clean_error(run_cli("translate", str(run), "--checkpoint", "best", stdin=b"x\n"),
                       "corrupt checkpoint")


def test_bad_numeric_flags(trained_run):
    proc = run_cli("translate", str(trained_run), "--beam", "0", stdin=b"x\n")
    assert proc.returncode == 2 and b"Traceback" not in proc.stderr


def test_every_subcommand_is_in_the_table_and_refuses_the_wrong_run_kind(trained_run, capsys,
                                                                         tmp_path):
    from dynaseq.cli import COMMANDS, build_parser, main

    parser = build_parser()
    assert set(parser._subparsers._group_actions[0].choices) == set(COMMANDS)
    for argv in (["generate", str(trained_run)], ["prune", str(trained_run), "--out",
                                                  str(tmp_path / "p"), "--sparsity", "0.2"],
                 ["cache-search", str(trained_run), "--out", str(tmp_path / "c")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"dynaseq: error: {argv[0]}: {trained_run} is a translation run; "
                       f"{argv[0]} takes language-model runs"), err
    assert not any(tmp_path.iterdir())  # nothing written
