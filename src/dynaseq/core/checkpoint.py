"""Checkpoints: safetensors weights + trainer state, written atomically.

Layout of a run directory::

    run_dir/config.yaml  spm.model  log.jsonl
    run_dir/checkpoints/step_00001000/{model.safetensors, trainer.pt, meta.json}
    run_dir/best/{model.safetensors, meta.json}      best validation score so far
    run_dir/averaged/{model.safetensors, meta.json}  mean of the last K checkpoints

A checkpoint directory is written under a temporary name and renamed into place, so a kill
at any moment leaves the previous checkpoints intact. Loading never executes code: weights
are safetensors and the trainer state is read with ``torch.load(weights_only=True)``.

``meta.json`` records the SHA-256 of each file written with it (``sha256``); loading checks
them, so flipped bytes are refused instead of loaded, and refuses non-finite weights and
weights of another dtype than the model's. (Checkpoints written before checksums were
recorded load without that check.)
"""

from __future__ import annotations

import contextlib
import io
import json
import numbers
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path, PurePath
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from dynaseq.core.errors import CheckpointError
from dynaseq.core.files import sha256_file

T = TypeVar("T")

WEIGHTS = "model.safetensors"
TRAINER = "trainer.pt"
META = "meta.json"
MODEL_DIRS = ("best", "averaged")  # the kept models beside the step checkpoints
_PREFIX = "step_"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover_dir(final: Path) -> None:
    """Bring back ``final`` (e.g. ``best/``) after a kill between the two renames of
    :func:`_replace_dir`: the new ``.tmp-NAME`` if it is complete (its ``meta.json`` and every
    checksum it records hold), else the previous ``.old-NAME``. A no-op when ``final``
    exists."""
    if final.exists():
        return
    tmp, old = final.with_name(f".tmp-{final.name}"), final.with_name(f".old-{final.name}")
    if tmp.is_dir() and _complete(tmp):
        tmp.rename(final)
    elif old.is_dir():
        old.rename(final)
    else:
        return
    _fsync_dir(final.parent)


def _complete(directory: Path) -> bool:
    """A checkpoint directory whose ``meta.json`` records a SHA-256 for each of its files,
    and every one matches."""
    try:
        sums = read_meta(directory).get("sha256") or {}
        files = {p.name for p in directory.iterdir() if p.is_file() and p.name != META}
        return bool(sums) and set(sums) == files and all(
            sha256_file(directory / name) == digest for name, digest in sums.items())
    except (CheckpointError, OSError, AttributeError):
        return False


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished ``tmp`` directory to ``final``, replacing it, never leaving neither
    (a kill between the renames is undone by :func:`recover_dir`)."""
    old = final.with_name(f".old-{final.name}")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


@contextlib.contextmanager
def os_errors() -> Iterator[None]:
    """Re-raise a safetensors write that failed in the OS (``... (os error 28)``: a full
    disk) as the ``OSError`` it was, so callers handle it as any failed write."""
    try:
        yield
    except SafetensorError as e:
        m = _OS_ERROR.search(str(e))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code)) from None


@contextlib.contextmanager
def _atomic_dir(directory: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success fsync it and move it to ``directory``.
    A failure while it is filled (a full disk) removes it; ``directory`` stays as it was."""
    final = Path(directory)
    tmp = final.with_name(f".tmp-{final.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_dir(tmp, final)  # from here on a kill is recovered by recover_dir


def write_checkpoint(directory: str | Path, model: nn.Module, meta: dict[str, Any],
                     trainer_state: dict[str, Any] | None = None) -> Path:
    """Atomically write weights (+ optional trainer state) and ``meta`` to ``directory``."""
    with _atomic_dir(directory) as tmp:
        with os_errors():
            save_model(model, str(tmp / WEIGHTS))
        if trainer_state is not None:
            # serialized in memory first: torch.save into a full disk raises a RuntimeError
            # ("unexpected pos") instead of the OSError that a plain write gives
            buf = io.BytesIO()
            torch.save(trainer_state, buf)
            (tmp / TRAINER).write_bytes(buf.getbuffer())
        write_meta(tmp, meta)
    return Path(directory)


def write_meta(tmp: Path, meta: dict[str, Any]) -> None:
    """``meta`` plus the SHA-256 of every file already in ``tmp``, as ``meta.json``."""
    sums = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / META).write_text(json.dumps({**meta, "sha256": sums}, indent=1), encoding="utf-8")


class CheckpointChanged(CheckpointError):
    """A checkpoint was rewritten while it was read (a training run replaced ``best/``)."""


