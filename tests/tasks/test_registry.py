"""``dynaseq.load`` serves every run kind through the task tables, and every task's
predictor meets the Predictor protocol."""

from __future__ import annotations

import pytest

import dynaseq
from dynaseq.core.errors import CheckpointError, ConfigError
from dynaseq.tasks.lm.config import LMRunConfig
from dynaseq.tasks.lm.predictor import LanguageModel
from dynaseq.tasks.protocol import Predictor
from dynaseq.tasks.registry import PREDICTORS, TASKS, run_kind, task_for
from dynaseq.tasks.translation.config import RunConfig
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.train.loop import train

from helpers import lm_config


def test_load_returns_each_tasks_predictor(tmp_path, trained_run):
    from dynaseq.core.errors import DynaseqError

    with pytest.raises(DynaseqError, match="is not a language-model run"):
        LanguageModel.load(trained_run)
    t = dynaseq.load(trained_run)
    assert type(t) is Translator and isinstance(t, Predictor)
    assert t.translate(["kalo mintu"], beam=1)  # the task's own method
    train(lm_config(tmp_path, "train.max_steps=2"), progress=False)
    lm = dynaseq.load(tmp_path / "run")
    assert type(lm) is LanguageModel and isinstance(lm, Predictor)
    assert len(lm.generate(n_tokens=3, temperature=0)) > 0
    assert (run_kind(trained_run), run_kind(tmp_path / "run")) == ("seq2seq", "lm")


def test_every_config_type_has_a_task_and_a_predictor():
    from dynaseq.tasks.classify.config import ClassifyRunConfig
    from dynaseq.tasks.mlm.config import MLMRunConfig

    assert set(TASKS) == set(PREDICTORS) == {RunConfig, LMRunConfig, MLMRunConfig,
                                             ClassifyRunConfig}


def test_load_and_task_for_refuse_bad_input(tmp_path):
    with pytest.raises(CheckpointError, match="run directory not found"):
        dynaseq.load(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no config.yaml"):
        dynaseq.load(tmp_path)
    for empty in ("", " "):  # not the working directory (Path("") is ".")
        with pytest.raises(CheckpointError, match="must be named, got an empty path"):
            dynaseq.load(empty)
    for bad in (None, 3):  # not a path: the error says so (before: a bare TypeError)
        with pytest.raises(CheckpointError, match=rf"a run directory is a path .*got {bad}"):
            dynaseq.load(bad)
    (tmp_path / "config.yaml").write_text("task: lm\n")
    with pytest.raises(CheckpointError, match="config.yaml is a file, not a run directory"):
        dynaseq.load(tmp_path / "config.yaml")
    (tmp_path / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="no task trains a dict"):
        task_for({})
    with pytest.raises(ConfigError, match="data.train_src is required"):
        task_for(RunConfig())
    assert not any(tmp_path.iterdir())  # refusals write nothing


def test_a_language_model_refuses_a_budget(tmp_path):
    from dynaseq.core.errors import DynaseqError

    train(lm_config(tmp_path, "train.max_steps=1"), progress=False)
    lm = dynaseq.load(tmp_path / "run")
    for call in (lambda: lm.generate(n_tokens=2, budget=0.5),
                 lambda: lm.evaluate("valid", budget=0.5)):
        with pytest.raises(DynaseqError, match="no compute-budget knob"):
            call()
    with pytest.raises(DynaseqError, match="is not a translation run"):
        Translator.load(tmp_path / "run")
