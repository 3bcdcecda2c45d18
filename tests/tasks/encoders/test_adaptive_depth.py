"""Adaptive depth (ALBERTa) end to end: MLM pre-training and fine-tuning train the structure
predictor (its compute term logged), the fine-tuned run exits early at γ (batched = one at a
time, mixed γ in a batch = each γ alone, realized depth reported), and the bad inputs of
issue 25 exit with status 2 and one line."""

from __future__ import annotations

import json

import pytest
import torch

import dynaseq
from dynaseq.core.distributed import DistEnv
from dynaseq.core.errors import ConfigError, DynaseqError
from dynaseq.core.runlog import RunLog
from dynaseq.tasks.classify.task import ClassifyTask
from dynaseq.train.loop import train

from encoder_helpers import TINY_MODEL, classify_config, mlm_config, read_events
from helpers import run_cli

DEPTH = ["model.layers=4", "model.depth.first_group=1", "model.depth.predictor_hidden=8",
         "model.relative_positions=4"]


@pytest.fixture(scope="module")
def depth_runs(tmp_path_factory, text_corpus, sst2_small):
    root = tmp_path_factory.mktemp("depth")
    pre = root / "pre"
    train(mlm_config(pre, text_corpus, "train.max_steps=4", "train.valid_every=4",
                     "train.save_every=4", *DEPTH), progress=False)
    ft = root / "ft"
    train(classify_config(ft, sst2_small, f"train.init_from={pre}", "train.max_steps=4",
                          *DEPTH), progress=False)
    return {"pre": pre, "ft": ft}


def test_pretraining_and_finetuning_train_the_predictor(depth_runs, tmp_path, sst2_small):
    for run in depth_runs.values():
        train_events = [e for e in read_events(run) if e["event"] == "train"]
        assert train_events and all(0 < e["expected_depth"] <= 3 for e in train_events)
    valid = [e for e in read_events(depth_runs["ft"]) if e["event"] == "valid"]
    assert valid and all(1 <= e["avg_layers"] <= 4 for e in valid)
    # the pre-trained predictor is what fine-tuning starts from
    pre = dynaseq.load(depth_runs["pre"]).model.encoder.predictor.state_dict()

    task = ClassifyTask(classify_config(tmp_path / "x", sst2_small,
                                        f"train.init_from={depth_runs['pre']}", *DEPTH))
    task.run_dir.mkdir(parents=True)
    task.prepare(DistEnv(), torch.device("cpu"), RunLog(task.run_dir / "log.jsonl", False))
    own = task.model.encoder.predictor.state_dict()
    assert all(torch.equal(own[k], pre[k]) for k in pre)
    # ... unless depth.predictor_from_init is off: a fresh predictor, the layers loaded
    fresh = ClassifyTask(classify_config(tmp_path / "y", sst2_small,
                                         f"train.init_from={depth_runs['pre']}", *DEPTH,
                                         "model.depth.predictor_from_init=false"))
    fresh.run_dir.mkdir(parents=True)
    fresh.prepare(DistEnv(), torch.device("cpu"), RunLog(fresh.run_dir / "log.jsonl", False))
    own = fresh.model.encoder.predictor.state_dict()
    assert not torch.equal(own["out.bias"], pre["out.bias"])
    assert float(own["out.weight"].abs().sum()) == 0.0  # the fresh predictor's init
    layers = dynaseq.load(depth_runs["pre"]).model.encoder.layers.state_dict()
    assert all(torch.equal(v, layers[k])
               for k, v in fresh.model.encoder.layers.state_dict().items())


def test_a_larger_depth_weight_keeps_fewer_layers(tmp_path, sst2_small):
    def expected(weight: float) -> float:
        run = tmp_path / f"w{weight}"
        train(classify_config(run, sst2_small, "train.max_steps=12", "train.lr=0.01",
                              f"model.depth.depth_weight={weight}", *DEPTH), progress=False)
        return [e for e in read_events(run) if e["event"] == "train"][-1]["expected_depth"]

    assert expected(20.0) < expected(0.0) - 0.05


