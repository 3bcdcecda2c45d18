"""A newcomer's path: the README's commands exist, data is found through a data root (or the
command says which dataset is missing and where to get it), ``data check`` verifies
checksums, ``plot`` draws curves, ``--version`` and ``train --print-config``."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from matplotlib.image import imread
from test_cli import assert_clean_error

import dynaseq
from dynaseq.cli import COMMANDS, main
from dynaseq.core.config import to_dict
from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import sha256_file
from dynaseq.data.datasets import DATA_ENV, DATASETS, check_data, resolve_data_path
from dynaseq.tasks.registry import load_config

from helpers import REPO, run_cli

README = REPO / "README.md"


def test_readme_is_one_page_and_each_command_it_names_has_help(capsys):
    text = README.read_text()
    assert len(text.splitlines()) < 200
    assert "make demo" in text and "make test" in text
    named = set(re.findall(r"\bdynaseq ([a-z][a-z-]+)", text))
    commands = named & set(COMMANDS)
    assert {"train", "translate", "data", "plot"} <= commands, named
    unknown = {c for c in named - set(COMMANDS)
               if re.search(rf"`dynaseq {c}\b|^\s*dynaseq {c}\b", text, re.M)}
    assert not unknown, f"README names commands dynaseq does not have: {unknown}"
    for command in sorted(commands):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0, command
    capsys.readouterr()


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"dynaseq {dynaseq.__version__}"
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the version is written once

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "dynaseq.__version__"}
    shipped = project["tool"]["setuptools"]["package-data"]["dynaseq.workflows"]
    from dynaseq.workflows.demo import DEMO_MODEL  # packaged by name: tracked files only

    assert sorted(shipped) == sorted(f"demo_model/{p.name}" for p in DEMO_MODEL.iterdir())


def test_shipped_configs_name_their_data_under_the_root():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        text = path.read_text()
        assert "../shared" not in text, path
        for value in re.findall(r":\s*(\$DATA/\S+)", text):
            name = value.split("/")[1]
            assert name in DATASETS, (path, value)
            assert value.split("/", 2)[2] in DATASETS[name].files, (path, value)


def test_data_paths_resolve_under_the_root(tmp_path):
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "train.txt").write_text("a b\n")
    env = {DATA_ENV: str(tmp_path)}
    assert resolve_data_path("$DATA/wikitext-2/train.txt", env) == \
        tmp_path / "wikitext-2" / "train.txt"
    assert str(resolve_data_path("other/train.txt", env)) == "other/train.txt"
    with pytest.raises(DynaseqError) as e:
        resolve_data_path("$DATA/multi30k/train.en.gz", env)
    msg = str(e.value)
    assert "dataset multi30k is missing" in msg and str(tmp_path) in msg
    assert DATASETS["multi30k"].upstream in msg and "dynaseq data check" in msg
    assert "\n" not in msg


def test_training_without_the_data_names_the_dataset_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/multi30k_tiny.yaml", f"run_dir={run_dir}",
                   env={DATA_ENV: str(tmp_path / "empty")}, timeout=60)
    assert_clean_error(proc, "dataset multi30k is missing", "docs/data.md",
                       "dynaseq data check", str(tmp_path / "empty"))
    assert not run_dir.exists()


def test_docs_data_lists_every_file_and_checksum():
    text = (REPO / "docs" / "data.md").read_text()
    for d in DATASETS.values():
        assert d.upstream in text
        for rel, sha in d.files.items():
            assert f"| `{d.name}/{rel}` | `{sha}` |" in text, rel


def test_data_check_reports_missing_and_changed_files(tmp_path, capsys):
    root = tmp_path / "root"
    good, bad = root / "wikitext-2" / "valid.txt", root / "wikitext-2" / "test.txt"
    good.parent.mkdir(parents=True)
    good.write_text("x")
    bad.write_text("y")
    expected = DATASETS["wikitext-2"].files
    # what the manifest holds for a file is its sha256: make "valid.txt" match by checksum
    checks = {c.path.name: c.status for c in check_data(root, ["wikitext-2"])}
    assert checks == {"valid.txt": "mismatch", "test.txt": "mismatch", "train.txt": "missing"}
    assert sha256_file(good) != expected["valid.txt"]
    assert main(["data", "check", str(root), "--dataset", "wikitext-2"]) == 1
    out = capsys.readouterr().out
    assert "wikitext-2: 0/3 files ok; missing 1" in out and "2 differ" in out
    assert DATASETS["wikitext-2"].upstream in out
    assert main(["data", "check", str(tmp_path / "nowhere")]) == 2
    assert main(["data", "check", str(root), "--dataset", "imagenet"]) == 2


def test_data_check_passes_on_the_shared_data(capsys):
    shared = REPO.parent / "shared" / "data"
    if not (shared / "glue").is_dir():
        pytest.skip("../shared/data is not here")
    assert main(["data", "check", str(shared), "--dataset", "glue"]) == 0
    assert "glue: 8/8 files ok" in capsys.readouterr().out


def test_print_config_prints_the_resolved_config_and_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "configs/multi30k_tiny.yaml", f"run_dir={run_dir}",
                 "train.max_steps=7", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    cfg = load_config(REPO / "configs/multi30k_tiny.yaml",
                      [f"run_dir={run_dir}", "train.max_steps=7"])
    assert printed == to_dict(cfg)
    assert printed["train"]["max_steps"] == 7 and "label_smoothing" in printed["train"]
    assert not run_dir.exists()


def _fake_log(run_dir, scale: float) -> None:
    run_dir.mkdir()
    recs = [{"event": "data", "split": "train", "lines": 9}]
    recs += [{"event": "train", "step": s, "loss": scale * 5 / s, "lr": 1e-3} for s in (1, 2, 3)]
    recs += [{"event": "valid", "step": 2, "loss": scale, "bleu": 10 * scale}]
    (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_plot_draws_curves_of_two_runs(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _fake_log(a, 1.0)
    _fake_log(b, 2.0)
    out = tmp_path / "curves.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    image = imread(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300
    assert image.std() > 0  # not a blank canvas
    assert main(["plot", str(a), "--out", str(tmp_path / "c.jpg")]) == 2
    assert main(["plot", str(a), str(b), "--out", str(b / "curves.png")]) == 2  # in a run
    assert "is inside the run directory" in capsys.readouterr().err
    assert not (b / "curves.png").exists()
    assert main(["plot", str(tmp_path / "none"), "--out", str(tmp_path / "d.png")]) == 2
    assert not (tmp_path / "d.png").exists()
    with open(a / "log.jsonl", "a") as f:  # a run killed while it wrote a line
        f.write('{"event": "train", "st')
    assert main(["plot", str(a), "--out", str(tmp_path / "e.png")]) == 0
    (a / "log.jsonl").write_text((a / "log.jsonl").read_text() + "\n")  # now a whole line
    assert main(["plot", str(a), "--out", str(tmp_path / "f.png")]) == 2
    assert "line 6 is not JSON" in capsys.readouterr().err
    assert not (tmp_path / "f.png").exists()
    good = (a / "log.jsonl").read_text().splitlines()[:5]
    for line, words in (("[1, 2]", "line 6 is not a log record"),
                        ('{"event": "train", "step": 1, "loss": ' + "9" * 400 + "}",
                         "line 6: the step or loss is too large")):
        (a / "log.jsonl").write_text("\n".join([*good, line]) + "\n")
        assert main(["plot", str(a), "--out", str(tmp_path / "g.png")]) == 2
        assert words in capsys.readouterr().err
    assert not (tmp_path / "g.png").exists()
    # an output nothing can be written to is refused by its own name, before the plot
    assert main(["plot", str(b), "--out", "/proc/version/x.png"]) == 2
    assert "cannot write /proc/version/x.png: not a directory" in capsys.readouterr().err


def _stderr_of(args: list[str], stdin: bytes, tty: bool) -> tuple[int, str, str]:
    """Run ``python -m dynaseq ARGS`` with stderr on a pseudo-terminal (``tty``) or a pipe."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
    if not tty:
        proc = subprocess.run([sys.executable, "-m", "dynaseq", *args], input=stdin,
                              capture_output=True, cwd=REPO, env=env, timeout=120)
        return proc.returncode, proc.stdout.decode(), proc.stderr.decode()
    leader, follower = pty.openpty()
    # a terminal 100 columns wide (a fresh pty is 0 x 0, where tqdm draws nothing)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "dynaseq", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=follower, cwd=REPO, env=env)
    os.close(follower)
    out, _ = proc.communicate(stdin, timeout=120)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the follower side is closed: all read
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_not_in_a_pipe(trained_run, synthetic_paths):
    lines = synthetic_paths["valid.src"].read_bytes()
    args = ["translate", str(trained_run), "--batch-size", "8"]
    rc, out_tty, err_tty = _stderr_of(args, lines, tty=True)
    assert rc == 0, err_tty
    assert "decode" in err_tty and "sent" in err_tty and "%" in err_tty, err_tty
    rc, out_pipe, err_pipe = _stderr_of(args, lines, tty=False)
    assert rc == 0 and err_pipe == "", err_pipe
    assert out_pipe == out_tty  # the bar goes to stderr only
    rc, _, err_quiet = _stderr_of([*args, "--quiet"], lines, tty=True)
    assert rc == 0 and "decode" not in err_quiet, err_quiet


