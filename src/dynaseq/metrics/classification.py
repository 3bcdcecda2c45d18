"""The GLUE tasks' official metrics, computed with scikit-learn and SciPy.

=========  ==========================================================
name       definition
=========  ==========================================================
accuracy   share of exact label matches (``sklearn.metrics.accuracy_score``)
f1         F1 of the positive class (``sklearn.metrics.f1_score``; MRPC, QQP: label 1)
mcc        Matthews correlation coefficient (``matthews_corrcoef``; CoLA), in [-1, 1]
pearson    Pearson's r of predicted and gold scores (``scipy.stats.pearsonr``; STS-B)
spearman   Spearman's rho (``scipy.stats.spearmanr``; STS-B)
=========  ==========================================================

Every metric is reported as the plain fraction/correlation (GLUE's leaderboard shows them
x 100). A correlation of constant predictions is undefined (NaN); it is reported as 0.

Example::

    classification_metrics(["1", "0", "1"], ["1", "1", "1"], ("accuracy", "f1"), "1")
    # {"accuracy": 0.6667, "f1": 0.8}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

#: The metric names :func:`classification_metrics` and :func:`regression_metrics` know.
LABEL_METRICS = ("accuracy", "f1", "mcc")
SCORE_METRICS = ("pearson", "spearman")


def _finite(x: float) -> float:
    return 0.0 if math.isnan(x) else float(x)


def _label_metric(name: str) -> Callable[[Sequence[str], Sequence[str], str | None], float]:
    from sklearn import metrics

    def accuracy(gold, pred, positive):
        return float(metrics.accuracy_score(gold, pred))

    def f1(gold, pred, positive):
        return float(metrics.f1_score(gold, pred, pos_label=positive, average="binary",
                                      zero_division=0.0))

    def mcc(gold, pred, positive):
        return _finite(metrics.matthews_corrcoef(gold, pred))

    return {"accuracy": accuracy, "f1": f1, "mcc": mcc}[name]


def _check_scored(gold: Sequence, pred: Sequence, names: Sequence[str], known: Sequence[str],
                  what: str, least: int) -> None:
    """Raise ValueError unless ``gold`` and ``pred`` are equally long with at least ``least``
    (1 or 2) entries and every name is one of the ``known`` ``what`` metrics (``what``:
    "label" or "score")."""
    if len(gold) != len(pred) or len(gold) < least:
        raise ValueError(f"need equally many gold and predicted {what}s, at least "
                         f"{('one', 'two')[least - 1]}; got {len(gold)} and {len(pred)}")
    for name in names:
        if name not in known:
            raise ValueError(f"unknown {what} metric {name!r}; known: {', '.join(known)}")


def classification_metrics(gold: Sequence[str], pred: Sequence[str],
                           names: Sequence[str] = ("accuracy",),
                           positive: str | None = None) -> dict[str, float]:
    """Each named label metric of predictions ``pred`` against ``gold`` (equal lengths, not
    empty); ``positive`` is F1's positive label."""
    _check_scored(gold, pred, names, LABEL_METRICS, "label", 1)
    out = {}
    for name in names:
        if name == "f1" and positive is None:
            raise ValueError("f1 needs the positive label")
        out[name] = _label_metric(name)(list(gold), list(pred), positive)
    return out


def regression_metrics(gold: Sequence[float], pred: Sequence[float],
                       names: Sequence[str] = SCORE_METRICS) -> dict[str, float]:
    """Pearson's r and/or Spearman's rho of ``pred`` against ``gold`` (>= 2 pairs)."""
    from scipy import stats

    _check_scored(gold, pred, names, SCORE_METRICS, "score", 2)
    out = {}
    for name in names:
        if len(set(pred)) < 2 or len(set(gold)) < 2:
            out[name] = 0.0  # undefined for constant input
            continue
        fn = stats.pearsonr if name == "pearson" else stats.spearmanr
        out[name] = _finite(fn(list(gold), list(pred))[0])
    return out