def test_classify_and_evaluate_exit_early(depth_runs, sst2_small):
    c = dynaseq.load(depth_runs["ft"])
    with torch.no_grad():  # a predictor that spreads the depths over the inputs
        c.model.encoder.predictor.out.weight.normal_(0, 3.0)
    lines = ["a charming , moving film", "dull", "an uneven but often funny comedy", "bad"]
    batched = c.classify(lines, gamma=0.5)
    assert batched == [c.classify([x], gamma=0.5)[0] for x in lines]
    gammas = [0.2, 0.8, 0.5, 0.9]
    mixed = c.classify(lines, gamma=gammas)
    assert mixed == [c.classify([x], gamma=g)[0] for x, g in zip(lines, gammas, strict=True)]
    fast, slow = (c.evaluate(sst2_small["dev"], gamma=g) for g in (0.9, 0.1))
    assert 1 <= fast["avg_layers"] <= slow["avg_layers"] <= 4
    assert fast["gamma"] == 0.9 and fast["depth_fraction"] == fast["avg_layers"] / 4
    full = c.evaluate(sst2_small["dev"], depth=3)
    assert full["avg_layers"] == 4 and full["depth"] == 3
    none = c.evaluate(sst2_small["dev"], depth=0)
    assert none["avg_layers"] == 1
    for bad, message in (({"depth": 1.5}, "depth must be an integer, got 1.5"),
                         ({"depth": True}, "depth must be an integer, got True"),
                         ({"gamma": "0.5"}, "gamma is an exit threshold in (0, 1), got '0.5'"),
                         ({"gamma": [0.5, True, 0.5, 0.5]}, "got True")):
        with pytest.raises(DynaseqError) as e:
            c.classify(lines, **bad)
        assert message in str(e.value)


def test_cli_gamma_and_depth(depth_runs, sst2_small):
    run = str(depth_runs["ft"])
    proc = run_cli("evaluate", run, "--data", str(sst2_small["dev"]), "--gamma", "0.3", "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["gamma"] == 0.3
    proc = run_cli("classify", run, "--depth", "2", stdin=b"a fine film\n")
    assert proc.returncode == 0 and proc.stdout.decode().strip() in ("0", "1")
    proc = run_cli("profile", run, "--gamma", "0.5", "--json", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    row = json.loads(proc.stdout)["lengths"]["32"]
    assert row["macs_per_token_flop_counter"] <= row["macs_per_token"]


@pytest.mark.parametrize("args,message", [
    (["evaluate", "{ft}", "--data", "{dev}", "--gamma", "1.5"], "in (0, 1), got 1.5"),
    (["evaluate", "{ft}", "--data", "{dev}", "--gamma", "0"], "in (0, 1), got 0"),
    (["classify", "{ft}", "--depth", "9"], "depth 9 is not in [0, 3]"),
    (["classify", "{ft}", "--depth", "1", "--gamma", "0.5"], "not both"),
    (["evaluate", "{plain}", "--data", "{dev}", "--gamma", "0.5"], "no structure predictor"),
    (["evaluate", "{pre}", "--gamma", "0.5"], "--gamma is for adaptive-depth classification"),
])
def test_bad_exit_inputs_exit_2_with_one_line(depth_runs, sst2_small, args, message, tmp_path):
    plain = tmp_path / "plain"
    if "{plain}" in args:
        train(classify_config(plain, sst2_small, "train.max_steps=1"), progress=False)
    paths = {"ft": str(depth_runs["ft"]), "pre": str(depth_runs["pre"]), "plain": str(plain),
             "dev": str(sst2_small["dev"])}
    proc = run_cli(*[a.format(**paths) for a in args], stdin=b"a film\n")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and message in err, err
    assert err.count("\n") == 1


def test_finetuning_from_a_run_of_another_depth_is_refused(depth_runs, tmp_path, sst2_small):
    for extra, message in (("model.layers=5", "model.layers=4, this config 5"),
                           ("model.depth.first_group=2", "model.depth=")):
        cfg = classify_config(tmp_path / "x", sst2_small, f"train.init_from={depth_runs['pre']}",
                              *DEPTH, extra)
        with pytest.raises(ConfigError, match=message):
            train(cfg, progress=False)
        assert not (tmp_path / "x").exists()
    # a fresh predictor may differ (width, RevPC); the loaded one must match
    other = ["model.depth.revpc=false", "model.depth.predictor_hidden=4"]
    with pytest.raises(ConfigError, match="model.depth="):
        ClassifyTask(classify_config(tmp_path / "x", sst2_small,
                                     f"train.init_from={depth_runs['pre']}", *DEPTH, *other))
    fresh = ClassifyTask(classify_config(tmp_path / "x", sst2_small,
                                         f"train.init_from={depth_runs['pre']}", *DEPTH, *other,
                                         "model.depth.predictor_from_init=false"))
    assert not fresh.cfg.model.depth.revpc and fresh.pretrained is not None
    proc = run_cli("train", "/dev/null", "task=classify", f"run_dir={tmp_path / 'y'}",
                   "data.glue_task=sst2", f"data.train={sst2_small['train']}",
                   f"train.init_from={depth_runs['pre']}", *TINY_MODEL, *DEPTH,
                   "model.layers=6")
    assert proc.returncode == 2 and b"model.layers=4, this config 6" in proc.stderr
    assert not (tmp_path / "y").exists()