def test_tensorboard_sink_writes_the_logged_scalars(tmp_path, synthetic_paths):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dynaseq.core.runlog import read_log
    from dynaseq.train.loop import train

    from helpers import micro_config

    cfg = micro_config(tmp_path / "run", synthetic_paths, max_steps=10, log_every=2,
                       valid_every=5, save_every=10, valid_bleu_lines=4, tensorboard=True)
    train(cfg, progress=False)
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    logged = read_log(tmp_path / "run" / "log.jsonl", "train")
    scalars = acc.Scalars("train/loss")
    assert [s.step for s in scalars] == [r["step"] for r in logged]
    assert [s.value for s in scalars] == pytest.approx([r["loss"] for r in logged], rel=1e-6)
    valid = read_log(tmp_path / "run" / "log.jsonl", "valid")
    assert [s.step for s in acc.Scalars("valid/bleu")] == [r["step"] for r in valid] == [5, 10]


def test_without_a_data_root_the_error_says_where_it_looked(tmp_path):
    """As in a fresh clone elsewhere: no DYNASEQ_DATA, no data/ and no ../shared/data."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != DATA_ENV}
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "dynaseq", "train",
                           str(REPO / "configs" / "wikitext2_tiny.yaml"), "run_dir=run"],
                          capture_output=True, cwd=work, env=env, timeout=60)
    assert_clean_error(proc, "dataset wikitext-2 is missing", f"{DATA_ENV} unset",
                       DATASETS["wikitext-2"].upstream, "dynaseq data check")
    assert not (work / "run").exists()
    from dynaseq.data.datasets import _root_origin

    assert _root_origin({DATA_ENV: ""}).startswith(f"{DATA_ENV} empty, no ")  # set, not used
