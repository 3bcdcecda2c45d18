"""Each GLUE metric against a value computed by hand."""

from __future__ import annotations

import math

import pytest

from dynaseq.metrics.classification import classification_metrics, regression_metrics


def test_accuracy_f1_and_mcc_by_hand():
    gold = ["1", "1", "1", "0", "0", "0", "1", "0"]
    pred = ["1", "1", "0", "0", "1", "0", "1", "0"]
    # TP = 3 (rows 0, 1, 6), FN = 1 (row 2), FP = 1 (row 4), TN = 3 (rows 3, 5, 7)
    tp, fn, fp, tn = 3, 1, 1, 3
    m = classification_metrics(gold, pred, ("accuracy", "f1", "mcc"), positive="1")
    assert m["accuracy"] == 6 / 8
    assert m["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))  # 0.75
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert m["mcc"] == pytest.approx(mcc)  # 8 / 16 = 0.5
    assert mcc == 0.5


def test_f1_of_the_other_label_and_degenerate_mcc():
    gold, pred = ["a", "b", "b"], ["b", "b", "b"]
    # positive "b": TP 2, FP 1, FN 0 -> F1 = 4 / 5; positive "a": TP 0 -> 0
    assert classification_metrics(gold, pred, ("f1",), "b")["f1"] == pytest.approx(0.8)
    assert classification_metrics(gold, pred, ("f1",), "a")["f1"] == 0.0
    assert classification_metrics(gold, pred, ("mcc",))["mcc"] == 0.0  # constant prediction


def test_pearson_and_spearman_by_hand():
    gold = [1.0, 2.0, 3.0, 4.0]
    pred = [1.0, 3.0, 2.0, 5.0]
    # Pearson: means 2.5 and 2.75; cov sum = (-1.5)(-1.75)+(-.5)(.25)+(.5)(-.75)+(1.5)(2.25)
    cov = 2.625 - 0.125 - 0.375 + 3.375
    var_g = 2.25 + 0.25 + 0.25 + 2.25
    var_p = 1.75 ** 2 + 0.25 ** 2 + 0.75 ** 2 + 2.25 ** 2
    r = regression_metrics(gold, pred)
    assert r["pearson"] == pytest.approx(cov / math.sqrt(var_g * var_p))
    # Spearman: ranks 1 2 3 4 vs 1 3 2 4: d² = 0 + 1 + 1 + 0 -> 1 - 6·2 / (4·15) = 0.8
    assert r["spearman"] == pytest.approx(0.8)
    assert regression_metrics(gold, [2.0] * 4)["pearson"] == 0.0  # undefined -> 0


def test_bad_metric_input():
    with pytest.raises(ValueError, match="equally many"):
        classification_metrics(["1"], [])
    with pytest.raises(ValueError, match="unknown label metric"):
        classification_metrics(["1"], ["1"], ("pearson",))
    with pytest.raises(ValueError, match="positive"):
        classification_metrics(["1"], ["1"], ("f1",))
    with pytest.raises(ValueError, match="at least two"):
        regression_metrics([1.0], [1.0])
