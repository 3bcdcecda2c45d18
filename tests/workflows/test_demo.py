import json

import pytest

from dynaseq.cli import main
from dynaseq.core.errors import DynaseqError
from dynaseq.data import read_lines
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.techniques.cct.layers import force_gates
from dynaseq.workflows.demo import (
    DEMO_BUDGETS,
    DEMO_MODEL,
    hard_easy_compute,
    run_demo,
    token_accuracy,
)


@pytest.mark.slow  # the whole demo end to end (~20 s on 2 cores): `make test-slow`
def test_demo_writes_data_run_and_summary(tmp_path):
    out = tmp_path / "demo"
    # a run left by an older demo (another model) is replaced, not resumed into the CCT
    stale = out / "run" / "checkpoints" / "step_00000200"
    stale.mkdir(parents=True)
    (out / "run" / "config.yaml").write_text("model: {size: tiny}\n")
    summary = run_demo(out, train_new=True, minutes=0.05, progress=False, eval_lines=40)
    assert not stale.exists()
    for split, n in (("train", 20000), ("valid", 500), ("test", 2000)):
        for side in ("src", "tgt"):
            assert len((out / "data" / f"{split}.{side}").read_text().splitlines()) == n
    assert (out / "run" / "config.yaml").is_file() and (out / "run" / "best").is_dir()
    saved = json.loads((out / "summary.json").read_text())
    assert saved == summary
    assert [tuple(r["budget"]) for r in saved["rows"]] == DEMO_BUDGETS  # one row per budget
    for r in saved["rows"]:
        assert {"bleu_greedy", "exact_match", "hard_token_acc", "realized_fraction",
                "realized_macs_per_token", "ms_per_sentence", "decoder_compute_hard",
                "decoder_compute_easy"} <= set(r)
        assert 0 < r["realized_fraction"] <= 1
    # the hard/easy split of decoder compute: exact at the two extremes of the gates
    t = Translator.load(out / "run")
    src = read_lines(out / "data" / "test.src")[:20]
    ref = read_lines(out / "data" / "test.tgt")[:20]
    for value in (1.0, 0.0):
        with force_gates(t.model, value):
            assert hard_easy_compute(t, src, ref, DEMO_BUDGETS[1]) == {
                "decoder_compute_hard": value, "decoder_compute_easy": value}


def test_token_accuracy_counts_hard_and_easy_words():
    src = ["vumi sum 3 8 end"]
    ref = ["gide = 1 1"]
    acc = token_accuracy(["gide = 1 2"], ref, src)
    assert acc == {"exact_match": 0.0, "hard_token_acc": 0.5, "easy_token_acc": 1.0}
    assert token_accuracy(["gide ="], ref, src)["easy_token_acc"] == 0.0


def test_the_shipped_model_is_evaluated_without_training(tmp_path):
    """`make demo` evaluates the shipped model (no training, nothing under out/run): its
    budgets are met (within 0.02), quality falls with the budget, (.5, .5) keeps at least
    80% of the full budget's BLEU, and at (.5, .5) and (.33, .33) the decoder gives hard
    words more compute than easy ones (issue 28 item 3; what it does not show is said in
    the README)."""
    out = tmp_path / "demo"
    summary = run_demo(out, progress=False, eval_lines=150, timing_lines=4)
    assert not (out / "run").exists() and not summary["trained_here"]
    assert summary["checkpoint"] == "dynaseq/workflows/demo_model"  # not this machine's path
    assert DEMO_MODEL.is_dir() and summary["train_steps"] == 9000
    assert summary["command"] == f"dynaseq demo --out {out} --seed 0"
    rows = {tuple(r["budget"]): r for r in summary["rows"]}
    assert list(rows) == DEMO_BUDGETS
    for budget, r in rows.items():
        assert abs(r["realized_fraction"] - budget[0]) < 0.02, (budget, r)
    bleus = [r["bleu_greedy"] for r in rows.values()]
    assert bleus == sorted(bleus, reverse=True) and bleus[0] > 90, bleus
    assert rows[(0.5, 0.5)]["bleu_greedy"] >= 0.8 * bleus[0]
    for budget in DEMO_BUDGETS[1:3]:
        r = rows[budget]
        assert r["decoder_compute_hard"] > r["decoder_compute_easy"], (budget, r)


@pytest.mark.parametrize(("argv", "message"), [
    (["--minutes", "3"], "--minutes and --steps go with --train"),
    (["--steps", "30"], "--minutes and --steps go with --train"),
    (["--train", "--minutes", "3", "--steps", "30"], "give --minutes or --steps, not both"),
    (["--train", "--steps", "0"], "--steps must be >= 1, got 0"),
])
def test_bad_demo_options_are_refused_before_anything_is_written(tmp_path, capsys, argv,
                                                                  message):
    assert main(["demo", "--out", str(tmp_path / "demo"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dynaseq: error: {message}"), err
    assert not (tmp_path / "demo").exists()


def test_a_missing_demo_model_is_named(tmp_path):
    with pytest.raises(DynaseqError, match="no demo model at .*dynaseq demo --train"):
        run_demo(tmp_path / "demo", model=tmp_path / "nowhere", progress=False)
    assert not (tmp_path / "demo").exists()
