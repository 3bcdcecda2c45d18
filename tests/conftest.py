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


BUDGETS = [(1.0, 1.0), (0.5, 0.5), (1.0, 0.33)]


@pytest.fixture(scope="session")
def cct_run(tmp_path_factory, synthetic_paths):
    """A CCT trained 8 updates on the synthetic task with :data:`BUDGETS` (do not write into
    its directory: tests share it; copy it first)."""
    from dynaseq.techniques.cct.config import CCTConfig
    from dynaseq.train.loop import train

    run = tmp_path_factory.mktemp("cct") / "run"
    cfg = micro_config(run, synthetic_paths, max_steps=8, log_every=1, valid_every=8,
                       save_every=8, valid_bleu_lines=4)
    cfg.model.cct = CCTConfig(ffn_pieces=2, control_hidden=8, noise_ramp_steps=4,
                              budgets=BUDGETS)
    result = train(cfg, progress=False)
    return run, result
