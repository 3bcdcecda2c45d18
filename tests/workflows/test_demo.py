import json

import pytest

from dynaseq.data import read_lines
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.techniques.cct.layers import force_gates
from dynaseq.workflows.demo import DEMO_BUDGETS, hard_easy_compute, run_demo, token_accuracy


@pytest.mark.slow  # the whole demo end to end (~20 s on 2 cores): `make test-slow`
def test_demo_writes_data_run_and_summary(tmp_path):
    out = tmp_path / "demo"
    # a run left by an older demo (another model) is replaced, not resumed into the CCT
    stale = out / "run" / "checkpoints" / "step_00000200"
    stale.mkdir(parents=True)
    (out / "run" / "config.yaml").write_text("model: {size: tiny}\n")
    summary = run_demo(out, minutes=0.05, progress=False, eval_lines=40)
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
    src, ref = read_lines(out / "data" / "test.src")[:20], read_lines(out / "data" / "test.tgt")[:20]
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
