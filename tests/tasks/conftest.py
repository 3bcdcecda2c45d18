"""Fixtures of the task tests: a small text corpus and a GLUE subset (encoder tasks, and the
precision tests of every task)."""

from __future__ import annotations

from pathlib import Path

import pytest

from encoder_helpers import glue_subset
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
def sst2_small(tmp_path_factory) -> dict[str, Path]:
    """The first 300 SST-2 training rows and 60 dev rows, GLUE layout."""
    return glue_subset(tmp_path_factory.mktemp("sst2"), "SST-2", 300, 60)