def weights_digest(ckpt: Path) -> str | None:
    """The SHA-256 of checkpoint ``ckpt``'s weights: the one its ``meta.json`` records (which
    loading checks against the file), else the file's own; None without a weights file."""
    recorded = ((read_meta(ckpt).get("sha256") or {}).get(WEIGHTS)
                if (ckpt / META).is_file() else None)
    if recorded is not None:
        return recorded
    return sha256_file(ckpt / WEIGHTS) if (ckpt / WEIGHTS).is_file() else None


def verify_file(directory: Path, name: str, what: str = "checkpoint") -> None:
    """Refuse ``directory/name`` if ``meta.json`` records another SHA-256 for it."""
    expected = read_meta(directory).get("sha256", {}).get(name)
    if expected is not None and sha256_file(directory / name) != expected:
        raise CheckpointError(f"corrupt {what} {directory / name}: its SHA-256 does not "
                              f"match the one recorded in {META} (damaged file)")


def _check_tensors(path: Path, model: nn.Module) -> None:
    """Refuse weights of another shape or dtype than the model's (naming the first such
    tensor and both shapes) and non-finite weights."""
    expected = model.state_dict()
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
            t = f.get_tensor(name)
            want = expected.get(name)
            if want is not None and t.shape != want.shape:
                raise CheckpointError(f"checkpoint {path}: {name} has shape {tuple(t.shape)}, "
                                      f"the model expects {tuple(want.shape)}")
            if want is not None and t.dtype != want.dtype:
                raise CheckpointError(f"checkpoint {path}: {name} is {t.dtype}, the model "
                                      f"expects {want.dtype}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"checkpoint {path}: {name} holds non-finite values "
                                      "(NaN or inf)")


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{_PREFIX}{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete step checkpoints of a run (their meta and weights there: not one a training
    run's ``keep_last`` is deleting), oldest first."""
    return [p for p in _step_dirs(run_dir) if (p / META).is_file() and (p / WEIGHTS).is_file()]


def _step_dirs(run_dir: str | Path) -> list[Path]:
    """Every ``checkpoints/step_<digits>`` folder of a run, complete or not, oldest first (a
    stray ``step_abc/`` is no checkpoint)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def scheduled_checkpoints(run_dir: str | Path) -> list[Path]:
    """The step checkpoints a run never stopped would hold, oldest first: those written on
    the schedule (their ``meta.json`` has ``"scheduled": true``, or no such key) and the
    latest. An off-schedule one (a signal's or a time limit's) that a resumed run has gone
    past is left out, so stopping and resuming changes neither which checkpoints are kept
    nor their average (a changed ``save_every`` changes nothing already written)."""
    ckpts = list_checkpoints(run_dir)
    return [p for i, p in enumerate(ckpts)
            if i == len(ckpts) - 1 or read_meta(p).get("scheduled", True)]


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete every step checkpoint but the last ``keep_last`` of
    :func:`scheduled_checkpoints`."""
    kept = set(scheduled_checkpoints(run_dir)[-keep_last:])
    for old in _step_dirs(run_dir):  # one a killed prune left half deleted, too
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / META
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint in {directory} (missing {META})") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"corrupt checkpoint {directory}: {META}: {e}") from None


def load_weights(model: nn.Module, directory: str | Path) -> None:
    """Load safetensors weights into ``model`` (strict); corrupt files raise CheckpointError."""
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"no checkpoint in {directory} (missing {WEIGHTS})")
    try:
        if (Path(directory) / META).is_file():
            verify_file(Path(directory), WEIGHTS)
        _check_tensors(path, model)
        missing, unexpected = load_model(model, str(path), strict=False)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"corrupt checkpoint {path}: {msg}") from None
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not match the model: missing "
                              f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")


def load_trainer_state(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / TRAINER
    if path.is_file():
        verify_file(Path(directory), TRAINER, "trainer state")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} has no trainer state") from None
    except Exception as e:  # torch raises several types for truncated pickles/zips
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"corrupt trainer state {path}: {msg}") from None


def average_checkpoints(directories: list[Path], out_dir: str | Path) -> Path:
    """Element-wise mean of the weights in ``directories``, written to ``out_dir``."""
    if not directories:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for d in directories:
        try:
            weights = load_file(str(Path(d) / WEIGHTS))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"corrupt checkpoint {d}: {e}") from None
        if total and set(weights) != set(total):
            raise CheckpointError(f"checkpoint {d} has different parameters from the others")
        for name, t in weights.items():
            t = t.double()
            total[name] = total[name] + t if name in total else t
    mean = {name: (t / len(directories)).float().contiguous() for name, t in total.items()}
    meta = {"averaged": [Path(d).name for d in directories],
            "step": read_meta(directories[-1]).get("step")}
    with _atomic_dir(out_dir) as tmp:
        with os_errors():
            save_file(mean, str(tmp / WEIGHTS))
        write_meta(tmp, meta)
    return Path(out_dir)


