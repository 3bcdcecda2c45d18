"""Deadline -> budget for a continuous decode (``dynaseq serve --continuous``).

A continuous decode runs up to ``R`` rows (``max_batch_rows``); a queued line takes the
first row that frees up and keeps it until its output ends, and its request is answered
when its last line ends. So a request's completion is when rows free up for its lines plus
their own decode, predicted by playing the rows forward (:meth:`RowPolicy.finish_ms`):

* each running line holds its row for what is left of its predicted time (its duration
  less its age, ``scale`` times the table's; :attr:`Load.rows_left`);
* the lines the decode took off the queue that wait for a row (encoded together when
  rows free up) take the rows that free up first, in order (:attr:`Load.rows_waiting`);
* the queued lines ahead take, in queue order, the row that frees up first, and hold it for
  their own duration, those with a deadline at the budget being tried (as
  :class:`~dynaseq.serve.policy.DeadlinePolicy` counts them), the others at their own;
* then the request's lines, each at the budget being tried.

A line's duration at budget ``b`` is the latency table's time for a batch of ``n`` lines of
the line's source length ``L``, ``t_b(n, L)``, with ``n`` the rows the decode will run (the
running, queued and own lines, at most ``R``): a batch of ``n`` lines of ``L`` tokens runs
about as many steps at ``n`` rows as one line of a decode that keeps ``n`` rows busy. What
that misses (a step of mixed budgets costs about the union of its rows' work, a row thins
out no more) the server measures: ``scale`` follows each finished line's real time over its
prediction (:meth:`~dynaseq.serve.batcher.Batcher.row_end`), and the admission margin how
much later than predicted the answers came.

The budget is chosen as for batches (:meth:`decide`: the largest within ``slack ×
deadline`` with the margin, a budget predicted no faster than a larger one passed over,
the fastest without the margin when none is, else 503 with ``Retry-After``), and again when
the decode takes the request off the queue (``replan_rows`` in ``serve/endpoints.py``:
the largest budget whose :meth:`finish_ms` against the rows then fits the time left, or
shed when even the fastest's does not).

Example::

    policy = RowPolicy(table, [(1, 1), (0.5, 0.5)], max_batch_rows=32)
    d = policy.decide(200.0, rows=1, length=12, ahead=[Work((1, 1), 4, 20)],
                      rows_left=[40.0, 120.0])
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

from dynaseq.metrics.latency_table import Pair
from dynaseq.serve.policy import DeadlinePolicy, Decision, Work


class RowPolicy(DeadlinePolicy):
    """Chooses a budget per deadline request of a continuous decode (see the module doc);
    built as :class:`~dynaseq.serve.policy.DeadlinePolicy` (``early_answers`` and
    ``window_ms`` do not apply: a line is always answered as it ends, and takes a row at
    the next step)."""

    def line_ms(self, budget: Pair, length: int, rows: int | None = None) -> float:
        """Predicted milliseconds one line of ``length`` source tokens holds its row at
        ``budget`` while the decode runs ``rows`` rows (default: all of them), before
        ``scale``: the table's time for a batch of that many lines of that length."""
        n = self.max_batch_rows if rows is None else max(1, min(rows, self.max_batch_rows))
        return self.table.predict_ms(budget, n, length)

    def held_ms(self, budget: Pair | None, length: int, rows: int | None = None) -> float:
        """:meth:`line_ms` of a line at ``budget``, the largest budget's for one the table
        lacks or none (a dense model: its one row)."""
        known = budget is not None and self.table.has(budget)
        return self.line_ms(budget if known else self.largest, length, rows)

    def finish_ms(self, budget: Pair, rows: int, length: int, ahead: Sequence[Work] = (),
                  rows_left: Sequence[float] = (), scale: float = 1.0,
                  waiting: Sequence[float] = ()) -> tuple[float, float]:
        """(predicted completion, when its first line takes a row), in ms from now, of a
        request of ``rows`` lines (longest ``length``) at ``budget`` behind the lines
        ``waiting`` for a row (each holding it the given ms, already scaled) and the queued
        ``ahead`` (its flexible lines at ``budget``), with the running lines' rows free in
        ``rows_left`` ms (already scaled; at most ``max_batch_rows`` of them, the other
        rows free now). Each queued line is counted at its request's longest source."""
        free = [0.0] * max(0, self.max_batch_rows - len(rows_left))
        free += sorted(rows_left)[: self.max_batch_rows]
        heapq.heapify(free)
        n = min(self.max_batch_rows,
                len(rows_left) + len(waiting) + sum(w.rows for w in ahead) + rows)
        durations: dict[tuple[Pair, int], float] = {}

        def take(d: float) -> float:
            """One line holding a row ``d`` ms takes the first free: its start."""
            t = heapq.heappop(free)
            heapq.heappush(free, t + d)
            return t

        def hold(b: Pair, lines: int, size: int) -> tuple[float, float]:
            """``lines`` lines of ``size`` tokens at ``b`` take rows in turn: (first start,
            last end)."""
            key = (b, size)
            if key not in durations:
                durations[key] = scale * self.line_ms(b, size, n)
            d, first, last = durations[key], math.inf, 0.0
            for _ in range(lines):
                t = take(d)
                first, last = min(first, t), max(last, t + d)
            return first, last

        for d in waiting:
            take(d)
        for w in ahead:
            hold(budget if w.flexible else self._tabled(w).budget, w.rows, w.length)
        first, last = hold(budget, rows, length)
        return last, first

    def decide(self, deadline_ms: float, rows: int, length: int, ahead: Sequence[Work] = (),
               rows_left: Sequence[float] = (), scale: float = 1.0,
               overhead_ms: float = 0.0, margin_ms: float = 0.0,
               waiting: Sequence[float] = ()) -> Decision:
        """The budget for a request of ``rows`` lines (longest ``length`` tokens) with
        ``deadline_ms`` behind the lines ``waiting`` for a row, the queued ``ahead`` and
        the running rows ``rows_left`` (:meth:`finish_ms`); ``overhead_ms`` is added to every prediction, of which
        ``margin_ms`` is the margin for error (the fallback below goes without it), as
        :meth:`DeadlinePolicy.decide` takes them."""
        def predict(budget: Pair) -> tuple[float, float]:
            done, start = self.finish_ms(budget, rows, length, ahead, rows_left, scale,
                                         waiting)
            return done + overhead_ms, start

        return self._choose(deadline_ms, margin_ms, predict)

    def row_budget(self, rows: int, length: int, left_ms: float,
                   rows_left: Sequence[float] = (), waiting: Sequence[float] = (),
                   scale: float = 1.0, arrival_rate: float = 0.0,
                   max_utilization: float | None = None,
                   arrival_length: int | None = None) -> tuple[Pair, float]:
        """(budget, predicted completion) for a deadline request of ``rows`` lines taken
        off the queue now, behind the lines ``waiting`` and the running ``rows_left``
        (:meth:`finish_ms`, nothing queued ahead of it any more), with ``left_ms`` to its
        due answer (margin already kept aside): the largest budget, one predicted no
        faster than a larger one passed over, whose completion fits; the fastest when
        none does. ``max_utilization`` (None: off) passes over every budget but the
        smallest at which ``arrival_rate`` lines a second of ``arrival_length`` source
        tokens (their mean; None: this request's ``length``) would keep the rows busier
        than that (:meth:`utilization`: a line holds one of ``max_batch_rows`` rows for
        :meth:`line_ms`), as for batches: rows spent on a larger budget near saturation
        are time the queue does not get back, and a step of mixed budgets costs about the
        largest's."""
        fastest = (self.smallest, math.inf)
        for budget in self.budgets:
            if (max_utilization is not None and budget != self.smallest
                    and self.utilization(budget, arrival_rate, arrival_length or length,
                                         scale)
                    > max_utilization):
                continue
            done = self.finish_ms(budget, rows, length, (), rows_left, scale, waiting)[0]
            if done >= fastest[1]:
                continue
            fastest = (budget, done)
            if done <= left_ms:
                return fastest
        return fastest

    # -- planning against the server's queue (``load``: a serve.batcher.Load) ----------
    def plan(self, load: Any, deadline_ms: float, rows: int, length: int) -> Decision:
        return self.decide(deadline_ms, rows, length, load.ahead, load.rows_left, load.scale,
                           load.overhead_ms, load.margin_ms, load.rows_waiting)

    def predicted(self, load: Any, budget: Pair, rows: int, length: int) -> float:
        return self.finish_ms(budget, rows, length, load.ahead, load.rows_left,
                              load.scale, load.rows_waiting)[0]


__all__ = ["RowPolicy"]
