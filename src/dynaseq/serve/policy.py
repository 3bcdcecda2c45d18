"""Deadline -> budget: the largest budget whose predicted completion meets the deadline.

A request that carries ``deadline_ms`` is planned when it arrives (admitted or refused,
and a first budget), and again when its batch is taken (:meth:`DeadlinePolicy.
batch_budget`: one budget for every deadline line of the batch, the largest that answers
each of them in time without making the deadline lines queued behind late; a line that
cannot answer in time even at the smallest is dropped then, :meth:`DeadlinePolicy.late`,
with a 503, rather than answered late). On
arrival its predicted completion is the rest of the batch now running, then the queued
lines in the batches the batcher will form (deadline lines at the candidate budget, the
others at their own), then the batch it joins with its own lines and those expected to
arrive before that batch starts, each batch costing the
:class:`~dynaseq.metrics.latency_table.LatencyTable`'s ``service(budget, n, length)`` at
its longest source, shared by its ``n`` lines. The first budget, largest first, whose
completion is within ``slack × deadline`` is the request's first budget; so under light
load every request gets the full budget, and as the queue grows budgets degrade before
latency does. A budget predicted no faster than a larger one is never chosen. When no
budget is, the request runs at the fastest (the smallest, unless a larger one is predicted
faster) if its prediction without the margin meets the deadline itself; when even that
misses, it is rejected (503 with ``Retry-After``: the seconds the queue ahead needs) or,
with ``overload="smallest"``, run at the fastest budget.

Example::

    policy = DeadlinePolicy(table, [(1, 1), (0.5, 0.5)], max_batch_rows=32)
    d = policy.decide(deadline_ms=200, rows=1, length=12, ahead=[Work((1, 1), 4, 20)],
                      running_ms=15.0)
    d.budget, d.degraded, d.reject, d.predicted_ms
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynaseq.metrics.latency_table import LatencyTable, Pair
from dynaseq.serve.config import LATE_TOLERANCE
from dynaseq.serve.scales import Scale, scale_at


@dataclass(frozen=True)
class Work:
    """Lines waiting in the queue: their budget, how many, their longest source (tokens);
    ``flexible``: they carry a deadline, so their batch may still run them at another
    budget (:meth:`DeadlinePolicy.batch_budget`)."""

    budget: Pair
    rows: int
    length: int
    flexible: bool = False


@dataclass(frozen=True)
class Decision:
    """What the policy chose for one deadline request.

    budget: the budget to run (None when rejected).
    degraded: a smaller budget than the largest was chosen (or ``overload="smallest"``).
    reject: no budget meets the deadline: answer 503 with ``Retry-After: retry_after_s``.
    predicted_ms: predicted completion (queue wait + service) at ``budget`` (at the smallest
        budget when rejected).
    """

    budget: Pair | None
    degraded: bool
    reject: bool
    predicted_ms: float
    retry_after_s: int = 0


class DeadlinePolicy:
    """Chooses a budget per deadline request from a latency table (see the module doc).

    budgets: the budgets the server may choose from, any order (sorted here by compute,
        largest first; each must be in ``table``).
    window_ms: the batching window a request waits when nothing is ahead of it.
    early_answers: the server answers a request as soon as its own lines are done, not
        when its batch's longest line is (``ServeConfig.early_answers``, where the search
        allows it). Its own batch then ends for it when a batch at *its* longest source
        would (the rows decode in step; a line ends with its output, which its source's
        length predicts), while the batches ahead still cost theirs at their longest: a
        line of a 32-line batch of test sentences ends on average at 46% of its batch's
        longest output. Without it, every line of a batch waits for the longest.

    A table read through its fit (:meth:`LatencyTable.fit`) is fitted here, at startup, for
    every budget: fitting on a request's first prediction imported scipy on the server's
    event loop, which held the first request ~0.7 s and, through the margin that one late
    answer set, made every request planned in the next seconds look late.
    """

    def __init__(self, table: LatencyTable, budgets: Sequence[Pair], max_batch_rows: int,
                 window_ms: float = 0.0, slack: float = 1.0, overload: str = "reject",
                 retry_after_min_s: int = 1, early_answers: bool = False) -> None:
        missing = [b for b in budgets if not table.has(b)]
        if missing:
            raise ValueError(f"budgets {missing} are not in the latency table")
        if not budgets:
            raise ValueError("a deadline policy needs at least one budget")
        self.table = table
        # by total compute, then the decoder's (a translation's pair; a classifier's
        # budgets are (encoder,) alone)
        self.budgets = sorted(budgets, key=lambda b: (-sum(b), tuple(-x for x in b[::-1])))
        if table.predict == "fit":
            for b in self.budgets:
                table.fit(b)
        self.max_batch_rows = max_batch_rows
        self.window_ms = window_ms
        self.slack = slack
        self.overload = overload
        self.retry_after_min_s = retry_after_min_s
        self.early_answers = early_answers
        # line_cost_ms by (budget, length, batch): a pure function of the table, read for
        # every line length of every batch a request is planned behind (a dict is safe to
        # share between the event loop and the batch thread: both write the same values)
        self._line_costs: dict[tuple[Pair, int, int], float] = {}
        # the batches a request waits behind are, for the most part, those the request
        # before it waited behind: each one's time at each budget is computed once
        # (functools' cache is thread-safe; a batch is hashed once, :class:`_Batch`)
        self._priced = functools.lru_cache(maxsize=self.SUMMARY_CACHE)(self._summary)

    SUMMARY_CACHE = 4096
    """Batches' predicted times kept (:meth:`_summary_ms`): at 32 lines a batch and a
    handful of budgets and lengths each, a queue of hundreds of batches."""

    @property
    def largest(self) -> Pair:
        return self.budgets[0]

    @property
    def smallest(self) -> Pair:
        return self.budgets[-1]

    def row_ms(self, budget: Pair, length: int, batch: int) -> float:
        """Predicted milliseconds one line adds to a batch of ``batch`` lines."""
        return self.table.predict_ms(budget, batch, length) / batch

    def line_cost_ms(self, budget: Pair, length: int, batch: int) -> float:
        """What one more line of ``length`` source tokens costs a batch of ``batch`` lines:
        the table's ``(t(n, L) - t(1, L)) / (n - 1)`` at ``n = batch`` (0 for one line).
        A batch's time splits into what it costs whatever its rows (per step, for as many
        steps as its longest line decodes) and what each line costs for its own steps; a
        decode drops a line that ends, so a short line in a batch padded to a long one
        costs its own length's share, not the longest's (:meth:`_summary_ms`)."""
        if batch <= 1:
            return 0.0
        key = (budget, length, batch)
        cost = self._line_costs.get(key)
        if cost is None:
            cost = self._line_costs[key] = max(0.0, (
                self.table.predict_ms(budget, batch, length)
                - self.table.predict_ms(budget, 1, length)) / (batch - 1))
        return cost

    def _spared_ms(self, budget: Pair, longest: int, own: int, batch: int) -> float:
        """What a line of ``own`` source tokens is spared in a batch of ``batch`` lines
        that decodes to ``longest``: its :meth:`line_cost_ms` at ``longest`` less at its
        own length (0 when it is the longest)."""
        if own >= longest:
            return 0.0
        return max(0.0, self.line_cost_ms(budget, longest, batch)
                   - self.line_cost_ms(budget, own, batch))

    def batch_ms(self, works: Sequence[Work], budget: Pair | None = None) -> float:
        """Predicted milliseconds of one batch of ``works`` (each at its own budget, or all
        at ``budget``): each line's share of a batch of that many lines at the batch's
        longest source, which every row is padded to and which decides how long it
        decodes."""
        if not works:
            return 0.0
        return self._summary_ms(_Batch.of(works, own=lambda w: budget is None),
                                budget or self.largest)

    def joiners(self, rows: int, ahead: Sequence[Work], running_ms: float | None,
                arrival_rate: float) -> float:
        """Lines expected to join the batch of a request of ``rows`` lines before that
        batch starts: ``arrival_rate`` (lines per second) times the wait for the running
        batch (the batching window when none runs), as far as the batch has room."""
        return self._joiners(rows, sum(w.rows for w in ahead), running_ms, arrival_rate)

    def _joiners(self, rows: int, queued: int, running_ms: float | None,
                 arrival_rate: float) -> float:
        """:meth:`joiners` with ``queued`` lines already in the batch."""
        start_ms = self.window_ms if running_ms is None else running_ms
        room = self.max_batch_rows - queued - rows
        return max(0.0, min(float(room), arrival_rate * start_ms / 1000.0))

    def predict_ms(self, budget: Pair, rows: int, length: int, ahead: Sequence[Work] = (),
                   running_ms: float | None = None, scale: Scale = 1.0,
                   overhead_ms: float = 0.0, arrival_rate: float = 0.0) -> float:
        """Predicted completion (ms from now) of a request of ``rows`` lines at ``budget``
        behind ``ahead`` (see :meth:`decide`)."""
        return self._predict(budget, rows, length, _summaries(self.batches(ahead)),
                             running_ms, scale, overhead_ms, arrival_rate)[0]

    def _predict(self, budget: Pair, rows: int, length: int, batches: list[_Batch],
                 running_ms: float | None, scale: Scale, overhead_ms: float,
                 arrival_rate: float) -> tuple[float, float]:
        """(predicted completion, the time the queue ahead needs) at ``budget``.

        The queue ahead runs in ``batches``, as the batcher will form them
        (:meth:`batches`), each at its longest source, its flexible lines at ``budget``;
        the request's batch is the last of them if it has room, and ends when its last
        line does: the lines in it, the request's own and the expected :meth:`joiners` (at
        the request's budget and length), at the batch's longest; with
        :attr:`early_answers`, the request's answer comes when that batch at the request's
        own longest source would end."""
        last = batches[-1] if batches and (batches[-1].rows + rows
                                           <= self.max_batch_rows) else None
        ahead = batches[:-1] if last is not None else batches
        wait = (running_ms or 0.0) + sum(scale_at(scale, b.rows) * self._summary_ms(b, budget)
                                         for b in ahead)
        if not ahead and last is None and running_ms is None:  # idle: the batching window
            wait += self.window_ms
        queued = 0 if last is None else last.rows
        start_ms = None if running_ms is None and not ahead else wait
        extra = rows + self._joiners(rows, queued, start_ms, arrival_rate)
        n = max(1, min(queued + math.ceil(extra), self.max_batch_rows))
        longest = length if last is None or self.early_answers else max(length, last.length)
        factor = scale_at(scale, n)
        if last is not None:
            wait += factor * self._summary_ms(last, budget, longest, n)
        wait += overhead_ms
        # the request's lines (and the joiners, taken as long) may end before the longest
        own = self.row_ms(budget, longest, n) - self._spared_ms(budget, longest, length, n)
        return wait + factor * extra * own, wait

    def _summary_ms(self, b: _Batch, budget: Pair, length: int | None = None,
                    batch: int | None = None) -> float:
        """:meth:`_summary`, computed once per batch, budget, length and size: planning a
        request behind a queue of 100 lines (3 batches, 7 budgets) took 0.6 ms of the event
        loop's time, on the core that decodes, and grew with the queue."""
        return self._priced(b, budget, length, batch)

    def _summary(self, b: _Batch, budget: Pair, length: int | None,
                 batch: int | None) -> float:
        """:meth:`batch_ms` of the lines a :class:`_Batch` holds, its flexible ones at
        ``budget``, until the batch's lines of ``length`` source tokens end (default: the
        summary's longest, the whole batch): each line's share of a batch of ``batch``
        lines at ``length``, less, for a line shorter than that, what its steps past its
        own end would have cost it (:meth:`line_cost_ms` at ``length`` less at its own
        length): the decode dropped it there.

        That is ``t(n, L) - sum_i [c(L) - c(L_i)]`` for one budget, with ``c`` the per-line
        cost; in the table's fitted model (``t = c0 + c1 n + c2 L + c3 n L``) exactly
        ``c0 + c2 L + sum_i (c1 + c3 min(L_i, L))``. Pricing every line at the longest
        over-predicted the queue ahead by 70-220 ms on the Multi30k CCT at 32 lines a batch
        (the more lines queued, the more), and the server refused requests that would have
        made their deadline."""
        length = b.length if length is None else length
        batch = max(1, min(b.rows, self.max_batch_rows)) if batch is None else batch
        total = sum(k * self.row_ms(p, length, batch) for p, k in b.fixed)  # one per budget
        if b.flexible:
            total += b.flexible * self.row_ms(budget, length, batch)
        for p, own, k in b.by_length:
            total -= k * self._spared_ms(budget if p is None else p, length, own, batch)
        return total

    def batches(self, works: Sequence[Work]) -> list[list[Work]]:
        """``works`` (oldest first) cut into batches as the batcher takes them: in order,
        at most ``max_batch_rows`` lines each, a request's lines never split."""
        out: list[list[Work]] = []
        rows = 0
        for w in works:
            if not out or (out[-1] and rows + w.rows > self.max_batch_rows):
                out.append([])
                rows = 0
            out[-1].append(w)
            rows += w.rows
        return out

    def decide(self, deadline_ms: float, rows: int, length: int, ahead: Sequence[Work] = (),
               running_ms: float | None = None, scale: Scale = 1.0,
               overhead_ms: float = 0.0, arrival_rate: float = 0.0,
               margin_ms: float = 0.0) -> Decision:
        """The budget for a request of ``rows`` lines (longest ``length`` tokens) with
        ``deadline_ms``, given the queued ``ahead`` and the running batch's remaining
        ``running_ms`` (None: no batch is running).

        ``scale`` multiplies the table's service times (the server's measured ratio of real
        batch time to predicted: what it runs besides the decode, load on the machine; one
        factor, or one per batch size: :data:`~dynaseq.serve.scales.Scale`);
        ``overhead_ms`` is added to every prediction (the server's margin for what
        predictions miss: request parsing, the event loop's own queue, batches that run
        long), of which ``margin_ms`` is the margin for error (the rest: time known to be
        spent, as the event loop's lag); ``arrival_rate`` (lines per second) says how many
        lines will join the request's batch before it starts (:meth:`joiners`).

        A budget is chosen with the margin and within ``slack × deadline``; a budget
        predicted no faster than a larger one is passed over (it would lose quality for no
        time: on a trained CCT the smallest budget's outputs run longer, and at 32 lines
        it was predicted slower than (0.33, 0.33)). When none is, the request is still
        admitted at the fastest budget (the smallest, unless a larger one is predicted
        faster) if its prediction without the margin is within the deadline itself: a
        refused request misses its deadline for certain, one admitted at the fastest
        usually makes it (and is shed when its batch is formed if it is then predicted past
        ``slack × deadline``)."""
        batches = _summaries(self.batches(ahead))  # the same at every budget
        return self._choose(deadline_ms, margin_ms, lambda budget: self._predict(
            budget, rows, length, batches, running_ms, scale, overhead_ms, arrival_rate))

    def _choose(self, deadline_ms: float, margin_ms: float,
                predict: Callable[[Pair], tuple[float, float]]) -> Decision:
        """:meth:`decide`'s choice, from ``predict(budget)``: (the predicted completion,
        margin included; the wait before the request starts, for ``Retry-After``)."""
        limit = self.slack * deadline_ms
        fastest = (math.inf, 0.0, self.smallest)  # (predicted, wait, budget)
        for budget in self.budgets:
            predicted, wait = predict(budget)
            if predicted >= fastest[0]:  # no faster than a larger budget: dominated
                continue
            fastest = (predicted, wait, budget)
            if predicted <= limit:
                return Decision(budget, budget != self.largest, False, predicted)
        predicted, wait, budget = fastest
        if self.overload == "smallest" or predicted - margin_ms <= deadline_ms:
            return Decision(budget, budget != self.largest or self.overload == "smallest",
                            False, predicted)
        retry = max(self.retry_after_min_s, math.ceil(wait / 1000.0))
        return Decision(None, True, True, predicted, retry)

    # -- planning against the server's queue (``load``: a serve.batcher.Load) ----------
    def plan(self, load: Any, deadline_ms: float, rows: int, length: int) -> Decision:
        """:meth:`decide` against the queue as ``load`` holds it (a request on arrival)."""
        return self.decide(deadline_ms, rows, length, load.ahead, load.running_ms,
                           _load_scale(load), load.overhead_ms, load.arrival_rate,
                           load.margin_ms)

    def predicted(self, load: Any, budget: Pair, rows: int, length: int) -> float:
        """:meth:`predict_ms` of a request at ``budget`` against ``load`` (no overhead)."""
        return self.predict_ms(budget, rows, length, load.ahead, load.running_ms,
                               _load_scale(load), arrival_rate=load.arrival_rate)

    def batch_budget(self, fixed: Sequence[Work], flexible: Sequence[Work],
                     left_ms: Sequence[float], scale: Scale = 1.0,
                     behind: Sequence[tuple[Work, float | None]] = (),
                     late_share: Callable[[float], float] | None = None,
                     late_tolerance: float = LATE_TOLERANCE, arrival_rate: float = 0.0,
                     max_utilization: float | None = None,
                     arrival_length: int | None = None) -> Pair:
        """The one budget for the ``flexible`` lines of a batch about to run (those that
        carry a deadline) beside the ``fixed`` ones (a budget of their own): the largest
        that answers each flexible line within its ``left_ms`` (the time left to its due
        answer) by the predicted batch time, ``scale`` times the table's (with
        :attr:`early_answers`, each line's batch time at its own longest source:
        :meth:`answers_in_time`) and leaves the work queued ``behind`` it
        (``(work, ms left to its due answer or None)``, oldest first) able to answer in
        time with its flexible lines at the smallest budget, batch after batch; the
        fastest when none is. A budget predicted no faster than a larger one is passed
        over, as in :meth:`decide`. One budget for all of them keeps the batch's gates alike,
        which a mixed batch would not be; looking behind keeps a batch from spending time
        that later requests were admitted on.

        ``late_share`` (``slack_ms -> share``, None: off) replaces "within ``left_ms``" for
        the flexible lines by :meth:`_within_risk`: none predicted past its time left, and
        at most ``late_tolerance`` of them expected late, each at the share of recent
        answers later than predicted by more than its slack (``left_ms`` then keeps no
        margin). ``max_utilization`` (None: off) passes over every budget but the smallest
        whose :meth:`utilization` at ``arrival_rate`` lines a second of
        ``arrival_length`` source tokens (their mean; None: the batch's longest source)
        is above it."""
        if len(left_ms) != len(flexible):
            raise ValueError(f"{len(left_ms)} times left for {len(flexible)} flexible works")
        fixed = [self._tabled(w) for w in fixed]
        fastest, least = self.smallest, math.inf
        if arrival_length is None:
            arrival_length = max((w.length for w in [*fixed, *flexible]), default=1)
        lengths = [w.length for w in flexible]
        for budget in self.budgets:
            if (max_utilization is not None and budget != self.smallest
                    and self.utilization(budget, arrival_rate, arrival_length, scale)
                    > max_utilization):
                continue  # the arrivals would outrun it
            works = [*fixed, *(Work(budget, w.rows, w.length) for w in flexible)]
            spent = scale_at(scale, _lines(works)) * self.batch_ms(works)
            if spent >= least:  # no faster than a larger budget: dominated
                continue
            fastest, least = budget, spent
            in_time = (self._within_risk(works, flexible, lengths, left_ms, scale,
                                         late_share, late_tolerance) if late_share is not None
                       else all(self.answers_in_time(works, lengths, left_ms, scale)))
            if in_time and self._behind_in_time(spent, behind, scale):
                return budget
        return fastest

    def utilization(self, budget: Pair, arrival_rate: float, length: int,
                    scale: Scale = 1.0) -> float:
        """The share of the server's time that ``arrival_rate`` lines a second at
        ``budget`` would take, each line at its share of a full batch
        (``max_batch_rows`` lines at ``length``, ``scale`` times the table's): at 1 or
        more the queue grows without bound."""
        return (arrival_rate * scale_at(scale, self.max_batch_rows)
                * self.row_ms(budget, length, self.max_batch_rows) / 1000)

    def _within_risk(self, works: Sequence[Work], flexible: Sequence[Work],
                     lengths: Sequence[int], left_ms: Sequence[float], scale: Scale,
                     late_share: Callable[[float], float], tolerance: float) -> bool:
        """Whether one batch of ``works`` answers its ``flexible`` lines (their longest
        sources ``lengths``) in time with acceptable risk: none is predicted past its
        ``left_ms`` (no margin), and the expected share of its lines answered late, each
        line's chance ``late_share(left - predicted)`` (the share of recent answers that
        came later than predicted by more than that slack), weighted by the lines, is at
        most ``tolerance``."""
        times = self.answer_ms(works, lengths, scale)
        if any(t > left for t, left in zip(times, left_ms, strict=True)):
            return False
        rows = sum(w.rows for w in flexible)
        late = sum(w.rows * late_share(left - t)
                   for w, t, left in zip(flexible, times, left_ms, strict=True))
        return late <= tolerance * rows

    def answers_in_time(self, works: Sequence[Work], lengths: Sequence[int],
                        left_ms: Sequence[float], scale: Scale = 1.0) -> list[bool]:
        """Whether one batch of ``works`` (each at its own budget) answers a line whose
        longest source is ``lengths[i]`` within ``left_ms[i]``: the batch's predicted
        time (:meth:`batch_ms`), ``scale`` times the table's, at its longest source, or with
        :attr:`early_answers` at ``lengths[i]`` (the line's answer does not wait for the
        batch's longest)."""
        return [t <= left for t, left in zip(self.answer_ms(works, lengths, scale), left_ms,
                                                 strict=True)]

    def answer_ms(self, works: Sequence[Work], lengths: Sequence[int], scale: Scale = 1.0
                  ) -> list[float]:
        """Predicted milliseconds from its start until one batch of ``works`` (each at its
        own budget) answers a line whose longest source is ``lengths[i]``: the batch's
        time (:meth:`batch_ms`), ``scale`` times the table's, at its longest source, or
        with :attr:`early_answers` at ``lengths[i]``."""
        batch = _Batch.of(works, own=lambda w: True)
        factor = scale_at(scale, batch.rows)
        times: dict[int | None, float] = {}  # one prediction per length asked (one without)
        out = []
        for length in lengths:
            key = length if self.early_answers else None
            if key not in times:
                times[key] = factor * self._summary_ms(batch, self.largest, key)
            out.append(times[key])
        return out

    def late(self, fixed: Sequence[Work], flexible: Sequence[Work], left_ms: Sequence[float],
             scale: Scale = 1.0) -> list[bool]:
        """Which ``flexible`` lines of a batch about to run (``left_ms``: the time left to
        each one's due answer) cannot answer in time even with every flexible line at the
        smallest budget (:meth:`answers_in_time`: the batch's predicted time, ``scale``
        times the table's, more than their time left). The line with the least time left
        goes first; dropping it shortens the batch for the others, so each next one is
        checked against the batch without those dropped. (No margin: a line is dropped when
        its answer is predicted late, not when it merely might be.)"""
        fixed = [self._tabled(w) for w in fixed]
        out = [False] * len(flexible)
        for i in sorted(range(len(flexible)), key=lambda i: left_ms[i]):
            works = [*fixed, *(Work(self.smallest, w.rows, w.length)
                               for w, dropped in zip(flexible, out, strict=True) if not dropped)]
            out[i] = not self.answers_in_time(works, [flexible[i].length], [left_ms[i]],
                                              scale)[0]
        return out

    def _tabled(self, w: Work) -> Work:
        """``w``, at the largest budget when the table lacks its own."""
        return w if self.table.has(w.budget) else Work(self.largest, w.rows, w.length)

    def _behind_in_time(self, start_ms: float, behind: Sequence[tuple[Work, float | None]],
                        scale: Scale) -> bool:
        """Whether the queued ``behind``, run in the batches the batcher will form
        (:meth:`batches`) from ``start_ms`` on, flexible lines at the smallest budget,
        answers each flexible one by its time left."""
        t, k = start_ms, 0
        for batch in self.batches([w for w, _ in behind]):
            t += scale_at(scale, _lines(batch)) * self.batch_ms(
                [self._tabled(w) for w in _flexible_at(batch, self.smallest)])
            if any(left is not None and t > left for _, left in behind[k: k + len(batch)]):
                return False
            k += len(batch)
        return True


