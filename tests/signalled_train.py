"""``python tests/signalled_train.py CONFIG STEP SIGNUM``: train the run config CONFIG with
the one loop, sending this process SIGNUM right after update STEP (see
``helpers.signal_at_step``). The exact-resume tests use it to kill a run with SIGKILL at a
chosen update, as ``kill -9`` would."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from dynaseq.tasks.registry import load_config, task_for  # noqa: E402
from dynaseq.train.loop import train  # noqa: E402

from helpers import signal_at_step  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)  # as the tests' own process (conftest.py)
    config, step, signum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    train(signal_at_step(task_for(load_config(config)), step, signum), progress=False)
