"""Fixtures of the encoder-task tests: a small text corpus, GLUE-like tables and one tiny
pre-trained MLM run (shared: copy it before writing into it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynaseq.train.loop import train

from encoder_helpers import glue_subset, mlm_config
from helpers import SHARED_DATA


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> dict[str, Path]:
    """600 training and 80 validation lines of WikiText-2 (headings and blanks included)."""
    root = tmp_path_factory.mktemp("text")
    lines = (SHARED_DATA / "wikitext-2" / "train.txt").read_text().splitlines()
    (root / "train.txt").write_text("\n".join(lines[:600]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[600:680]) + "\n")
    return {"train": root / "train.txt", "valid": root / "valid.txt"}


@pytest.fixture(scope="session")
def mlm_run(tmp_path_factory, text_corpus) -> Path:
    run = tmp_path_factory.mktemp("mlm") / "run"
    train(mlm_config(run, text_corpus), progress=False)
    return run


@pytest.fixture(scope="session")
def sst2_small(tmp_path_factory) -> dict[str, Path]:
    """The first 300 SST-2 training rows and 60 dev rows, GLUE layout."""
    return glue_subset(tmp_path_factory.mktemp("sst2"), "SST-2", 300, 60)
