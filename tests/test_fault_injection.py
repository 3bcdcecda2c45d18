"""Fault injection (slow; ``make test-slow``): ``kill -9`` at random moments of training —
during updates, validation, checkpoint writes and the renames that replace ``best/`` — then
the same command again, several times over one run; the run must end with the weights of a
run that was never killed, bit for bit, and every checkpoint left must load."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import save_config
from dynaseq.tasks.translation.predictor import Translator

from helpers import REPO, micro_config

pytestmark = pytest.mark.slow

STEPS = 40


def _train(config, kill_after: float | None = None) -> int:
    """Run ``dynaseq train CONFIG``; with ``kill_after``, SIGKILL it after that many seconds
    (if it is still running). Returns its exit status."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynaseq", "train", str(config), "--quiet"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    if kill_after is None:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-2000:]
        return 0
    time.sleep(kill_after)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    return proc.returncode


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_9_at_random_moments_then_resume_is_exact(synthetic_paths, tmp_path, seed):
    rng = random.Random(seed)

    def config(name):
        cfg = micro_config(tmp_path / name, synthetic_paths, max_steps=STEPS, save_every=3,
                           valid_every=4, log_every=1, keep_last=2, valid_bleu_lines=8)
        save_config(cfg, tmp_path / f"{name}.yaml")
        return tmp_path / f"{name}.yaml"

    ref, run = config("ref"), config("run")
    start = time.perf_counter()
    _train(ref)
    full = time.perf_counter() - start  # an uninterrupted run's wall time
    kills = 0
    for _ in range(6):
        if _train(run, kill_after=rng.uniform(0.3, full)) == -signal.SIGKILL:
            kills += 1
        for d in ckpt.list_checkpoints(tmp_path / "run"):  # whatever is left loads
            Translator.load(tmp_path / "run", checkpoint=str(d))
    _train(run)  # the same command again, to the end
    assert kills >= 3
    a = load_file(str(ckpt.list_checkpoints(tmp_path / "ref")[-1] / ckpt.WEIGHTS))
    b = load_file(str(ckpt.list_checkpoints(tmp_path / "run")[-1] / ckpt.WEIGHTS))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
