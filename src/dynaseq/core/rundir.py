"""A run directory: ``config.yaml``, tokenizer or vocabulary files, ``log.jsonl``,
``checkpoints/step_*``, ``best/``, ``averaged/``; or an exported model directory
(``dynaseq export``): ``config.json`` and the weights at its top, read the same way."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dynaseq.core.config import config_task, parse_config, read_yaml
from dynaseq.core.errors import CheckpointError, ConfigError, DynaseqError
from dynaseq.core.files import inside, os_reason, read_text, user_path


def open_run(run_dir: str | Path, types: Mapping[str, type],
             what: str | None = None) -> tuple[Path, Any]:
    """The run directory's path and its parsed config, of the type ``types`` maps its
    ``task:`` to (a predictor passes its own task's, the registry every task's).

    ``what``: what to call a run of the tasks in ``types`` (a run of another task is then
    refused as "not a {what} run" rather than as an unknown task).

    Raises:
        CheckpointError: no such directory, or no ``config.yaml`` in it.
        ConfigError: a config that does not parse.
        DynaseqError: with ``what``, a run of a task ``types`` does not list.
    """
    run = run_path(run_dir)
    raw = read_run_config(run)
    if what is not None and config_task(raw) not in types:
        raise DynaseqError(f"{run} is not a {what} run")
    return run, parse_config(raw, types)


def run_path(run_dir: object) -> Path:
    """``run_dir`` as the path of an existing directory. Raises CheckpointError naming what
    it is instead: not a path (None, a number), a file (e.g. the run's ``config.yaml``), or
    nothing. A leading ``~`` is the home directory (:func:`~dynaseq.core.files.user_path`)."""
    if not isinstance(run_dir, str | os.PathLike):
        raise CheckpointError(f"a run directory is a path (str or pathlib.Path), got "
                              f"{run_dir!r}")
    if not os.fspath(run_dir).strip():  # Path("") is the working directory: never meant
        raise CheckpointError("a run directory must be named, got an empty path")
    run = user_path(run_dir)
    if run.is_file():
        raise CheckpointError(f"{run} is a file, not a run directory: give the directory "
                              "that holds it")
    if not run.is_dir():
        raise CheckpointError(f"run directory not found: {run}")
    return run


#: the installed package: the model shipped in it (``dynaseq demo``'s) is read only
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def check_not_shipped(run: str | Path, what: str) -> None:
    """Refuse (DynaseqError) to write ``what`` (e.g. "calibration.json") into a model inside
    the installed dynaseq package, the shipped demo model: a file there would change what
    ``dynaseq demo`` shows, outlive ``pip uninstall`` and, in a checkout, enter the next
    wheel."""
    if Path(run).resolve().is_relative_to(PACKAGE_DIR):
        raise DynaseqError(f"{run} is the model shipped with dynaseq, which is read only: "
                           f"write {what} into a copy (dynaseq export {run} --out DIR)")


def read_run_config(run: Path) -> dict[str, Any]:
    """The run-config mapping of a run directory (``config.yaml``) or an exported model
    directory (``config.json``). Raises CheckpointError when it has neither, ConfigError for
    an empty or unreadable one."""
    if (run / "config.yaml").is_file():
        raw = read_yaml(run / "config.yaml")
        if not raw:  # a run's saved config always holds its settings
            raise ConfigError(f"{run / 'config.yaml'} is empty")
        return raw
    if (run / MODEL_CONFIG).is_file():
        return read_model_config(run / MODEL_CONFIG)
    raise CheckpointError(f"{run} is not a run directory (no config.yaml) nor an exported "
                          f"model ({MODEL_CONFIG})")


#: The config of an exported model directory (``dynaseq export``).
MODEL_CONFIG = "config.json"
#: ``format`` of :data:`MODEL_CONFIG`.
MODEL_FORMAT = "dynaseq-model"
#: Version of the :data:`MODEL_CONFIG` layout.
MODEL_VERSION = 1


def read_model_config(path: Path) -> dict[str, Any]:
    """The run-config mapping in an exported model's ``config.json`` (``{"format":
    "dynaseq-model", "version": 1, "config": {...}}``).

    Raises:
        ConfigError: not JSON, or not a dynaseq model config.
    """
    try:
        payload = json.loads(read_text(path, "model config", ConfigError))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not (isinstance(payload, dict) and payload.get("format") == MODEL_FORMAT
            and isinstance(payload.get("config"), dict)):
        raise ConfigError(f"{path} is not a dynaseq model config (format {MODEL_FORMAT!r})")
    if payload.get("version") != MODEL_VERSION:
        raise ConfigError(f"{path} has layout version {payload.get('version')!r}; this "
                          f"dynaseq reads version {MODEL_VERSION}")
    unknown = sorted(set(payload) - {"format", "version", "config"})
    if unknown:
        raise ConfigError(f"{path} has unknown keys: {', '.join(map(str, unknown))}")
    return payload["config"]


def check_new_run_dir(run_dir: Path, out_dir: Path) -> None:
    """Refuse an ``out_dir`` that exists and is not empty, or one inside ``run_dir``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DynaseqError(f"{out_dir} is a file, not a folder (choose a new --out)")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise DynaseqError(f"{out_dir} already exists and is not empty (choose a new --out)")
    if inside(out_dir, run_dir):
        raise DynaseqError(f"--out {out_dir} must lie outside the run directory {run_dir}")


def dir_size(path: str | Path) -> int:
    """Bytes of all regular files under ``path`` (or of the file ``path``)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


@contextlib.contextmanager
def writing_new_dir(out: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to fill; when the block ends without an error its files
    are flushed to disk and it is renamed to ``out`` (an empty ``out`` is replaced), else it
    is removed: a failure leaves no half-written directory."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        try:
            tmp.mkdir()
        except OSError as e:  # named as the output, not as its temporary sibling
            raise DynaseqError(f"cannot write {out}: {os_reason(e)}") from None
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if out.exists():  # an empty directory (check_new_run_dir): rename replaces it
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
