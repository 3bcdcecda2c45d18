"""Service time per budget × batch size × source length: what ``dynaseq profile RUN
--latency-table`` measures and stores in the run, and what the server's deadline policy
predicts from.

A :class:`LatencyTable` holds, for each budget (an ``(encoder, decoder)`` pair; a dense
model has one row, ``(1, 1)``), the median wall time of decoding a batch of ``b`` sentences
of ``L`` source tokens (for a classification run, :func:`dynaseq.tasks.classify.
latency_table.measure_classify_latency_table`: of classifying ``b`` rows of ``L`` tokens at
each ``(encoder,)`` budget): real sentences of about that length decoded freely (each budget's
outputs as long as they come out), or, without sentences, random tokens decoded into
exactly ``L`` target tokens (:func:`~dynaseq.metrics.latency.decode_latency_ms`).
:meth:`LatencyTable.predict_ms` reads the cells through a fitted model by default
(``predict="fit"``): per budget, ``t = c0 + c1·n + c2·L + c3·n·L`` in the batch size ``n``
and length ``L`` (a decode's steps grow with ``L`` and each step's cost with ``n``; the
encoder costs about ``n·L``), fitted to the cells in relative error with non-negative
coefficients, so it never falls as a batch grows or lengthens and one noisy cell does not
steer a decision. ``predict="grid"`` interpolates linearly between the measured cells and
extrapolates linearly beyond them instead.

Example::

    table = measure_latency_table(model, {(1.0, 1.0): 0, (0.5, 0.5): 1}, batch_sizes=[1, 8],
                                  lengths=[8, 24], beam=1)
    table.save("runs/demo/run/latency_table.json")
    LatencyTable.load("runs/demo/run/latency_table.json").predict_ms((0.5, 0.5), 4, 16)
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dynaseq.core.distributed import precision_of
from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import atomic_write, read_text
from dynaseq.core.progress import progress_bar
from dynaseq.data import collate_source
from dynaseq.metrics.latency import AfterDecode, decode_latency_ms, median_ms
from dynaseq.nn.modes import evaluating

PREDICTIONS = ("fit", "grid")
"""How a table predicts (:attr:`LatencyTable.predict`)."""

LATENCY_TABLE_FILE = "latency_table.json"
"""Written into a run directory by ``dynaseq profile RUN --latency-table``."""

Pair = tuple[float, ...]
"""A budget as a table holds it: a translation's ``(encoder, decoder)`` pair, a classifier's
``(encoder,)``."""


def budget_key(pair: Pair) -> str:
    """``(0.5, 0.5)`` -> ``"0.5,0.5"``, ``(0.5,)`` -> ``"0.5"``: a budget as a JSON key."""
    return ",".join(f"{x:g}" for x in pair)


@dataclass
class LatencyTable:
    """Measured service times: ``service_ms[budget_key][i][j]`` is the median milliseconds
    to decode a batch of ``batch_sizes[i]`` sentences of ``lengths[j]`` source tokens at that
    budget (greedy for ``beam`` 1), on ``device`` with ``threads`` CPU threads, the model's
    weights in ``precision`` (``fp32`` or ``bf16``). ``predict``:
    ``"fit"`` or ``"grid"`` (:data:`PREDICTIONS`; see the module doc). A table is not changed
    once made: its fits and predictions are remembered (a server plans every request with
    hundreds of them)."""

    budgets: list[Pair]
    batch_sizes: list[int]
    lengths: list[int]
    service_ms: dict[str, list[list[float]]]
    beam: int = 1
    device: str = "cpu"
    threads: int = 1
    checkpoint: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    predict: str = "fit"
    precision: str = "fp32"

    def __post_init__(self) -> None:
        self._predicted: dict[tuple[Pair, int, int], float] = {}  # not fields: not saved
        self._fits: dict[str, tuple[float, ...]] = {}
        if self.predict not in PREDICTIONS:
            raise ValueError(f"predict must be one of {', '.join(PREDICTIONS)}, got "
                             f"{self.predict!r}")
        self.budgets = [tuple(float(x) for x in p) for p in self.budgets]
        if not self.budgets or not self.batch_sizes or not self.lengths:
            raise ValueError("a latency table needs at least one budget, batch size and length")
        if sorted(set(self.batch_sizes)) != list(self.batch_sizes) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be increasing and >= 1, got {self.batch_sizes}")
        if sorted(set(self.lengths)) != list(self.lengths) or self.lengths[0] < 1:
            raise ValueError(f"lengths must be increasing and >= 1, got {self.lengths}")
        for pair in self.budgets:
            rows = self.service_ms.get(budget_key(pair))
            if rows is None:
                raise ValueError(f"no service times for budget {budget_key(pair)}")
            if len(rows) != len(self.batch_sizes) or any(
                    len(r) != len(self.lengths) for r in rows):
                raise ValueError(f"service times of budget {budget_key(pair)} are not "
                                 f"{len(self.batch_sizes)} x {len(self.lengths)}")
            if not all(math.isfinite(v) and v > 0 for r in rows for v in r):
                raise ValueError(f"service times of budget {budget_key(pair)} must be > 0")

    def has(self, pair: Pair) -> bool:
        return budget_key(pair) in self.service_ms

    def predict_ms(self, pair: Pair, batch: int, length: int) -> float:
        """Predicted milliseconds to decode ``batch`` sentences of ``length`` source tokens
        at budget ``pair``: the budget's :meth:`fit` at (batch, length), or with
        ``predict="grid"`` bilinear in (batch size, length) between the measured points,
        linear beyond them; never below the smallest measured time / 4."""
        key = (tuple(pair), batch, length)
        known = self._predicted.get(key)
        if known is not None:
            return known
        rows = self._rows(pair)
        n, size = max(batch, 1), max(length, 1)
        if self.predict == "fit":
            value = self._fitted(pair, n, size)
        else:
            value = _interp(self.batch_sizes, [_interp(self.lengths, r, size) for r in rows], n)
        floor = min(min(r) for r in rows) / 4
        self._predicted[key] = max(value, floor)
        return self._predicted[key]

    def fit(self, pair: Pair) -> tuple[float, float, float, float]:
        """``(c0, c1, c2, c3)`` of ``t = c0 + c1·n + c2·L + c3·n·L`` for budget ``pair``: the
        non-negative coefficients that minimise the cells' squared relative error,
        ``Σ ((t(n, L) - cell) / cell)²`` (``scipy.optimize.nnls`` on the rows scaled by
        ``1 / cell``), so no cell weighs more for being slow. With one measured batch size
        (length) the terms in ``n`` (``L``) are left out: one point says nothing of a slope."""
        key = budget_key(pair)
        if key not in self._fits:
            import numpy as np
            from scipy.optimize import nnls

            rows = self._rows(pair)
            use = (True, len(self.batch_sizes) > 1, len(self.lengths) > 1,
                   len(self.batch_sizes) > 1 and len(self.lengths) > 1)
            x = [[v / t for v, on in zip((1, n, size, n * size), use, strict=True) if on]
                 for n, r in zip(self.batch_sizes, rows, strict=True)
                 for size, t in zip(self.lengths, r, strict=True)]  # each cell's row / cell
            coef = iter(nnls(np.array(x), np.ones(len(x)))[0].tolist())
            self._fits[key] = tuple(next(coef) if on else 0.0 for on in use)
        return self._fits[key]

    def fit_error(self, pair: Pair) -> float:
        """The median relative error of :meth:`fit` over the budget's cells (how far the
        measured cells scatter about the model)."""
        errors = [abs(self._fitted(pair, n, size) / t - 1)
                  for n, r in zip(self.batch_sizes, self._rows(pair), strict=True)
                  for size, t in zip(self.lengths, r, strict=True)]
        return statistics.median(errors)

    def _fitted(self, pair: Pair, n: float, length: float) -> float:
        """:meth:`fit`'s ``t(n, L)``."""
        c0, c1, c2, c3 = self.fit(pair)
        return c0 + c1 * n + c2 * length + c3 * n * length

    def _rows(self, pair: Pair) -> list[list[float]]:
        rows = self.service_ms.get(budget_key(pair))
        if rows is None:
            raise KeyError(f"budget {budget_key(pair)} is not in the latency table "
                           f"(it has {', '.join(self.service_ms)})")
        return rows

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["budgets"] = [list(p) for p in self.budgets]
        return d

    def save(self, path: str | Path) -> Path:
        """Write the table as JSON, atomically (a reader sees the old file or the new)."""
        atomic_write(path, json.dumps(self.to_json(), indent=1))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> LatencyTable:
        """Read a table written by :meth:`save` (a :class:`DynaseqError` if it is not one)."""
        text = read_text(path, "latency table")
        try:
            d = json.loads(text)
            return cls(**d)
        except (ValueError, TypeError) as e:
            raise DynaseqError(f"{path} is not a latency table ({type(e).__name__}: {e}); "
                               "run dynaseq profile RUN --latency-table again") from None


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through the points; linear extrapolation from the two
    nearest points outside them (constant with one point)."""
    if len(xs) == 1:
        return float(ys[0])
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@torch.inference_mode()
def free_decode_ms(model: nn.Module, src: torch.Tensor, beam: int, repeats: int,
                   control: Any = None, max_len_a: float = 1.2, max_len_b: int = 10,
                   after: AfterDecode | None = None) -> float:
    """Median wall time (ms) to decode the padded batch ``src`` (B, S) as a server would:
    until every row has produced eos or reached ``max_len_a · S + max_len_b`` tokens, after
    one warm-up; through the model's lean decoding step where it has one, as the server
    decodes; ``after``: what the server does with each decoded batch besides, timed with it
    (:class:`~dynaseq.metrics.latency.AfterDecode`)."""
    from dynaseq.metrics.latency import search
    from dynaseq.models.lean import lean_or_model

    max_pos = model.decoder.positions.max_positions
    kwargs = {"max_len_a": max_len_a, "max_len_b": max_len_b, "max_positions": max_pos,
              "control": control}
    searcher = lean_or_model(model)

    def run() -> None:
        hyps, counted = search(searcher, src, beam, after, **kwargs)
        if after is not None:
            after(src, hyps, control, counted)

    return median_ms(model, run, repeats)


def measure_latency_table(model: nn.Module, controls: Mapping[Pair, Any],
                          batch_sizes: Sequence[int], lengths: Sequence[int], beam: int = 1,
                          repeats: int = 3, checkpoint: str = "",
                          sources: Sequence[Sequence[int]] | None = None,
                          max_len_a: float = 1.2, max_len_b: int = 10,
                          progress: bool = False, after: AfterDecode | None = None,
                          timed: str = "decode", predict: str = "fit") -> LatencyTable:
    """Measure :class:`LatencyTable` for ``model`` (a Seq2SeqTransformer).

    ``controls``: budget pair -> the ``control`` argument that runs it (a control-symbol id,
    a :class:`~dynaseq.techniques.cct.gating.BudgetControl` with calibrated offsets, or None
    for a dense model). Each cell is the median of ``repeats`` timed decodes after one
    warm-up, interleaved budget by budget so load drifts hit every budget alike.

    Without ``sources``: random tokens decoded to exactly ``L`` target tokens
    (:func:`~dynaseq.metrics.latency.decode_latency_ms`), the same steps at every budget.
    With ``sources`` (token ids of real sentences, no eos): the ``b`` sentences whose
    lengths are nearest ``L``, decoded freely (:func:`free_decode_ms`), so a budget whose
    outputs run longer (or stop sooner) is timed as it will serve. ``after``: what the
    server does with each batch besides decoding (e.g. the realized compute of each line),
    timed with it and named by ``timed`` in the table's ``extra``. ``predict``: how the table
    reads its cells (:data:`PREDICTIONS`). ``progress``: a bar of cells on a terminal.
    """
    max_pos = model.decoder.positions.max_positions
    if max(lengths) + 2 > max_pos:
        raise DynaseqError(f"length {max(lengths)} exceeds the model's max_positions={max_pos}")
    if sources is not None and not any(sources):
        raise DynaseqError("no sentences to time the latency table with")
    budgets = list(controls)
    service: dict[str, list[list[float]]] = {
        budget_key(p): [[0.0] * len(lengths) for _ in batch_sizes] for p in budgets}
    device = next(model.parameters()).device
    pool = [list(s)[: max_pos - 2] for s in (sources or []) if s]
    with evaluating(model), progress_bar(len(batch_sizes) * len(lengths) * len(budgets),
                                         "cell", "latency table", progress) as bar:
        for i, b in enumerate(batch_sizes):
            for j, length in enumerate(lengths):
                src = None
                if pool:
                    near = sorted(pool, key=lambda s: abs(len(s) + 1 - length))
                    rows = [near[k % len(near)] for k in range(b)]
                    src = collate_source(rows, model.pad_id, model.eos_id).to(device)
                for pair in budgets:
                    service[budget_key(pair)][i][j] = (
                        decode_latency_ms(model, length, length, beam, b, repeats,
                                          control=controls[pair], after=after)
                        if src is None else
                        free_decode_ms(model, src, beam, repeats, controls[pair], max_len_a,
                                       max_len_b, after))
                    bar.update(1)
    extra = ({"decoding": "fixed length: L random source tokens -> L target tokens"}
             if not pool else {"decoding": f"free: real sentences ({len(pool)}) nearest "
                                            f"each length, max_len {max_len_a} x S + "
                                            f"{max_len_b}"})
    extra["timed"] = timed
    return LatencyTable(budgets, list(batch_sizes), list(lengths), service, beam=beam,
                        device=str(device), threads=torch.get_num_threads(),
                        checkpoint=checkpoint, extra=extra, predict=predict,
                        precision=precision_of(model))
