"""Multi-exit classifiers (model.exits: BranchyNet, Shallow-Deep, PABEE on one trained model):
a tiny run trains on the weighted loss of its internal classifiers, the Classifier and the CLI
exit by each rule and report the layers run, batched = one row at a time, bad inputs (one
line, exit status 2)."""

from __future__ import annotations

import json

import pytest
import torch

import dynaseq
from dynaseq.core.distributed import DistEnv
from dynaseq.core.errors import ConfigError, DynaseqError
from dynaseq.core.runlog import RunLog
from dynaseq.tasks.classify.data import collate_rows
from dynaseq.tasks.classify.task import ClassifyMicro, ClassifyTask
from dynaseq.techniques.depth.multi_exit import EXIT_LOGITS
from dynaseq.train.loop import train

from encoder_helpers import classify_config, read_events
from helpers import run_cli

LAYERS = 3
EXITS = "model.exits={weighting: pabee, rule: shallow-deep, max_prob_threshold: 0.6}"


@pytest.fixture(scope="module")
def multi_exit(tmp_path_factory, sst2_small):
    run = tmp_path_factory.mktemp("exits") / "run"
    train(classify_config(run, sst2_small, f"model.layers={LAYERS}", EXITS), progress=False)
    return run


@pytest.fixture(scope="module")
def plain(tmp_path_factory, sst2_small):
    run = tmp_path_factory.mktemp("plain") / "run"
    train(classify_config(run, sst2_small, "train.max_steps=2"), progress=False)
    return run


def test_the_loss_weighs_every_internal_classifier(tmp_path, sst2_small):
    task = ClassifyTask(classify_config(tmp_path / "r", sst2_small, f"model.layers={LAYERS}",
                                        EXITS, "model.dropout=0", "model.classifier_dropout=0"))
    task.run_dir.mkdir(parents=True)
    task.prepare(DistEnv(), torch.device("cpu"), RunLog(task.run_dir / "log.jsonl", False))
    tokens, segments = collate_rows(task.rows[:5], task.vocab.pad_id)
    micro = ClassifyMicro(tokens, segments, task.targets[:5], None)
    out = task.forward(task.model, micro)
    exits = out.aux.traces[EXIT_LOGITS]
    assert len(exits) == LAYERS and torch.equal(exits[-1], out.logits)
    terms = task.loss(out, micro, 0)
    ce = [torch.nn.functional.cross_entropy(z, micro.targets, reduction="sum") for z in exits]
    want = (1 * ce[0] + 2 * ce[1] + 3 * ce[2]) / 6  # PABEE: weights ∝ layer index
    assert torch.allclose(terms.loss, want, atol=1e-5)
    assert terms.nll_sum == pytest.approx(float(ce[-1].detach()), rel=1e-5)  # the final classifier's


def test_a_tiny_multi_exit_run_trains_and_exits_by_each_rule(multi_exit, sst2_small):
    valid = [e for e in read_events(multi_exit) if e.get("event") == "valid"]
    assert valid and all(1 <= e["avg_layers"] <= LAYERS for e in valid)
    c = dynaseq.load(multi_exit)
    dev = sst2_small["dev"]
    default = c.evaluate(dev)  # the run's rule and threshold
    assert default["exit_rule"] == "shallow-deep" and default["threshold"] == 0.6
    for kw in ({"exit_rule": "pabee", "patience": 1}, {"exit_rule": "branchynet",
                                                       "threshold": 0.9},
               {"exit_rule": "shallow-deep", "threshold": 0.55}):
        res = c.evaluate(dev, **kw)
        assert 1 <= res["avg_layers"] <= LAYERS and "accuracy" in res
        assert res["depth_fraction"] == pytest.approx(res["avg_layers"] / LAYERS)
        assert res["exit_rule"] == kw["exit_rule"]
    # thresholds that never / always exit early
    assert c.evaluate(dev, exit_rule="shallow-deep", threshold=1.0)["avg_layers"] == LAYERS
    assert c.evaluate(dev, exit_rule="branchynet", threshold=0.0)["avg_layers"] == LAYERS
    assert c.evaluate(dev, exit_rule="shallow-deep", threshold=0.0)["avg_layers"] == 1
    assert c.evaluate(dev, exit_rule="pabee", patience=LAYERS)["avg_layers"] == LAYERS


