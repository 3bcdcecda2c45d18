"""The tasks' tables: which run-config type a ``task:`` names (:data:`RUN_CONFIGS`), which
task trains a run config and which predictor loads a run directory (keyed by the config's
type). Adding a task is a folder under ``tasks/`` and one entry in each table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynaseq.core.config import load_config as load_typed_config
from dynaseq.core.errors import ConfigError
from dynaseq.core.rundir import open_run
from dynaseq.tasks.classify import config as classify_config
from dynaseq.tasks.classify.config import ClassifyRunConfig
from dynaseq.tasks.classify.predictor import Classifier
from dynaseq.tasks.classify.task import ClassifyTask
from dynaseq.tasks.lm import config as lm_config
from dynaseq.tasks.lm.config import LMRunConfig
from dynaseq.tasks.lm.predictor import LanguageModel
from dynaseq.tasks.lm.task import LMTask
from dynaseq.tasks.mlm import config as mlm_config
from dynaseq.tasks.mlm.config import MLMRunConfig
from dynaseq.tasks.mlm.predictor import MaskedLM
from dynaseq.tasks.mlm.task import MLMTask
from dynaseq.tasks.protocol import Predictor, Task
from dynaseq.tasks.translation import config as translation_config
from dynaseq.tasks.translation.config import RunConfig
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.tasks.translation.task import TranslationTask

#: ``task:`` in a config -> its run-config type (a config without ``task:`` is a translation
#: config).
RUN_CONFIGS: dict[str, type] = {
    translation_config.TASK: RunConfig,
    lm_config.TASK: LMRunConfig,
    mlm_config.TASK: MLMRunConfig,
    classify_config.TASK: ClassifyRunConfig,
}

#: run-config type -> the task that trains it (``hooks``: task-specific extension points).
TASKS: dict[type, Any] = {
    RunConfig: TranslationTask,
    LMRunConfig: LMTask,
    MLMRunConfig: MLMTask,
    ClassifyRunConfig: ClassifyTask,
}

#: run-config type -> the predictor that loads a trained run of it.
PREDICTORS: dict[type, type] = {RunConfig: Translator, LMRunConfig: LanguageModel,
                                MLMRunConfig: MaskedLM, ClassifyRunConfig: Classifier}


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """A YAML run config of any task (or the defaults when ``path`` is None) with
    ``key.sub=value`` overrides, as the type its ``task:`` names (:data:`RUN_CONFIGS`)."""
    return load_typed_config(path, overrides, RUN_CONFIGS)


def task_for(cfg: Any, hooks: Any = None) -> Task:
    """The task that trains ``cfg`` (checked; nothing written)."""
    make = TASKS.get(type(cfg))
    if make is None:
        raise ConfigError(f"no task trains a {type(cfg).__name__}")
    return make(cfg, hooks)


def load(run_dir: str | Path, checkpoint: str = "auto", device: str = "auto",
         precision: str = "fp32") -> Predictor:
    """The task's predictor for a trained run directory of any kind (see ``dynaseq.load``)."""
    run, cfg = open_run(run_dir, RUN_CONFIGS)
    return PREDICTORS[type(cfg)].load(run, checkpoint=checkpoint, device=device,
                                      precision=precision)


def run_kind(run_dir: str | Path) -> str:
    """The task of a run directory's config (``"seq2seq"``, ``"lm"``, ``"mlm"``, ...)."""
    _, cfg = open_run(run_dir, RUN_CONFIGS)
    return next(task for task, cls in RUN_CONFIGS.items() if isinstance(cfg, cls))
