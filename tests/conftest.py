"""Shared fixtures: a small synthetic task and one trained micro run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dynaseq.data import write_task

from helpers import micro_config

# Tests use micro models, for which one thread is as fast as two and immune to contention
# with other processes on the machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def synthetic_paths(tmp_path_factory) -> dict[str, Path]:
    return write_task(tmp_path_factory.mktemp("synthetic"), seed=0, n_train=1500, n_valid=60,
                      n_test=60)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, synthetic_paths) -> Path:
    """A micro model trained for 20 updates (checkpoints at 10 and 20, a best, no average)."""
    from dynaseq.train.loop import train

    run = tmp_path_factory.mktemp("runs") / "micro"
    train(micro_config(run, synthetic_paths), progress=False)
    return run


