"""Fine-tuning: from scratch and from a pre-trained MLM run (weights really loaded), the
Classifier and the CLI, bad inputs (one line, exit status 2), CCT-BERT budgets."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import dynaseq
from dynaseq.core.checkpoint import read_meta
from dynaseq.core.distributed import DistEnv
from dynaseq.core.errors import ConfigError, DynaseqError
from dynaseq.core.files import sha256_file
from dynaseq.core.runlog import RunLog
from dynaseq.tasks.classify.predictor import Classifier, RealizedCompute
from dynaseq.tasks.classify.task import ClassifyTask
from dynaseq.train.loop import train

from encoder_helpers import classify_config, write_pair_table
from helpers import REPO, run_cli


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, mlm_run, sst2_small):
    run = tmp_path_factory.mktemp("clf") / "run"
    train(classify_config(run, sst2_small, f"train.init_from={mlm_run}"), progress=False)
    return run


def _prepared(cfg) -> ClassifyTask:
    task = ClassifyTask(cfg)
    task.run_dir.mkdir(parents=True, exist_ok=True)
    task.prepare(DistEnv(), torch.device("cpu"), RunLog(task.run_dir / "log.jsonl", False))
    return task


def test_pretrained_weights_are_loaded(tmp_path, mlm_run, sst2_small):
    cfg = classify_config(tmp_path / "a", sst2_small, f"train.init_from={mlm_run}")
    task = _prepared(cfg)
    saved = load_file(str(mlm_run / "best" / "model.safetensors"))
    own = task.model.state_dict()
    encoder_keys = [k for k in own if k.startswith("encoder.")]
    assert encoder_keys and all(torch.equal(own[k], saved[k]) for k in encoder_keys)
    assert (tmp_path / "a" / "spm.model").read_bytes() == (mlm_run / "spm.model").read_bytes()
    # a changed pre-trained weight changes the fine-tuned model's output
    changed = tmp_path / "changed"
    shutil.copytree(mlm_run, changed)
    weights = changed / "best" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["encoder.layers.1.ffn.fc1.weight"] += 0.5
    save_file(tensors, str(weights))
    meta = read_meta(changed / "best")
    meta["sha256"]["model.safetensors"] = sha256_file(weights)
    (changed / "best" / "meta.json").write_text(json.dumps(meta))
    other = _prepared(classify_config(tmp_path / "b", sst2_small, f"train.init_from={changed}"))
    x = torch.tensor([[4, 20, 30, 40, 5]])
    m1, m2 = task.model.eval(), other.model.eval()
    assert torch.equal(m1.head.out.weight, m2.head.out.weight)  # same seed: same new head
    assert not torch.equal(m1(x).logits, m2(x).logits)
    scratch = _prepared(classify_config(tmp_path / "c", sst2_small))
    assert not torch.equal(scratch.model.state_dict()["encoder.layers.0.ffn.fc1.weight"],
                           own["encoder.layers.0.ffn.fc1.weight"])


def test_an_exported_pretrained_model_initializes_as_its_run_does(tmp_path, mlm_run,
                                                                     sst2_small):
    from dynaseq.workflows.export import export_model

    exported = tmp_path / "mlm_model"
    export_model(mlm_run, exported)
    from_run = _prepared(classify_config(tmp_path / "a", sst2_small,
                                         f"train.init_from={mlm_run}"))
    from_export = _prepared(classify_config(tmp_path / "b", sst2_small,
                                            f"train.init_from={exported}"))
    a, b = from_run.model.state_dict(), from_export.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="is not a run directory .* nor an exported model"):
        ClassifyTask(classify_config(tmp_path / "c", sst2_small, f"train.init_from={tmp_path}"))


def test_init_from_mismatch_is_refused_before_writing(tmp_path, mlm_run, sst2_small):
    for extra, message in (("model.layers=3", "model.layers=2, this config 3"),
                           ("model.embedding_dim=16", "model.embedding_dim=32, this config 16"),
                           ("model.cct.ffn_pieces=2", "model.cct=None")):
        cfg = classify_config(tmp_path / "x", sst2_small, f"train.init_from={mlm_run}", extra)
        with pytest.raises(ConfigError, match=message):
            train(cfg, progress=False)
        assert not (tmp_path / "x" / "config.yaml").exists()
    proc = run_cli("train", "/dev/null", "task=classify", f"run_dir={tmp_path / 'y'}",
                   "data.glue_task=sst2", f"data.train={sst2_small['train']}",
                   f"train.init_from={tmp_path}")
    assert proc.returncode == 2 and b"is not a run directory" in proc.stderr
    # a run whose vocabulary is another one's
    run = tmp_path / "z"
    run.mkdir()
    (run / "spm.model").write_bytes(b"other")
    with pytest.raises(ConfigError, match="is not the vocabulary of train.init_from"):
        ClassifyTask(classify_config(run, sst2_small, f"train.init_from={mlm_run}"))


def test_classify_stream_answers_as_classify(finetuned, tmp_path):
    """``classify --stream`` (each line answered at batch 1 as it is read, through the same
    loop as ``translate --stream``) gives ``classify``'s lines; a file option is refused."""
    stdin = b"a charming film\n\ndull and lifeless\t\r\nbright\n"  # a trailing tab is space
    want = run_cli("classify", str(finetuned), stdin=stdin)
    got = run_cli("classify", str(finetuned), "--stream", stdin=stdin)
    assert want.returncode == got.returncode == 0, got.stderr.decode()
    assert got.stdout == want.stdout and got.stdout.decode().split("\n")[1] == ""
    assert got.stdout.decode().split("\n")[2] == dynaseq.load(finetuned).classify(
        ["dull and lifeless"])[0]
    out = tmp_path / "labels.txt"
    proc = run_cli("classify", str(finetuned), "--stream", "-o", str(out), stdin=stdin)
    assert proc.returncode == 2 and "drop --output" in proc.stderr.decode()
    assert not out.exists()


