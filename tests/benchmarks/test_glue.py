"""benchmarks/glue.py's run configs: the pre-training's options, the text it adds, and the
fine-tunings it hands to processes of their own."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from helpers import load_benchmark

REPO = Path(__file__).resolve().parents[2]
GLUE = REPO.parent / "shared" / "data" / "glue"


def _args(runs: Path, **kw) -> argparse.Namespace:
    base = dict(runs=runs, precision="bf16", pretrain_steps=40, pretrain_batch=256,
                pretrain_minutes=3.0, glue_text=False, finetune_steps=20,
                finetune_minutes=1.5, tasks=["sst2", "cola"], inits=["scratch", "pretrained"])
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.skipif(not (GLUE / "SST-2" / "train.tsv").exists(), reason="no GLUE data")
def test_pretraining_text_is_every_tasks_training_sentences_under_the_runs(tmp_path):
    glue = load_benchmark("glue")
    configs = {p: p.read_bytes() for p in (REPO / "configs").glob("*.yaml")}
    cfg = glue.pretrain_config(_args(tmp_path, glue_text=True, tasks=["cola"]))
    text = tmp_path / "glue_unlabelled.txt"
    assert cfg.data.train[1] == str(text)
    assert (cfg.data.batch_size, cfg.train.max_steps, cfg.train.precision) == (256, 40, "bf16")
    assert cfg.run_dir == str(tmp_path / "glue_mlm")
    lines = {t: len((GLUE / t / "train.tsv").read_text().splitlines()) for t in ("SST-2", "CoLA")}
    # both tasks' sentences whichever this command fine-tunes; SST-2 has a header, CoLA none
    assert len(text.read_text().splitlines()) == lines["SST-2"] - 1 + lines["CoLA"]
    assert {p: p.read_bytes() for p in configs} == configs  # no config file written over


def test_pretraining_keeps_the_configs_batch_unless_asked(tmp_path):
    glue = load_benchmark("glue")
    cfg = glue.pretrain_config(_args(tmp_path, pretrain_batch=None, pretrain_steps=None))
    assert (cfg.data.batch_size, cfg.train.max_steps) == (16, 3000)
    assert len(cfg.data.train) == 1


def test_each_fine_tuning_process_repeats_the_limits_for_one_task_and_init(tmp_path):
    glue = load_benchmark("glue")
    args = _args(tmp_path, glue_text=True, tasks=["sst2"])
    cmds = glue.finetune_commands(args)
    assert list(cmds) == ["glue_sst2_scratch", "glue_sst2_pretrained"]
    cmd = cmds["glue_sst2_pretrained"]
    assert cmd[1].endswith("glue.py")
    assert cmd[2:] == ["--runs", str(tmp_path), "--pretrain-minutes", "3.0",
                       "--finetune-minutes", "1.5", "--precision", "bf16",
                       "--pretrain-steps", "40", "--pretrain-batch", "256",
                       "--finetune-steps", "20", "--glue-text", "--tasks", "sst2",
                       "--inits", "pretrained", "--train-only"]
    cfg = glue.finetune_config(args, "sst2", "pretrained")
    assert cfg.train.init_from == str(tmp_path / "glue_mlm")
    assert (cfg.train.max_steps, cfg.train.max_minutes) == (20, 1.5)
    assert glue.finetune_config(args, "cola", "scratch").train.init_from is None


def test_parallel_must_be_positive(capsys, monkeypatch):
    import sys

    glue = load_benchmark("glue")
    monkeypatch.setattr(sys, "argv", ["glue.py", "--parallel", "0"])
    with pytest.raises(SystemExit) as e:
        glue.main()
    assert e.value.code == 2
    assert "--parallel must be at least 1, got 0" in capsys.readouterr().err


def test_report_describes_the_pre_training_from_its_saved_config(tmp_path):
    import yaml

    glue = load_benchmark("glue")
    args = _args(tmp_path, pretrain_batch=None, pretrain_steps=None)
    assert glue.pretraining_text(args) == (
        "MLM on WikiText-2 train, blocks of 128, batch 16, at most 3.0 min and 3000 updates "
        "(cosine schedule), precision bf16")  # no run yet: the options and the config
    cfg = yaml.safe_load((REPO / "configs" / "wikitext2_mlm_small.yaml").read_text())
    cfg["data"]["batch_size"], cfg["train"]["max_steps"] = 256, 11000
    cfg["data"]["train"].append("glue_unlabelled.txt")
    (tmp_path / "glue_mlm").mkdir()
    (tmp_path / "glue_mlm" / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert glue.pretraining_text(args) == (  # the run's own, whatever the options say
        "MLM on WikiText-2 train + the SST-2 and CoLA training sentences (labels dropped), "
        "blocks of 128, batch 256, at most 15.0 min and 11000 updates (cosine schedule), "
        "precision fp32")