def test_batched_classification_equals_one_row_at_a_time(multi_exit, sst2_small):
    c = dynaseq.load(multi_exit)
    lines = [ln.split("\t")[0] for ln in sst2_small["dev"].read_text().splitlines()[1:]]
    thresholds = [0.5 + 0.01 * (i % 40) for i in range(len(lines))]  # one per line
    for kw in ({"exit_rule": "pabee", "patience": 1}, {"threshold": thresholds}):
        batched = c.classify(lines, batch_size=32, **kw)
        alone = c.classify(lines, batch_size=1, **kw)
        assert batched == alone
    assert c.classify(["", "a charming film"], threshold=[0.6, 0.7])[0] is None


def test_the_cli_exits_by_a_rule_and_reports_the_layers_run(multi_exit, sst2_small):
    proc = run_cli("evaluate", str(multi_exit), "--data", str(sst2_small["dev"]), "--json",
                   "--exit-rule", "pabee", "--patience", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    res = json.loads(proc.stdout)
    assert res["exit_rule"] == "pabee" and res["patience"] == 1
    assert 1 <= res["avg_layers"] <= LAYERS
    proc = run_cli("evaluate", str(multi_exit), "--data", str(sst2_small["dev"]),
                   "--threshold", "0.7")
    assert proc.returncode == 0 and "exit rule shallow-deep threshold 0.7" in proc.stdout.decode()
    proc = run_cli("classify", str(multi_exit), "--exit-rule", "branchynet", "--threshold",
                   "0.5", stdin=b"a charming film\n\ndull\n")
    assert proc.returncode == 0 and len(proc.stdout.decode().splitlines()) == 3
    proc = run_cli("profile", str(multi_exit), "--json", "--repeats", "1", "--exit-rule",
                   "pabee", "--patience", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["exit_rule"] == "pabee"


@pytest.mark.parametrize("args, message", [
    (["--exit-rule", "pabee", "--patience", "0"], "pabee's patience is an integer >= 1"),
    (["--threshold", "1.5"], r"threshold is in [0, 1], got 1.5"),
    (["--exit-rule", "branchynet", "--threshold", "-0.1"], "threshold is in [0, 1]"),
    (["--exit-rule", "deebert"], "unknown exit rule 'deebert'"),
    (["--exit-rule", "pabee", "--threshold", "0.5"], "takes --patience, not --threshold"),
    (["--patience", "2"], "the shallow-deep rule takes --threshold, not --patience"),
    (["--gamma", "0.5"], "no structure predictor"),
])
def test_bad_inputs_exit_2_with_one_line(multi_exit, sst2_small, args, message):
    proc = run_cli("evaluate", str(multi_exit), "--data", str(sst2_small["dev"]), *args)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and message in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("command", ["evaluate", "classify", "profile"])
def test_a_rule_on_a_model_without_internal_classifiers_is_refused(plain, sst2_small,
                                                                    command):
    extra = {"evaluate": ["--data", str(sst2_small["dev"])], "classify": [],
             "profile": ["--repeats", "1"]}[command]
    proc = run_cli(command, str(plain), *extra, "--exit-rule", "pabee", stdin=b"x\n")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "no internal classifiers: --exit-rule" in err, err
    assert err.count("\n") == 1
    with pytest.raises(DynaseqError, match="no internal classifiers: --threshold"):
        dynaseq.load(plain).classify(["x"], threshold=0.5)


def test_exits_are_refused_for_a_regression(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text("".join(f"{i / 10}\tthe cat {i}\n" for i in range(30)))
    with pytest.raises(ConfigError, match="is a regression"):
        ClassifyTask(classify_config(tmp_path / "reg", {"train": path, "dev": path}, EXITS,
                                     "data.glue_task=null", "data.columns.text_a=1",
                                     "data.columns.label=0", "data.columns.regression=true",
                                     "data.columns.metrics=[pearson]"))
