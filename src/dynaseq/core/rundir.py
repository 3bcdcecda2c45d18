"""A run directory: ``config.yaml``, tokenizer or vocabulary files, ``log.jsonl``,
``checkpoints/step_*``, ``best/``, ``averaged/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynaseq.core.config import load_config
from dynaseq.core.errors import CheckpointError


def open_run(run_dir: str | Path) -> tuple[Path, Any]:
    """The run directory's path and its parsed config (the type its ``task:`` names).

    Raises:
        CheckpointError: no such directory, or no ``config.yaml`` in it.
        ConfigError: a config that does not parse.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise CheckpointError(f"run directory not found: {run}")
    if not (run / "config.yaml").is_file():
        raise CheckpointError(f"{run} is not a run directory (no config.yaml)")
    return run, load_config(run / "config.yaml")
