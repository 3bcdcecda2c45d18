"""Fixtures of the encoder-task tests: one tiny pre-trained MLM run (shared: copy it before
writing into it); the text corpus and the SST-2 subset are in ``tests/tasks/conftest.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynaseq.train.loop import train

from encoder_helpers import mlm_config


@pytest.fixture(scope="session")
def mlm_run(tmp_path_factory, text_corpus) -> Path:
    run = tmp_path_factory.mktemp("mlm") / "run"
    train(mlm_config(run, text_corpus), progress=False)
    return run
