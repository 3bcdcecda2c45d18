"""The two fixed-compute baselines of adaptive depth on a fine-tuned classifier: LayerDrop
(training draws per micro-batch, exact resume, ``--keep-layers`` on classify/evaluate/profile)
and HeadPrune (``dynaseq prune-heads``: a new run that reloads with the same logits), and their
bad inputs (one line, exit status 2, nothing written)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import dynaseq
from dynaseq.compress.head_prune import prune_heads
from dynaseq.core.checkpoint import list_checkpoints
from dynaseq.core.distributed import DistEnv
from dynaseq.core.runlog import RunLog
from dynaseq.tasks.classify.data import encode_examples
from dynaseq.tasks.classify.glue import read_table
from dynaseq.tasks.classify.predictor import Classifier, predict_logits
from dynaseq.tasks.classify.task import ClassifyTask
from dynaseq.techniques.depth.layerdrop import sample_layers
from dynaseq.train.loop import train
from dynaseq.workflows.head_prune import REPORT_FILE

from encoder_helpers import classify_config
from helpers import run_cli

LAYERDROP = ["model.layerdrop=0.4", "model.layers=4", "train.schedule=inverse_sqrt"]


@pytest.fixture(scope="module")
def layerdrop_run(tmp_path_factory, sst2_small):
    run = tmp_path_factory.mktemp("ld") / "run"
    train(classify_config(run, sst2_small, *LAYERDROP), progress=False)
    return run


def _one_line_error(proc, text: str) -> None:
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("dynaseq: error: ") and text in err, err


def test_training_draws_the_layers_of_each_micro_batch(tmp_path, sst2_small):
    cfg = classify_config(tmp_path / "r", sst2_small, *LAYERDROP, "train.update_freq=2")

    def prepared() -> ClassifyTask:
        task = ClassifyTask(cfg)
        task.run_dir.mkdir(parents=True, exist_ok=True)
        task.prepare(DistEnv(), torch.device("cpu"), RunLog(task.run_dir / "log.jsonl", False))
        return task

    task = prepared()
    upd = task.update(0, 1, 5, DistEnv())
    assert [m.layers for m in upd.micro] == [sample_layers(4, 0.4, cfg.train.seed, 5, i)
                                             for i in range(2)]
    again = prepared().update(0, 1, 5, DistEnv())  # a resumed run draws the same
    assert [m.layers for m in again.micro] == [m.layers for m in upd.micro]
    entered: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: entered.append(i))
             for i, layer in enumerate(task.model.encoder.layers)]
    task.forward(task.model, upd.micro[0])
    for h in hooks:
        h.remove()
    assert tuple(entered) == upd.micro[0].layers


def test_layerdrop_resume_is_exact(tmp_path, sst2_small):
    """6 updates in one go == 3, a stop, and 3 more: the dropped layers come from (seed, step,
    micro-batch), not from a generator's state."""
    train(classify_config(tmp_path / "a", sst2_small, *LAYERDROP), progress=False)
    train(classify_config(tmp_path / "b", sst2_small, *LAYERDROP, "train.max_steps=3"),
          progress=False)
    train(classify_config(tmp_path / "b", sst2_small, *LAYERDROP), progress=False)
    a = load_file(str(list_checkpoints(tmp_path / "a")[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(tmp_path / "b")[-1] / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_keep_layers_on_classify_evaluate_and_profile(layerdrop_run, sst2_small):
    c = Classifier.load(layerdrop_run)
    result = c.evaluate(sst2_small["dev"], keep_layers=2)
    assert result["keep_layers"] == 2 and result["layers_run"] == [0, 2]
    assert result["avg_layers"] == 2.0 and result["depth_fraction"] == 0.5
    proc = run_cli("evaluate", str(layerdrop_run), "--data", str(sst2_small["dev"]),
                   "--keep-layers", "2", "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout) == result
    lines = [ln.split("\t")[0] for ln in sst2_small["dev"].read_text().splitlines()[1:21]]
    proc = run_cli("classify", str(layerdrop_run), "--keep-layers", "2",
                   stdin="\n".join(lines).encode() + b"\n")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().splitlines() == c.classify(lines, keep_layers=2)
    proc = run_cli("profile", str(layerdrop_run), "--keep-layers", "1", "--repeats", "1",
                   "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    one = json.loads(proc.stdout)
    assert one["keep_layers"] == 1 and one["layers_run"] == [0]
    row = one["lengths"]["32"]
    # a quarter of the layers: the analytic count agrees with the flop counter
    assert row["macs_per_token"] == pytest.approx(row["macs_per_token_flop_counter"], rel=1e-6)
    proc = run_cli("evaluate", str(layerdrop_run), "--data", str(sst2_small["dev"]),
                   "--keep-layers", "5")
    _one_line_error(proc, "keep-layers 5 is not in [1, 4]")


def test_layerdrop_outside_its_range_is_refused(tmp_path, sst2_small):
    proc = run_cli("train", "/dev/null", "task=classify", f"run_dir={tmp_path / 'x'}",
                   "data.glue_task=sst2", f"data.train={sst2_small['train']}",
                   "model.layerdrop=1.0")
    _one_line_error(proc, "layerdrop must be in [0, 1)")
    assert not (tmp_path / "x").exists()


def test_prune_heads_writes_a_run_that_reloads_with_the_same_logits(layerdrop_run, sst2_small,
                                                                     tmp_path, mlm_run):
    out = tmp_path / "pruned"
    proc = run_cli("prune-heads", str(layerdrop_run), "--data", str(sst2_small["dev"]),
                   "--keep", "0.5", "--out", str(out))
    assert proc.returncode == 0, proc.stderr.decode()
    assert "heads 8 -> 4" in proc.stdout.decode()
    report = json.loads((out / REPORT_FILE).read_text())
    assert [len(i) for i in report["importance"]] == [2, 2, 2, 2]  # one per head
    assert sum(report["layer_heads"]) == 4 and report["params_after"] < report["params_before"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["best", "config.yaml", "spm.model", "spm.vocab", REPORT_FILE])
    source = Classifier.load(layerdrop_run)
    reloaded = dynaseq.load(out)
    assert isinstance(reloaded, Classifier)
    assert reloaded.config.model.layer_heads == report["layer_heads"]
    ex = read_table(sst2_small["dev"], source.layout)
    rows = encode_examples(source.vocab, ex, 40)
    by_hand = prune_heads(source.model, report["kept_heads"])
    assert torch.allclose(predict_logits(reloaded.model, rows, 16, torch.device("cpu")),
                          predict_logits(by_hand, rows, 16, torch.device("cpu")), atol=1e-6)
    after = reloaded.evaluate(sst2_small["dev"])
    assert after["accuracy"] == report["after"]["accuracy"]
    assert reloaded.evaluate(sst2_small["dev"], keep_layers=2)["avg_layers"] == 2.0
    # refusals: an existing run, a keep fraction outside (0, 1], a run of another kind
    proc = run_cli("prune-heads", str(layerdrop_run), "--data", str(sst2_small["dev"]),
                   "--keep", "0.5", "--out", str(out))
    _one_line_error(proc, "already exists and is not empty")
    for keep in ("0", "1.5", "-0.2"):
        proc = run_cli("prune-heads", str(layerdrop_run), "--data", str(sst2_small["dev"]),
                       "--keep", keep, "--out", str(tmp_path / "bad"))
        _one_line_error(proc, "fraction of heads to keep, in (0, 1]")
    proc = run_cli("prune-heads", str(mlm_run), "--data", str(sst2_small["dev"]),
                   "--keep", "0.5", "--out", str(tmp_path / "bad"))
    _one_line_error(proc, "prune-heads takes classification runs")
    assert not (tmp_path / "bad").exists()
