"""Which task trains a run config and which predictor loads a run directory: two tables keyed
by the config's type (``task:`` in the YAML selects the type, see
:data:`dynaseq.core.config.TASKS`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynaseq.core.config import LMRunConfig, RunConfig
from dynaseq.core.errors import ConfigError
from dynaseq.core.rundir import open_run
from dynaseq.tasks.lm.predictor import LanguageModel
from dynaseq.tasks.lm.task import LMTask
from dynaseq.tasks.protocol import Predictor, Task
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.tasks.translation.task import TranslationTask

#: run-config type -> the task that trains it (``hooks``: task-specific extension points).
TASKS: dict[type, Any] = {
    RunConfig: TranslationTask,
    LMRunConfig: LMTask,
}

#: run-config type -> the predictor that loads a trained run of it.
PREDICTORS: dict[type, type] = {RunConfig: Translator, LMRunConfig: LanguageModel}


def task_for(cfg: Any, hooks: Any = None) -> Task:
    """The task that trains ``cfg`` (checked; nothing written)."""
    make = TASKS.get(type(cfg))
    if make is None:
        raise ConfigError(f"no task trains a {type(cfg).__name__}")
    return make(cfg, hooks)


def load(run_dir: str | Path, checkpoint: str = "auto", device: str = "auto") -> Predictor:
    """The task's predictor for a trained run directory of any kind (see ``dynaseq.load``)."""
    run, cfg = open_run(run_dir)
    return PREDICTORS[type(cfg)].load(run, checkpoint=checkpoint, device=device)


def run_kind(run_dir: str | Path) -> str:
    """``"lm"`` or ``"seq2seq"``: the task of a run directory's config."""
    _, cfg = open_run(run_dir)
    return "lm" if isinstance(cfg, LMRunConfig) else "seq2seq"
