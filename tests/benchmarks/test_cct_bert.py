"""benchmarks/cct_bert.py's target checks: the full budget against the dense encoder, and
each lower budget against the shrunk encoder of each family nearest in layer MACs."""

from __future__ import annotations

from helpers import load_benchmark


def _row(model, family, score, macs, **extra):
    return {"model": model, "label": model, "family": family, "score": score,
            "layer_macs_per_token": macs, "params": 1,
            "pretrain": {"train_minutes": 1.0}, "finetune": {"train_minutes": 0.5}, **extra}


def test_targets_hold_each_budget_against_the_nearest_shrunk_encoder():
    cct_bert = load_benchmark("cct_bert")
    rows = [_row("cct", "cct", 80.0, 900, budget=0.8, calibrated=False),  # raw: not judged
            _row("cct", "cct", 78.5, 800, budget=0.8, calibrated=True),
            _row("cct", "cct", 77.0, 510, budget=0.5, calibrated=True),
            _row("cct", "cct", 75.0, 330, budget=0.33, calibrated=True),
            _row("dense", "dense", 79.0, 1000),
            _row("depth_2", "depth", 76.0, 500), _row("depth_1", "depth", 76.5, 250),
            _row("width_180", "width", 78.0, 490), _row("width_148", "width", 74.0, 340)]
    t = cct_bert.targets({"rows": rows})
    assert t["full_within_1_of_dense"] == {"cct": 78.5, "dense": 79.0, "difference": -0.5,
                                           "met": True}
    assert t["0.5_above_depth"]["shrunk"] == "depth_2" and t["0.5_above_depth"]["met"]
    assert t["0.5_above_width"] == {"cct": 77.0, "shrunk": "width_180", "shrunk_score": 78.0,
                                    "macs_ratio_cct_over_shrunk": 1.041, "met": False}
    assert t["0.33_above_depth"]["shrunk"] == "depth_1" and not t["0.33_above_depth"]["met"]
    assert t["0.33_above_width"]["shrunk"] == "width_148" and t["0.33_above_width"]["met"]
    seen = []

    def diff_ci(a, b):
        seen.append((cct_bert.row_key(a), cct_bert.row_key(b)))
        return [-1.0, 2.0]

    with_ci = cct_bert.targets({"rows": rows}, diff_ci)
    assert with_ci["full_within_1_of_dense"]["difference_ci95"] == [-1.0, 2.0]
    assert seen == [("cct@0.8 calibrated", "dense"), ("cct@0.5 calibrated", "depth_2"),
                    ("cct@0.5 calibrated", "width_180"), ("cct@0.33 calibrated", "depth_1"),
                    ("cct@0.33 calibrated", "width_148")]
    assert {k: {n: x for n, x in v.items() if n != "difference_ci95"}
            for k, v in with_ci.items()} == t
    rows[1]["score"] = 77.9  # 1.1 below the dense encoder
    assert not cct_bert.targets({"rows": rows})["full_within_1_of_dense"]["met"]
    out = {"command": "python benchmarks/cct_bert.py", "machine": {}, "date": "d",
           "pretrain_steps": 8, "finetune_steps": 6, "rounds": 1,
           "tasks": {"sst2": {"metric": "accuracy", "rows": rows, "targets": t,
                              "timing": {"batch_1": {"cct 0.8": {"seconds": 1.0,
                                                                 "ratio_to_full": 1.0}}}}}}
    text = "\n".join(cct_bert.markdown(out))
    assert "| CCT-BERT" not in text and "| cct | 0.5 | yes | 77.0 |" in text
    assert "| dense | | | 79.0 |" not in text and "| dense |  |  | 79.0 |" in text
    out["retimed"] = {"command": "python benchmarks/cct_bert.py --retime", "machine": {},
                      "provenance": {"commit": "abc", "date": "2026-11-26 10:00"},
                      "rounds": 7}
    text = "\n".join(cct_bert.markdown(out))
    assert "measured again by `python benchmarks/cct_bert.py --retime` (code abc" in text
    assert "median of 7 rounds" in text and "median of 1 rounds" not in text


