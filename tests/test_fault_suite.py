"""Generated bad input (hypothesis): text with any characters keeps one line in, one line out;
numeric options and config overrides that are NaN, infinite or out of range end in one line
and exit status 2, never a traceback, and write nothing."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynaseq.cli import main
from dynaseq.core.errors import ConfigError
from dynaseq.data import read_lines, write_lines
from dynaseq.data.text import decode_lines
from dynaseq.tasks.registry import load_config

# any code point but surrogates (not encodable) and "\n" (the one line end)
LINE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"),
               max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.lists(LINE, max_size=12))
def test_any_text_keeps_one_line_in_one_line_out(lines):
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    got = decode_lines(data, "stdin")
    assert len(got) == len(lines)
    first_bom = bool(lines) and lines[0].startswith("\ufeff")
    if not first_bom:
        assert got == [line.strip() for line in lines]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINE, max_size=6))
def test_written_lines_read_back_as_written(tmp_path, lines):
    lines = [line.strip().lstrip("\ufeff").strip() for line in lines]
    write_lines(tmp_path / "out.txt", lines)
    assert read_lines(tmp_path / "out.txt") == lines


def _exit_status(argv: list[str]) -> int:
    """main's return value, or the status of the SystemExit argparse raises."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code)


BAD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf])
BAD_INTS = st.sampled_from([2**64, -(2**64), 10**30])

# (argv before the value, option, kind): every one must be refused before any work
NUMERIC = [
    (["translate", "{run}"], "--length-penalty", "float"),
    (["translate", "{run}"], "--beam", "int"),
    (["evaluate", "{run}", "--src", "x", "--ref", "y"], "--batch-size", "int"),
    (["calibrate", "{run}", "--src", "x", "--ref", "y"], "--tol", "float"),
    (["generate", "{run}"], "--temperature", "float"),
    (["generate", "{run}"], "--seed", "int"),
    (["demo", "--train", "--out", "{tmp}/demo"], "--minutes", "float"),
    (["demo", "--train", "--out", "{tmp}/demo"], "--steps", "int"),
    (["prune", "{run}", "--out", "{tmp}/p"], "--sparsity", "float"),
    (["prune", "{run}", "--out", "{tmp}/p", "--sparsity", "0.3"], "--lr", "float"),
    (["profile", "configs/synthetic_tiny.yaml"], "--src-len", "int"),
]


@pytest.mark.parametrize(("head", "option", "kind"), NUMERIC,
                         ids=[f"{h[0]}{o}" for h, o, _ in NUMERIC])
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_numbers_are_one_line_and_exit_2(head, option, kind, data, trained_run, tmp_path,
                                             capsys):
    value = data.draw(BAD_FLOATS if kind == "float" else BAD_INTS)
    argv = [a.format(run=trained_run, tmp=tmp_path) for a in head] + [option, str(value)]
    before = sorted(tmp_path.rglob("*"))
    assert _exit_status(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dynaseq: error:"), err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


@settings(max_examples=40, deadline=None)
@given(key=st.sampled_from(["train.lr", "train.adam_eps", "train.weight_decay",
                            "train.clip_norm", "train.label_smoothing", "model.dropout",
                            "train.min_lr_ratio"]),
       value=st.sampled_from([".nan", ".inf", "-.inf", "-1"]))
def test_bad_config_floats_are_refused(key, value):
    with pytest.raises(ConfigError):
        load_config("configs/synthetic_tiny.yaml", [f"{key}={value}"])


@settings(max_examples=20, deadline=None)
@given(key=st.sampled_from(["train.warmup_steps", "train.seed", "data.max_tokens",
                            "train.max_steps", "model.max_positions"]),
       value=st.sampled_from([str(2**70), str(-(2**70))]))
def test_bad_config_integers_are_refused(key, value):
    with pytest.raises(ConfigError):
        load_config("configs/synthetic_tiny.yaml", [f"{key}={value}"])
