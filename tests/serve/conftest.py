"""Fixtures for the server tests: a micro CCT trained a few updates with three budgets and
its latency table, a tiny language model, two tiny classifiers (a dense single-sentence one
and a CCT-BERT pair one with a calibrated budget), and a real ``dynaseq serve`` process."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import dynaseq
from dynaseq.techniques.cct.config import CCTConfig

from helpers import lm_config, micro_config
from serve_helpers import BUDGETS, Server


@pytest.fixture(scope="session")
def serve_run(tmp_path_factory, synthetic_paths) -> Path:
    """A micro CCT (:data:`BUDGETS`) trained 8 updates, with a latency table measured by
    ``dynaseq profile RUN --latency-table`` (greedy, free decoding of validation sentences)."""
    from dynaseq.train.loop import train

    from helpers import run_cli

    run = tmp_path_factory.mktemp("serve") / "run"
    cfg = micro_config(run, synthetic_paths, max_steps=8, log_every=4, valid_every=8,
                       save_every=8, valid_bleu_lines=4)
    cfg.model.cct = CCTConfig(ffn_pieces=2, control_hidden=8, noise_ramp_steps=4,
                              budgets=BUDGETS)
    train(cfg, progress=False)
    r = run_cli("profile", str(run), "--latency-table", "--beam", "1", "--repeats", "1",
                "--table-batches", "1,8", "--table-lengths", "8,24",
                "--table-src", str(synthetic_paths["valid.src"]))
    assert r.returncode == 0, r.stderr.decode()
    assert (run / "latency_table.json").is_file()
    return run


@pytest.fixture(scope="session")
def lm_run(tmp_path_factory) -> Path:
    """A tiny word-level LM trained 12 updates."""
    from dynaseq.train.loop import train

    tmp = tmp_path_factory.mktemp("serve_lm")
    cfg = lm_config(tmp)
    train(cfg, progress=False)
    return Path(cfg.run_dir)


@pytest.fixture(scope="session")
def clf_data(tmp_path_factory) -> dict[str, Path]:
    """300 SST-2 training and 60 dev rows (single sentences) and 60 RTE-layout pairs."""
    from encoder_helpers import glue_subset, write_pair_table

    root = tmp_path_factory.mktemp("clf_data")
    return {**glue_subset(root, "SST-2", 300, 60),
            "pairs": write_pair_table(root / "pairs.tsv", 60)}


@pytest.fixture(scope="session")
def dense_clf_run(tmp_path_factory, clf_data) -> Path:
    """A dense SST-2 classifier trained from scratch for 6 updates."""
    from dynaseq.train.loop import train

    from encoder_helpers import classify_config

    run = tmp_path_factory.mktemp("serve_clf") / "dense"
    train(classify_config(run, clf_data), progress=False)
    return run


@pytest.fixture(scope="session")
def depth_clf_run(tmp_path_factory, clf_data) -> Path:
    """An adaptive-depth (ALBERTa) SST-2 classifier: 4 layers, the predictor after the
    first, trained from scratch for 4 updates."""
    from dynaseq.train.loop import train

    from encoder_helpers import classify_config

    run = tmp_path_factory.mktemp("serve_clf") / "depth"
    train(classify_config(run, clf_data, "train.max_steps=4", "model.layers=4",
                          "model.depth.first_group=1", "model.depth.predictor_hidden=8"),
          progress=False)
    return run


@pytest.fixture(scope="session")
def cct_clf_run(tmp_path_factory, clf_data) -> Path:
    """A CCT-BERT classifier of a sentence-pair task (RTE layout) trained from scratch for 4
    updates (budgets 0.8, 0.5, 0.33, 0.2) and calibrated at 0.4 (an untrained budget)."""
    import dynaseq
    from dynaseq.train.loop import train

    from encoder_helpers import classify_config

    run = tmp_path_factory.mktemp("serve_clf") / "cct"
    data = {"train": clf_data["pairs"], "dev": clf_data["pairs"]}
    train(classify_config(run, data, "data.glue_task=rte", "train.max_steps=4",
                          "model.cct.ffn_pieces=2", "model.cct.control_hidden=8",
                          "model.cct.noise_ramp_steps=4", "model.cct.budget_weight=0.1"),
          progress=False)
    c = dynaseq.load(run)
    c.calibrate(clf_data["pairs"], [0.4], lines=30, tol=0.02)
    c.save_calibration(run)
    return run


@pytest.fixture(scope="module")
def server(serve_run, tmp_path_factory) -> Iterator[Server]:
    """One server on :func:`serve_run` (greedy, a 30 ms batching window, small limits)."""
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    s = Server(serve_run, "--beam", "1", "--batch-window-ms", "30", "--max-lines", "8",
               "--max-body-bytes", "4000", "--max-tokens", "400", "--max-line-chars", "300",
               log=log)
    yield s
    s.stop()


@pytest.fixture
def run_copy(serve_run, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(serve_run, dst)
    return dst


@pytest.fixture(scope="module")
def offline(serve_run):
    """The micro CCT translation run, loaded offline (what served answers must equal)."""
    return dynaseq.load(serve_run)


@pytest.fixture(scope="module")
def lines(synthetic_paths) -> list[str]:
    """Six test sentences of the synthetic task."""
    return synthetic_paths["test.src"].read_text().splitlines()[:6]