def test_difference_interval_is_over_the_rows_of_both_predictions():
    from dynaseq.tasks.classify.glue import GLUE_TASKS

    cct_bert = load_benchmark("cct_bert")
    gold = ["0", "1"] * 20
    preds = {"cct@0.8 calibrated": list(gold), "dense": ["1", "0"] * 20,
             "depth_2": list(gold)}
    cct = {"model": "cct", "budget": 0.8, "calibrated": True}
    assert cct_bert.difference_ci(GLUE_TASKS["sst2"], "accuracy", gold, preds, cct,
                                  {"model": "dense"}) == [100.0, 100.0]
    assert cct_bert.difference_ci(GLUE_TASKS["sst2"], "accuracy", gold, preds, cct,
                                  {"model": "depth_2"}) == [0.0, 0.0]


class _FakeProcess:
    """A training process that writes one line and finishes on its second poll, status 1
    for ``depth_1`` and 0 for the others; the class counts the processes alive at once."""

    running: list[str] = []
    most = 0

    def __init__(self, cmd, stdout, stderr):
        self.cmd, self.pid, self.polls = cmd, 1, 0
        self.name = cmd[cmd.index("--only") + 1]
        stdout.write(f"log of {self.name}\n")
        _FakeProcess.running.append(self.name)
        _FakeProcess.most = max(_FakeProcess.most, len(_FakeProcess.running))
        self.returncode = None

    def poll(self):
        self.polls += 1
        if self.polls < 2:
            return None
        if self.returncode is None:
            _FakeProcess.running.remove(self.name)
            self.returncode = 1 if self.name == "depth_1" else 0
        return self.returncode


def test_parallel_training_runs_each_model_in_its_own_process_n_at_a_time(tmp_path, monkeypatch,
                                                                           capsys):
    """The pre-trainings first, one process per model, then one per model and task; never
    more than --parallel at once; the options every run shares travel to each process."""
    import argparse

    import pytest

    cct_bert = load_benchmark("cct_bert")
    started = []

    def popen(cmd, stdout, stderr):
        started.append(cmd)
        return _FakeProcess(cmd, stdout, stderr)

    monkeypatch.setattr(cct_bert._lib.subprocess, "Popen", popen)
    monkeypatch.setattr(cct_bert._lib.time, "sleep", lambda s: None)
    monkeypatch.setattr(_FakeProcess, "running", [])  # no count left from another test
    monkeypatch.setattr(_FakeProcess, "most", 0)
    args = argparse.Namespace(only=["cct", "dense", "depth_2"], tasks=["sst2", "cola"],
                              parallel=2, pretrain_steps=30, finetune_steps=20, runs=tmp_path,
                              pretrain_batch=None, precision="fp32", glue_text=False,
                              pretrain_only=False)
    cct_bert.train_parallel(args)
    jobs = [(c[c.index("--only") + 1], c[-1]) for c in started]
    assert jobs == [("cct", "--pretrain-only"), ("dense", "--pretrain-only"),
                    ("depth_2", "--pretrain-only"), ("cct", "sst2"), ("cct", "cola"),
                    ("dense", "sst2"), ("dense", "cola"), ("depth_2", "sst2"),
                    ("depth_2", "cola")]
    assert _FakeProcess.most == 2  # never more than --parallel at once
    assert started[0][2:] == ["--train-only", "--pretrain-steps", "30", "--finetune-steps",
                              "20", "--runs", str(tmp_path), "--precision", "fp32", "--only",
                              "cct", "--pretrain-only"]
    assert started[3][-4:] == ["--only", "cct", "--tasks", "sst2"]
    assert (tmp_path / "dense_mlm.out").read_text() == "log of dense\n"
    assert (tmp_path / "dense_cola.out").read_text() == "log of dense\n"
    args.only, args.pretrain_batch, args.precision, args.glue_text = ["dense"], 64, "bf16", True
    args.pretrain_only, started[:] = True, []
    cct_bert.train_parallel(args)
    assert len(started) == 1  # --pretrain-only: no fine-tuning process
    assert started[0][-7:-2] == ["bf16", "--glue-text", "--pretrain-batch", "64", "--only"]
    cfg = next(cct_bert.configs(["dense"], [], args))
    assert cfg.data.batch_size == 64 and cfg.train.precision == "bf16"
    text = tmp_path / "glue_unlabelled.txt"
    assert text.exists() and str(text) in cfg.data.train  # the tasks' sentences join
    args.only, args.pretrain_only = ["dense", "depth_1"], False
    with pytest.raises(SystemExit, match="training failed for depth_1_mlm"):
        cct_bert.train_parallel(args)
    assert "log of depth_1" in capsys.readouterr().err  # the failed process's output