@dataclass(frozen=True)
class _Batch:
    """A batch of queued lines as a prediction needs it: its lines, its longest source,
    ``(budget, lines)`` of those with a budget of their own, the number of flexible ones
    (a deadline's: their budget is the one being tried) and ``by_length``: ``(budget, source
    length, lines)``, the lines by budget and length (budget None: flexible)."""

    rows: int
    length: int
    fixed: tuple[tuple[Pair, int], ...]
    flexible: int
    by_length: tuple[tuple[Pair | None, int, int], ...]
    hashed: int = field(default=0, compare=False, repr=False)

    def __hash__(self) -> int:  # computed once, in :meth:`of`: a batch is a cache key
        return self.hashed

    @classmethod
    def of(cls, works: Sequence[Work], own: Callable[[Work], bool]) -> _Batch:
        """``works`` (at least one) summed up: those for which ``own`` is True at their own
        budget, the others flexible."""
        fixed: dict[Pair, int] = {}
        by_length: dict[tuple[Pair | None, int], int] = {}
        flexible = 0
        for w in works:
            budget = w.budget if own(w) else None
            if budget is not None:
                fixed[budget] = fixed.get(budget, 0) + w.rows
            else:
                flexible += w.rows
            by_length[budget, w.length] = by_length.get((budget, w.length), 0) + w.rows
        fields = (sum(w.rows for w in works), max(w.length for w in works),
                  tuple(fixed.items()), flexible,
                  tuple((p, n, k) for (p, n), k in by_length.items()))
        return cls(*fields, hash(fields))


def _summaries(batches: list[list[Work]]) -> list[_Batch]:
    """Each batch of :meth:`DeadlinePolicy.batches` as a :class:`_Batch` (its lines with a
    deadline flexible), made once for every budget a request tries."""
    return [_Batch.of(works, own=lambda w: not w.flexible) for works in batches]


def _lines(works: Sequence[Work]) -> int:
    """The lines of ``works`` (at least 1: a factor's size class)."""
    return max(1, sum(w.rows for w in works))


def _load_scale(load: Any) -> Scale:
    """The factor a plan against ``load`` runs at: per batch size where the server keeps
    one (:attr:`~dynaseq.serve.batcher.Load.by_size`), else its one scale."""
    return load.scale if load.by_size is None else load.by_size


def _flexible_at(works: Sequence[Work], budget: Pair) -> list[Work]:
    """``works`` with their flexible lines (those with a deadline) at ``budget``."""
    return [Work(budget, w.rows, w.length, True) if w.flexible else w for w in works]
