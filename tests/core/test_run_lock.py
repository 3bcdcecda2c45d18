"""One training process per run directory (dynaseq.core.run_lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dynaseq.cli import main
from dynaseq.core.config import save_config
from dynaseq.core.run_lock import LOCK_FILE, RunDirBusy, RunDirLock
from dynaseq.train.loop import train
from dynaseq.train.loop import train as train_lm

from helpers import REPO, lm_config, micro_config

HOLDER = """
import sys, time
from pathlib import Path
from dynaseq.core.run_lock import RunDirLock
lock = RunDirLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(300)
"""


def test_second_lock_is_refused_until_the_first_is_released(tmp_path):
    run = tmp_path / "run"
    first = RunDirLock(run).acquire()  # creates the directory
    assert run.is_dir() and first.held
    with pytest.raises(RunDirBusy, match=rf"^{run} is being trained by another process "
                                         rf"\(pid {os.getpid()}\); wait"):
        RunDirLock(run).acquire()
    first.release()
    first.release()  # idempotent
    with RunDirLock(run) as again:
        assert again.held
    assert not again.held


def test_lock_of_a_killed_process_is_gone_with_it(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=rf"\(pid {holder.pid}\)"):
            RunDirLock(run).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (run / LOCK_FILE).is_file()  # left behind, but no longer locked
    with RunDirLock(run):
        pass


def test_training_into_a_busy_run_dir_is_refused_before_writing(tmp_path, synthetic_paths,
                                                                  capsys):
    run = tmp_path / "run"
    cfg = micro_config(run, synthetic_paths, max_steps=2)
    with RunDirLock(run):
        with pytest.raises(RunDirBusy):
            train(cfg, progress=False)
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # nothing written
        save_config(cfg, tmp_path / "cfg.yaml")
        capsys.readouterr()
        assert main(["train", str(tmp_path / "cfg.yaml"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("dynaseq: error: ") and "is being trained by another" in err
        assert "\n" not in err
        lm = lm_config(tmp_path, f"run_dir={run}", "train.max_steps=2")
        with pytest.raises(RunDirBusy):
            train_lm(lm, progress=False)
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
    result = train(cfg, progress=False)  # free again: trains, and lets go when done
    assert result.state.step == 2
    with RunDirLock(run):
        pass


def test_a_lock_refused_inside_its_block_removes_the_file_it_made_only(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ValueError), RunDirLock(run):
        raise ValueError("refused")
    assert not (run / LOCK_FILE).exists()  # made by the refused block: gone
    with RunDirLock(run):
        pass
    assert (run / LOCK_FILE).is_file()  # a command that ran keeps it
    with pytest.raises(ValueError), RunDirLock(run):
        raise ValueError("refused")
    assert (run / LOCK_FILE).is_file()  # not made by the refused block: kept


def test_a_lock_whose_file_a_refused_holder_removed_locks_the_new_file(tmp_path):
    """A process that opened the lock's file before a refused holder removed it must not
    hold a lock on the removed file beside another on the new one."""
    run = tmp_path / "run"
    first = RunDirLock(run).acquire()
    stale = os.open(run / LOCK_FILE, os.O_RDWR)  # opened while first holds it
    first.release(discard=True)
    assert not (run / LOCK_FILE).exists()
    second = RunDirLock(run).acquire()  # makes and locks a new file
    try:
        import fcntl

        fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the removed file: free
        assert not os.path.samestat(os.fstat(stale), os.stat(run / LOCK_FILE))
        with pytest.raises(RunDirBusy):  # the file there now is what locks
            RunDirLock(run).acquire()
    finally:
        os.close(stale)
        second.release()