def test_plateau_probe_leaves_at_the_first_logged_update_under_the_threshold(tmp_path):
    import json

    plateau = load_benchmark("cct_bert_plateau")
    assert plateau.left_plateau({1: 5.0, 50: 6.1, 100: 5.74, 150: 5.2}, 5.75) == 100
    assert plateau.left_plateau({1: 5.0, 50: 6.1, 100: 6.0}, 5.75) is None  # step 1 ignored
    events = [{"event": "train", "step": 50, "nll": 6.1, "elapsed_s": 30.0, "budget_loss": 0.5},
              {"event": "valid", "step": 50, "loss": 6.0},
              {"event": "train", "step": 100, "nll": 5.7, "elapsed_s": 66.0}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    c = plateau.curve(tmp_path)
    assert c == {"nll": {50: 6.1, 100: 5.7}, "budget_loss": {50: 0.5, 100: 0.0},
                 "valid": {50: 6.0}, "steps": 100, "minutes": 1.1}
    assert plateau._at({"1000": 5.5}, 1000) == 5.5 and plateau._at({}, 1000) == ""


def test_curves_read_every_run_log_finished_or_not(tmp_path):
    """--curves: each model's validation events by stage, a stopped run as far as it got,
    a missing one empty; the Markdown leaves the steps a run did not reach blank."""
    import argparse
    import json

    cct_bert = load_benchmark("cct_bert")

    def log(run, events):
        (tmp_path / run).mkdir()
        (tmp_path / run / "log.jsonl").write_text("".join(
            json.dumps({"event": "valid", "time": 0, **e}) + "\n" for e in events)
            + json.dumps({"event": "train", "step": 1}) + "\n")

    log("dense_mlm", [{"step": 200, "loss": 5.5, "accuracy": 0.1},
                      {"step": 400, "loss": 3.25, "accuracy": 0.4}])
    log("dense_sst2", [{"step": 200, "accuracy": 0.75}, {"step": 400, "accuracy": 0.8}])
    log("cct_mlm", [{"step": 200, "loss": 6.0, "accuracy": 0.05}])
    args = argparse.Namespace(only=["cct", "dense"], tasks=["sst2"], runs=tmp_path)
    got = cct_bert.curves(args)
    assert got["dense"]["mlm"] == {200: {"loss": 5.5, "accuracy": 0.1},
                                   400: {"loss": 3.25, "accuracy": 0.4}}
    assert got["dense"]["sst2"] == {200: {"accuracy": 0.75}, 400: {"accuracy": 0.8}}
    assert got["cct"]["sst2"] == {} and list(got["cct"]["mlm"]) == [200]
    out = {"command": "c", "machine": {}, "date": "d", "curves": got}
    text = "\n".join(cct_bert.curves_markdown(out, 200))
    label = cct_bert.MODELS["cct"]["label"]
    assert f"| {label} | 6.00 (5.0) |  |" in text  # 400 not reached
    assert "| 200 | 400 |" in text and "| 75.0 | 80.0 |" in text