def resolve_checkpoint(run_dir: str | Path, which: str | int = "auto") -> Path:
    """Directory holding the weights to use.

    ``which``: ``auto`` (averaged, else best, else latest), ``best``, ``latest``, ``averaged``,
    a step (``1400``, numpy's too, or ``"1400"``: the run's checkpoint of that update) or a
    path to a checkpoint directory (as given, else inside the run:
    ``checkpoints/step_00001400``). An exported model directory (its weights at the top) is
    its own checkpoint for ``auto``.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise CheckpointError(f"run directory not found: {run}")
    if isinstance(which, bool) or not isinstance(which, str | numbers.Integral | PurePath):
        raise CheckpointError(f"a checkpoint is auto, best, latest, averaged, a step or a "
                              f"path, got {which!r}")
    if isinstance(which, numbers.Integral) or (isinstance(which, str) and which.isascii()
                                               and which.isdigit()):
        ckpts = {int(p.name[len(_PREFIX):]): p for p in list_checkpoints(run)}
        if int(which) not in ckpts:
            steps = ", ".join(map(str, ckpts)) or "none"
            raise CheckpointError(f"no checkpoint of step {int(which)} in {run} (steps: "
                                  f"{steps})")
        return ckpts[int(which)]
    which = str(which)
    if which == "auto" and (run / WEIGHTS).is_file() and (run / META).is_file():
        return run
    named = {name: run / name for name in MODEL_DIRS}
    for d in named.values():
        recover_dir(d)
    if which == "latest" or which == "auto":
        ckpts = list_checkpoints(run)
        latest = ckpts[-1] if ckpts else None
        if which == "latest":
            if latest is None:
                raise CheckpointError(f"no checkpoint in run directory {run}")
            return latest
        for cand in (named["averaged"], named["best"], latest):
            if cand is not None and (cand / WEIGHTS).is_file():
                return cand
        raise CheckpointError(f"no checkpoint in run directory {run}")
    path = named.get(which, Path(which))
    if not (path / WEIGHTS).is_file() and (run / path / WEIGHTS).is_file():
        path = run / path  # a path inside the run
    if not (path / WEIGHTS).is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    return path


def load_resolved(run_dir: str | Path, which: str, load: Callable[[Path], T],
                  attempts: int = 3) -> T:
    """``load(resolve_checkpoint(run_dir, which))``. A checkpoint rewritten while it is read
    (:class:`CheckpointChanged`: a training run replacing ``best/``) is read again; with
    ``auto`` or ``latest``, one that vanishes while it is read (a training run's ``keep_last``
    deleting it: its weights gone, the folder maybe not yet) is replaced by the next newest;
    up to ``attempts`` times. Any other failure is raised as it is."""
    for _ in range(attempts - 1):
        path = resolve_checkpoint(run_dir, which)
        try:
            return load(path)
        except CheckpointChanged:
            continue
        except (CheckpointError, FileNotFoundError):
            if which not in ("auto", "latest") or (path / WEIGHTS).is_file():
                raise
    return load(resolve_checkpoint(run_dir, which))


def load_weights_prefixed(model: nn.Module, directory: str | Path,
                          prefixes: tuple[str, ...], exclude: tuple[str, ...] = ()) -> list[str]:
    """Load the weights of ``model`` whose names start with one of ``prefixes`` (and none of
    ``exclude``) from a checkpoint of another model (e.g. a pre-trained encoder under a new
    head); the others keep their values. Every such weight must be in the checkpoint with
    the same shape and dtype, else :class:`CheckpointError` names the first that is not.
    Returns the names loaded."""
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"no checkpoint in {directory} (missing {WEIGHTS})")
    if (Path(directory) / META).is_file():
        verify_file(Path(directory), WEIGHTS)
    try:
        saved = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"corrupt checkpoint {path}: {e}") from None
    own = model.state_dict()
    wanted = [k for k in own if k.startswith(prefixes) and not k.startswith(exclude)]
    for k in wanted:
        t = saved.get(k)
        if t is None:
            raise CheckpointError(f"checkpoint {path} has no {k}")
        if t.shape != own[k].shape or t.dtype != own[k].dtype:
            raise CheckpointError(f"checkpoint {path}: {k} is {tuple(t.shape)} {t.dtype}, the "
                                  f"model expects {tuple(own[k].shape)} {own[k].dtype}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"checkpoint {path}: {k} holds non-finite values")
    with torch.no_grad():
        for k in wanted:
            own[k].copy_(saved[k])
    return wanted