def test_finetuned_run_classifies_and_evaluates(finetuned, sst2_small):
    c = dynaseq.load(finetuned)
    assert isinstance(c, Classifier)
    out = c.classify(["a charming , moving film", "", "dull and lifeless"])
    assert out[1] is None and {out[0], out[2]} <= {"0", "1"}
    r = c.evaluate(sst2_small["dev"])
    assert r["n_examples"] == 60 and r["skipped"] == 0 and 0 <= r["accuracy"] <= 1
    proc = run_cli("classify", str(finetuned), stdin=b"a charming film\n\ndull\n")
    assert proc.returncode == 0, proc.stderr.decode()
    lines = proc.stdout.decode().split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[0] in ("0", "1")
    proc = run_cli("evaluate", str(finetuned), "--data", str(sst2_small["dev"]), "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["accuracy"] == pytest.approx(r["accuracy"])
    proc = run_cli("profile", str(finetuned), "--json", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    res = json.loads(proc.stdout)
    for s in ("32", "128"):
        row = res["lengths"][s]
        assert row["macs_per_token"] == row["macs_per_token_flop_counter"]
        assert row["latency_ms_b1"] > 0 and row["sentences_per_s_b32"] > 0
    # one length of the user's; a model of fewer positions than 128 times what it takes
    proc = run_cli("profile", str(finetuned), "--json", "--repeats", "1", "--src-len", "7")
    assert proc.returncode == 0 and list(json.loads(proc.stdout)["lengths"]) == ["7"]
    proc = run_cli("profile", str(REPO / "configs/sst2_small.yaml"), "model.max_positions=64",
                   "data.max_len=60", "--json", "--repeats", "1")
    assert proc.returncode == 0 and list(json.loads(proc.stdout)["lengths"]) == ["32"], (
        proc.stderr)
    proc = run_cli("profile", str(finetuned), "--tgt-len", "7")
    assert proc.returncode == 2 and b"--tgt-len is for translation runs" in proc.stderr


@pytest.mark.parametrize("args,stdin,message", [
    (["evaluate", "{run}", "--data", "{cola}"], None, "header has no column 'sentence'"),
    (["evaluate", "{run}", "--data", "{empty}"], None, "is empty"),
    (["evaluate", "{run}", "--data", "{badlabel}"], None, "label '7' is not one of 0, 1"),
    (["evaluate", "{run}"], None, "--data FILE"),
    (["evaluate", "{run}", "--data", "{dev}", "--budget", "0.5"], None,  # no calibrate hint
     "no compute-budget knob (train it with a model.cct section to get one)\n"),
    (["classify", "{run}"], b"one\ttwo\n", "takes one sentence per line"),
    (["classify", "{run}", "--budget", "1,0.5"], b"x\n", "one fraction"),
    (["translate", "{run}"], b"x\n", "translate takes translation runs"),
])
def test_bad_inputs_exit_2_with_one_line(tmp_path, finetuned, sst2_small, args, stdin,
                                         message):
    from helpers import SHARED_DATA

    (tmp_path / "empty.tsv").write_text("")
    (tmp_path / "bad.tsv").write_text("sentence\tlabel\nnice\t7\n")
    paths = {"run": str(finetuned), "cola": str(SHARED_DATA / "glue" / "CoLA" / "dev.tsv"),
             "empty": str(tmp_path / "empty.tsv"), "badlabel": str(tmp_path / "bad.tsv"),
             "dev": str(sst2_small["dev"])}
    proc = run_cli(*[a.format(**paths) for a in args], stdin=stdin)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and message in err, err
    assert err.count("\n") == 1


def test_a_pair_task_refuses_single_sentences(tmp_path, mlm_run):
    train_tsv = write_pair_table(tmp_path / "train.tsv", 40)
    data = {"train": train_tsv, "dev": train_tsv}
    run = tmp_path / "rte"
    train(classify_config(run, data, "data.glue_task=rte", "train.max_steps=2",
                          f"train.init_from={mlm_run}"), progress=False)
    c = dynaseq.load(run)
    assert c.classify(["the cat sat\ta cat sat", ("x", "y")]) [0] in ("entailment",
                                                                      "not_entailment")
    with pytest.raises(DynaseqError, match="sentence-pair task"):
        c.classify(["the cat sat"])
    # a pair with an empty side is an empty line (skipped) on the command line as in Python
    lines = b"the cat sat\ta cat sat\r\n\ta cat sat\nthe cat sat\t\n \t \n"
    proc = run_cli("classify", str(run), stdin=lines)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split("\n") == [c.classify([("the cat sat", "a cat sat")])[0],
                                                "", "", "", ""]
    assert c.classify(["\ta cat sat", "the cat sat\t"]) == [None, None]
    # a stray tab at either end of a whole pair (a spreadsheet's export) is white space
    pair = c.classify([("the cat sat", "a cat sat")])
    assert c.classify(["the cat sat\ta cat sat\t", "\tthe cat sat\ta cat sat"]) == pair * 2
    # single-sentence data for a pair task: the header lacks the second sentence
    single = tmp_path / "single.tsv"
    single.write_text("sentence\tlabel\nthe cat\t1\n")
    proc = run_cli("evaluate", str(run), "--data", str(single))
    assert proc.returncode == 2 and b"no column 'sentence1'" in proc.stderr


def test_column_spec_regression_and_learned_labels(tmp_path, mlm_run):
    path = tmp_path / "t.tsv"
    path.write_text("".join(f"{i / 10}\tthe cat {i}\tx\n" for i in range(30)))
    run = tmp_path / "reg"
    train(classify_config(run, {"train": path, "dev": path}, "data.glue_task=null",
                          "data.columns.text_a=1", "data.columns.label=0",
                          "data.columns.regression=true",
                          "data.columns.metrics=[pearson, spearman]", "train.max_steps=2"),
          progress=False)
    c = dynaseq.load(run)
    assert isinstance(c.classify(["the cat 3"])[0], float)
    assert set(c.evaluate(path)) >= {"pearson", "spearman"}
    labels = tmp_path / "l.tsv"
    labels.write_text("".join(f"{'pos' if i % 2 else 'neg'}\tthe dog {i}\n" for i in range(30)))
    run2 = tmp_path / "lab"
    train(classify_config(run2, {"train": labels, "dev": labels}, "data.glue_task=null",
                          "data.columns.text_a=1", "data.columns.label=0", "train.max_steps=2"),
          progress=False)
    c2 = dynaseq.load(run2)
    assert c2.config.data.columns.labels == ["neg", "pos"]  # saved with the run
    assert c2.classify(["the dog 1"])[0] in ("neg", "pos")


def test_cct_bert_finetunes_and_reports_realized_compute(tmp_path, text_corpus, sst2_small):
    from encoder_helpers import mlm_config

    cct = ["model.cct.ffn_pieces=2", "model.cct.control_hidden=8", "model.cct.noise_ramp_steps=4"]
    pre = tmp_path / "pre"
    train(mlm_config(pre, text_corpus, "train.max_steps=4", "train.valid_every=4",
                     "train.save_every=4", *cct), progress=False)
    run = tmp_path / "ft"
    train(classify_config(run, sst2_small, f"train.init_from={pre}", "train.max_steps=4",
                          "model.cct.budget_weight=0.1", *cct), progress=False)
    c = dynaseq.load(run)
    full = c.evaluate(sst2_small["dev"])
    assert full["budget"] == 0.8 and 0 < full["realized_fraction"] <= 1
    low = c.evaluate(sst2_small["dev"], budget=0.2)
    assert low["budget"] == 0.2 and 0 < low["realized_fraction"] <= 1
    one = c.evaluate(sst2_small["dev"], budget=0.2, batch_size=1)  # no padding counted
    for key in ("realized_fraction", "realized_macs_per_token", "accuracy"):
        assert one[key] == pytest.approx(low[key], rel=1e-9), key
    lines = ["a fine film", "bad", "an ok one"]
    mixed = c.classify(lines, budget=[0.8, 0.2, 0.5])
    assert mixed == [c.classify([line], budget=b)[0]
                     for line, b in zip(lines, [0.8, 0.2, 0.5], strict=True)]
    # each line's realized compute is its own, whatever length its batch padded it to
    rows, _ = c.encode(["a fine film that runs long and longer still", "bad"])
    for budget in (0.8, 0.2):
        both, alone = RealizedCompute(), RealizedCompute()
        c.classify_rows(rows, budget, compute=both)
        c.classify_rows(rows[1:], budget, compute=alone)
        assert int(both.row_tokens[1]) < int(both.row_tokens[0])
        assert (int(both.row_ran[1]), int(both.row_full[1])) == (int(alone.row_ran[0]),
                                                                 int(alone.row_full[0]))
    proc = run_cli("profile", str(run), "--budget", "0.33", "--json", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    row = json.loads(proc.stdout)["lengths"]["32"]
    assert row["macs_per_token_flop_counter"] <= row["macs_per_token"]
    # calibration: an untrained budget (0.4) from the nearest trained symbol (0.33)
    with pytest.raises(DynaseqError, match="was not trained"):
        c.classify(lines, budget=0.4)
    proc = run_cli("calibrate", str(run), "--data", str(sst2_small["dev"]), "--budgets", "0.4",
                   "0.8", "--lines", "30", "--tol", "0.02")
    assert proc.returncode == 0, proc.stderr.decode()
    c = dynaseq.load(run)
    cal = {x.budget[0]: x for x in c.calibrations}
    assert set(cal) == {0.4, 0.8} and cal[0.4].control == 2  # P_BERT's 0.33
    assert c.evaluate(sst2_small["dev"], budget=0.4)["budget"] == 0.4
    mixed = c.classify(lines, budget=[0.4, 0.2, 0.8])  # calibrated and trained rows mixed
    assert mixed == [c.classify([line], budget=b)[0]
                     for line, b in zip(lines, [0.4, 0.2, 0.8], strict=True)]
    # exported with its encoder budgets (the model card took them for translation pairs)
    from dynaseq.workflows.export import export_model

    export_model(run, tmp_path / "exported")
    card = (tmp_path / "exported" / "README.md").read_text()
    assert "Trained encoder budgets: 0.8, 0.5, 0.33, 0.2." in card
    assert "- calibrated 0.4: realized compute encoder" in card
    assert dynaseq.load(tmp_path / "exported").classify(lines, budget=[0.4, 0.2, 0.8]) == mixed
    # the lean pass's batches count what the model's own pass counts one row at a time
    c.fast_encode = False
    one_at_a_time = c.calibrate(sst2_small["dev"], [0.4, 0.5], lines=30, tol=0.02)
    c.fast_encode = True
    batched = c.calibrate(sst2_small["dev"], [0.4, 0.5, 0.4], lines=30, tol=0.02,
                          batch_size=7)  # a budget asked twice is calibrated once
    assert sorted(x.budget[0] for x in c.calibrations) == [0.4, 0.5, 0.8]
    for a, b in zip(one_at_a_time, batched, strict=True):
        assert a.realized == b.realized and a.uncalibrated == b.uncalibrated
        assert a.offsets == pytest.approx(b.offsets, abs=1e-9)


def test_exported_classifier_is_bit_identical(finetuned, sst2_small, tmp_path):
    """``dynaseq export`` of a classification run: the model directory loads like the run
    (``dynaseq.load``) and gives the same labels and scores."""
    from dynaseq.workflows.export import export_model

    out = tmp_path / "model"
    export_model(finetuned, out)
    cfg = json.loads((out / "config.json").read_text())["config"]
    assert "train" not in cfg and not {"train", "valid", "test"} & set(cfg["data"])
    a, b = Classifier.load(finetuned), dynaseq.load(out)
    assert isinstance(b, Classifier)
    lines = [ln.split("\t")[0] for ln in sst2_small["dev"].read_text().splitlines()[1:25]]
    assert b.classify(lines) == a.classify(lines)
    assert b.evaluate(str(sst2_small["dev"]))["accuracy"] == \
        a.evaluate(str(sst2_small["dev"]))["accuracy"]


def test_classify_shows_a_progress_bar_on_a_terminal_only(finetuned, sst2_small):
    from test_newcomer import _stderr_of

    lines = "".join(ln.split("\t")[0] + "\n"
                    for ln in sst2_small["dev"].read_text().splitlines()[1:41]).encode()
    args = ["classify", str(finetuned), "--batch-size", "4"]
    rc, out_tty, err_tty = _stderr_of(args, lines, tty=True)
    assert rc == 0 and "classify" in err_tty and "row" in err_tty, err_tty
    rc, out_pipe, err_pipe = _stderr_of(args, lines, tty=False)
    assert rc == 0 and err_pipe == "" and out_pipe == out_tty
