"""One training process per run directory.

Two processes training into the same run directory would overwrite each other's config,
checkpoints and log without either noticing. :class:`RunDirLock` takes an exclusive advisory
lock (``fcntl.flock``) on ``RUN_DIR/.train.lock`` for as long as a training runs; a second
``train`` on that directory stops at once with a one-line :class:`RunDirBusy` error, before it
writes anything. The operating system drops the lock when its process exits, however it
exits, so a killed run never leaves a stale lock behind. A command refused while it holds
the lock (a ``with`` block that raises, :meth:`RunDirLock.release` with ``discard``) removes
the lock's file if it made it: a refused command writes nothing.

Example::

    with RunDirLock(Path("runs/my_run")):   # raises RunDirBusy if another process holds it
        ...                                  # write config, checkpoints, log
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from types import TracebackType

from dynaseq.core.errors import DynaseqError

LOCK_FILE = ".train.lock"
"""The lock's file inside a run directory; it holds the process id of the trainer."""

CALIBRATE_LOCK = ".calibrate.lock"
"""The lock a ``dynaseq calibrate`` holds from reading ``calibration.json`` to writing it
(two at once each merged their budgets into what they had read: one's were lost)."""


class RunDirBusy(DynaseqError):
    """Another process is training into this run directory."""


class RunDirLock:
    """Exclusive lock on a run directory (created if missing) while a training writes to it.

    ``acquire()`` raises :class:`RunDirBusy` naming the holder's process id when another
    process (or another open lock in this process) holds it; ``release()`` is idempotent.
    ``lock_file`` and ``doing``: another lock of the directory (:data:`CALIBRATE_LOCK`,
    ``"calibrated"``), independent of the trainer's.
    """

    def __init__(self, run_dir: Path, lock_file: str = LOCK_FILE,
                 doing: str = "trained") -> None:
        self.run_dir = Path(run_dir)
        self.lock_file, self.doing = lock_file, doing
        self._fd: int | None = None
        self._created = False  # acquire() made the lock's file (release(discard=True))

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunDirLock:
        if self._fd is not None:
            raise RuntimeError(f"the lock on {self.run_dir} is already held by this object")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / self.lock_file
        while True:
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(path, os.O_RDWR), False
                except FileNotFoundError:  # removed meanwhile by a refused holder: again
                    continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip()
                os.close(fd)
                who = f" (pid {holder})" if holder.isdigit() else ""
                other = ", or train into another run_dir" if self.lock_file == LOCK_FILE else ""
                raise RunDirBusy(f"{self.run_dir} is being {self.doing} by another "
                                 f"process{who}; wait for it to finish or stop it{other}"
                                 ) from None
            if _same_file(fd, path):
                break
            os.close(fd)  # locked a file a refused holder removed: lock the one there now
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd, self._created = fd, created
        return self

    def release(self, discard: bool = False) -> None:
        """Unlock. ``discard``: the command holding it was refused, so a lock file that
        :meth:`acquire` created goes too (removed while still locked; a process that
        opened it meanwhile finds it gone and locks a new one): a refused command leaves
        nothing behind."""
        if self._fd is not None:
            if discard and self._created:
                (self.run_dir / self.lock_file).unlink(missing_ok=True)
            os.close(self._fd)  # closing the file drops the flock
            self._fd = None

    def __del__(self) -> None:  # e.g. a training Setup dropped without fit(): unlock with it
        if self._fd is not None and os is not None:  # (at interpreter exit the OS unlocks)
            self.release()

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release(discard=exc is not None)


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is still the one at ``path``."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def clear_run_dir(run_dir: Path) -> None:
    """Empty ``run_dir`` for a fresh run, holding its lock meanwhile: refused with
    :class:`RunDirBusy` while a training writes to it, and the lock file itself is kept (a
    new file would let a second trainer in beside the one holding the old)."""
    with RunDirLock(run_dir):
        for entry in Path(run_dir).iterdir():
            if entry.name in (LOCK_FILE, CALIBRATE_LOCK):  # (a new file: a second holder)
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
