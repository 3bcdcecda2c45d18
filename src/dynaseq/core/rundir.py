"""A run directory: ``config.yaml``, tokenizer or vocabulary files, ``log.jsonl``,
``checkpoints/step_*``, ``best/``, ``averaged/``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dynaseq.core.config import config_task, parse_config, read_yaml
from dynaseq.core.errors import CheckpointError, DynaseqError


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
    run = Path(run_dir)
    if not run.is_dir():
        raise CheckpointError(f"run directory not found: {run}")
    if not (run / "config.yaml").is_file():
        raise CheckpointError(f"{run} is not a run directory (no config.yaml)")
    raw = read_yaml(run / "config.yaml")
    if what is not None and config_task(raw) not in types:
        raise DynaseqError(f"{run} is not a {what} run")
    return run, parse_config(raw, types)


def check_new_run_dir(run_dir: Path, out_dir: Path) -> None:
    """Refuse an ``out_dir`` that exists and is not empty, or one inside ``run_dir``."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DynaseqError(f"{out_dir} already exists and is not empty (choose a new --out)")
    r, o = run_dir.resolve(), out_dir.resolve()
    if o == r or r in o.parents:
        raise DynaseqError(f"--out {out_dir} must lie outside the run directory {run_dir}")


def dir_size(path: str | Path) -> int:
    """Bytes of all regular files under ``path`` (or of the file ``path``)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
