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
    args = argparse.Namespace(only=["cct", "dense", "depth_2"], tasks=["sst2"], parallel=2,
                              pretrain_steps=30, finetune_steps=20, runs=tmp_path,
                              pretrain_batch=None)
    cct_bert.train_parallel(args)
    assert [c[c.index("--only") + 1] for c in started] == ["cct", "dense", "depth_2"]
    assert _FakeProcess.most == 2  # never more than --parallel at once
    assert started[0][2:] == ["--only", "cct", "--train-only", "--tasks", "sst2",
                              "--pretrain-steps", "30", "--finetune-steps", "20",
                              "--runs", str(tmp_path)]
    assert (tmp_path / "dense.out").read_text() == "log of dense\n"
    args.only, args.pretrain_batch, started[:] = ["dense"], 64, []
    cct_bert.train_parallel(args)
    assert started[0][-2:] == ["--pretrain-batch", "64"]  # the pre-training's batch travels
    assert next(cct_bert.configs(["dense"], [], args)).data.batch_size == 64
    args.only = ["dense", "depth_1"]
    with pytest.raises(SystemExit, match="training failed for depth_1"):
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
