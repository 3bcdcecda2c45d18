"""A classification run's service times for ``dynaseq serve``'s deadline policy: the
:class:`~dynaseq.metrics.latency_table.LatencyTable` of a
:class:`~dynaseq.tasks.classify.predictor.Classifier`, one ``(encoder,)`` budget per row
(``dynaseq profile RUN --latency-table`` on a classification run)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dynaseq.core.distributed import precision_of
from dynaseq.core.errors import DynaseqError
from dynaseq.core.progress import progress_bar
from dynaseq.metrics.latency import median_ms
from dynaseq.metrics.latency_table import LatencyTable, budget_key
from dynaseq.tasks.classify.predictor import Classifier, RealizedCompute


@torch.inference_mode()
def measure_classify_latency_table(classifier: Classifier, budgets: Sequence[float | None],
                                   batch_sizes: Sequence[int], lengths: Sequence[int],
                                   rows: Sequence[Any], repeats: int = 3,
                                   checkpoint: str = "", progress: bool = False,
                                   after: Callable[[list[Any], list[Any], Any], object]
                                   | None = None, timed: str = "classify",
                                   predict: str = "fit") -> LatencyTable:
    """Measure :class:`LatencyTable` for a :class:`~dynaseq.tasks.classify.predictor.
    Classifier`: per budget (``(b,)`` in the table; None for a dense encoder, kept as
    ``(1,)``), the median ms of ``Classifier.classify_rows`` over the ``n`` encoded ``rows``
    whose token counts are nearest ``L`` (cycled when there are fewer), one batch at that
    budget, as ``dynaseq serve`` runs it. ``after(rows, budgets, compute)``: what the server
    does with each batch besides (each row's realized compute), timed with it. Cells are
    interleaved budget by budget, as
    :func:`~dynaseq.metrics.latency_table.measure_latency_table`'s."""
    pool = [r for r in rows if r[0]]
    if not pool:
        raise DynaseqError("no sentences to time the latency table with")
    if not budgets:
        raise DynaseqError("no budgets to time the latency table at")
    keys = [(1.0,) if b is None else (float(b),) for b in budgets]
    service = {budget_key(k): [[0.0] * len(lengths) for _ in batch_sizes] for k in keys}
    bar = progress_bar(len(batch_sizes) * len(lengths) * len(keys), "cell", "latency table",
                       progress)
    try:
        for i, n in enumerate(batch_sizes):
            for j, length in enumerate(lengths):
                near = sorted(pool, key=lambda r: abs(len(r[0]) - length))
                batch = [near[k % len(near)] for k in range(n)]
                for budget, key in zip(budgets, keys, strict=True):
                    def run(batch=batch, budgets=[budget] * n) -> None:
                        compute = RealizedCompute() if after is not None else None
                        classifier.classify_rows(batch, budgets, batch_size=len(batch),
                                                 compute=compute)
                        if after is not None:
                            after(batch, budgets, compute)

                    service[budget_key(key)][i][j] = median_ms(classifier.model, run,
                                                               repeats)
                    bar.update(1)
    finally:
        bar.close()
    return LatencyTable(keys, list(batch_sizes), list(lengths), service, beam=1,
                        device=str(classifier.device), threads=torch.get_num_threads(),
                        checkpoint=checkpoint, extra={"timed": timed}, predict=predict,
                        precision=precision_of(classifier.model))
