"""Dynamic batching: requests queue on the event loop, one worker thread runs the model.

The asyncio loop only validates, plans and queues a :class:`Job`; a single worker thread
takes the oldest job, waits up to the batching window (counted from that job's arrival) for
more jobs of the same group (same endpoint and decoding settings) to join, up to
``max_batch_rows`` lines, and runs them as one batch with their own budgets per row
(nothing is padded to the slowest budget). When more of the group is queued than one
batch holds, the batch takes the oldest job's budget's jobs instead, where they make at
least half a batch (:attr:`Batcher.by_budget`): a step costs about the union of its rows'
work (a budget-1 row runs every gated part), so a deep queue runs single-budget batches
and a shallow one mixes budgets rather than wait. Nothing queued behind a job with a
deadline is taken before it, and a batch headed by one keeps arrival order. Results go
back to each request's future on the loop. An exception fails that batch's jobs only; the
next batch runs. A job whose client went away (:meth:`Job.cancel`) is dropped before it
runs. :meth:`Batcher.stop` drains: every queued job still runs before the worker exits.

The worker thread runs at a lower scheduling priority than the event loop (``nice``, on
Linux, where a thread has its own): where the two share a core, the loop reads a request,
plans it and sends an answer as soon as it has one to handle, instead of waiting for the
kernel's share of a core that a decoding batch keeps busy. The batch loses only the time
the loop works, which it loses either way.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from dynaseq.serve.metrics import ServerMetrics
from dynaseq.serve.policy import Work
from dynaseq.serve.scales import BatchScales, FrozenScales

BudgetParts = tuple[float, ...]
"""The budget a job runs at, one fraction per budgeted part: ``(encoder, decoder)`` for
translation, ``(encoder,)`` for classification."""


@dataclass(frozen=True)
class Load:
    """The queue as a deadline request finds it.

    ahead: the queued work, oldest first.
    running_ms: what the running batch still needs (ms, scaled; None when none runs).
    scale: :attr:`Batcher.scale`; overhead_ms: :attr:`Batcher.overhead_ms` plus the event
    loop's lag; margin_ms: :attr:`Batcher.overhead_ms` alone; arrival_rate: lines
    submitted per second lately.
    rows_left: a continuous decode's running lines (:meth:`Batcher.row_begin`): the ms
    each still holds its row for (its predicted time, scaled, less its age).
    rows_waiting: the lines it took off the queue that wait for a row
    (:meth:`Batcher.row_wait`), in the order they take one: the ms each will hold it
    (scaled).
    by_size: the factor per batch size (:attr:`Batcher.scales` frozen; None: ``scale``
    for every batch).
    """

    ahead: list[Work]
    running_ms: float | None
    scale: float
    overhead_ms: float
    margin_ms: float
    arrival_rate: float
    rows_left: tuple[float, ...] = ()
    rows_waiting: tuple[float, ...] = ()
    by_size: FrozenScales | None = None


class QueueFull(Exception):
    """The queue holds ``max_queue_rows`` lines already."""


class Shed(Exception):
    """A queued job was dropped when its batch was formed: it could no longer answer by its
    deadline (503 with ``Retry-After: retry_after_s``)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Job:
    """One request's work.

    group: jobs with equal groups may share a batch (e.g. ``("translate", beam)``).
    run: ``run(jobs) -> one result per job``, called in the worker thread with the batch.
    payload: what ``run`` needs (lines, per-line budgets, options).
    rows, length, budget: its lines, the longest line's tokens and its budget
        (:data:`BudgetParts`; ``None`` for models without one), for the queue's latency
        prediction (translation) and the metrics.
    deadline_ms: the request's deadline (None: it named its budget or took the default);
        due: when its answer is due (``time.perf_counter()`` seconds), set on arrival.
    replan: ``replan(jobs, scale, behind)``, called in the worker thread with a batch just
        taken (the first such job's) and the jobs still queued, before it runs: may choose
        again the budgets of the batch's jobs that carry a deadline, now that the batch
        is known, and may shed some of them (:attr:`shed`).
    shed: set by ``replan``: the job does not run; its request gets :class:`Shed`. Set by
        ``run``: the job ran but has no answer (it expired); its request gets it.
        ``run`` may also answer a job before the batch ends (:meth:`settle`).
    expires: when an answer would be too late to send (``time.perf_counter()`` seconds;
        None: never): ``run`` may drop the job's lines that are still running then.
    formed_due: when ``replan`` predicted, as it formed the job's batch, that the job would
        be answered (``time.perf_counter()`` seconds; None: not predicted), for
        :meth:`Batcher.observe_formed`.
    feeds: ``run`` takes more jobs while it runs: it is called as ``run(jobs, more)``, with
        ``more(rows)`` handing it the queued jobs of its group that fit in ``rows`` lines
        (:meth:`Batcher.take_more`; continuous batching), and answers each of those itself
        (:meth:`settle`).
    queued: :meth:`work` as the job was queued (:meth:`Batcher.submit`): what
        :meth:`Batcher.snapshot` counts for every request planned behind it. A queued job
        keeps its budget, lines and due time; only a taken batch is planned again.
    """

    group: Hashable
    run: Callable[[list[Job]], list[Any]]
    payload: Any
    rows: int
    length: int = 1
    budget: BudgetParts | None = None
    endpoint: str = ""
    future: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None
    batch_rows: int = 0
    cancelled: bool = False
    predicted_ms: float | None = None  # the policy's completion estimate, overhead excluded
    plan: dict[str, float] | None = None  # what the estimate was made against (access log)
    deadline_ms: float | None = None
    due: float | None = None
    replan: Callable[[list[Job], float, list[Job]], None] | None = None
    shed: Shed | None = None
    expires: float | None = None
    formed_due: float | None = None
    settled: bool = False
    feeds: bool = False
    queued: Work | None = None

    def settle(self, result: Any) -> None:
        """Answer now, from ``run`` while the rest of its batch goes on (:attr:`settled`:
        the batcher does not answer it again)."""
        self.settled = True
        _deliver(self, result=result)

    def refuse(self, shed: Shed) -> None:
        """As :meth:`settle`, with ``shed`` for its request instead of an answer (a job of
        a continuous decode that expired: :attr:`shed`)."""
        self.shed = shed
        self.settled = True
        _deliver(self, exc=shed)

    def cancel(self) -> None:
        """The client went away: drop the job if it has not started; a decode that has
        drops its lines at its next step (:meth:`expiry`)."""
        self.cancelled = True

    def expiry(self) -> float:
        """When decoding the job's lines stops being worth it (``time.perf_counter()``
        seconds, read at every step of a decode): ``-inf`` once its client has gone, else
        its :attr:`expires` (``inf``: never)."""
        if self.cancelled:
            return -math.inf
        return math.inf if self.expires is None else self.expires

    def work(self, default: tuple[float, float] = (1.0, 1.0)) -> Work:
        """The job as the deadline policy counts it: its budget (``default`` when it has
        none), lines, longest source, and whether it carries a deadline."""
        return Work(self.budget or default, self.rows, self.length, self.due is not None)


class LateAnswers:
    """How much later than predicted the recent answers came: the ``quantile`` of the
    last ``window`` errors (:meth:`add`; early answers count 0), each decayed with time
    constant ``tau_s`` from when it was observed (:meth:`at`), as a margin that keeps that
    share of answers within their predictions; an error fades once answers stop coming.

    Written here, not taken from a library: no statistics package keeps a quantile over a
    sliding window whose values also decay with their age. The errors are ranked once, as
    they arrive (:func:`_decay_rank`), so reading the quantile costs no sort. Not
    thread-safe by itself: :class:`Batcher` holds its lock around it.
    """

    def __init__(self, quantile: float, window: int, tau_s: float) -> None:
        self.quantile = quantile
        self.window = window
        self.tau_s = tau_s
        self.errors: deque[tuple[float, float, float]] = deque()  # (rank, error, when)
        self.ranked: list[tuple[float, float, float]] = []  # the same, in rank order

    def add(self, late_ms: float, when: float) -> None:
        """One more answer, ``late_ms`` later than predicted (negative: early), observed at
        ``when`` (``time.perf_counter()`` seconds)."""
        late = max(0.0, late_ms)
        entry = (_decay_rank(late, when, self.tau_s), late, when)
        self.errors.append(entry)
        bisect.insort(self.ranked, entry)
        while len(self.errors) > self.window:
            old = self.errors.popleft()
            del self.ranked[bisect.bisect_left(self.ranked, old)]

    def share_above(self, slack_ms: float, now: float) -> float:
        """The share of the errors that, decayed to ``now``, exceed ``slack_ms``: a line
        with that much time to spare is late this often (0 with no error observed; 1 for
        a negative slack, a line predicted late)."""
        n = len(self.ranked)
        if not n:
            return 0.0
        if slack_ms < 0:
            return 1.0
        # :func:`_decay_rank` at ``now``; a slack of 0: every error above 0
        key = math.log(slack_ms) + now / self.tau_s if slack_ms > 0 else -math.inf
        return (n - bisect.bisect_right(self.ranked, (key, math.inf, math.inf))) / n

    def at(self, now: float) -> float:
        """The margin at ``now``: the :attr:`quantile` of the errors, each decayed."""
        n = len(self.ranked)
        if not n:
            return 0.0
        _, e, when = self.ranked[min(n - 1, int(self.quantile * n))]
        return _decayed(e, when, self.tau_s, now)


class Batcher:
    """The queue and its worker thread (see the module doc).

    estimate_ms: predicted milliseconds of a batch of jobs (for :meth:`snapshot`'s running
        time), or None.
    nice: how much lower the worker thread's scheduling priority is than the process's
        (its nice value raised by this much; 0: the same; Linux only, see the module doc).
    by_budget: a deep queue forms single-budget batches (the module doc; False: arrival
        order only).
    scale_by_size: keep the factor below per size class of batches as well
        (:class:`~dynaseq.serve.scales.BatchScales`; :attr:`Load.by_size`).

    :attr:`scale` follows the ratio of each batch's real time to its estimate (an
    exponential moving average, weight :data:`SCALE_WEIGHT`, clamped to :data:`SCALE_RANGE`;
    the first batches weigh more, :meth:`_update_scale`), so predictions from a latency
    table measured on the bare model include what the server adds around it; with
    ``scale_by_size``, :meth:`scale_at` is the same per size class. :attr:`overhead_ms` is
    the :data:`OVERHEAD_QUANTILE` quantile of how much later than predicted on arrival the
    last :data:`OVERHEAD_WINDOW` requests were answered (:attr:`admission`,
    :meth:`observe`): what a prediction misses (time outside the queue and the batches, a
    batch that ran long, lines that joined a batch later), as a margin that keeps that share
    of requests within their predictions. Each error decays with time constant
    :data:`OVERHEAD_TAU_S` from when it was observed, so a server that rejected everything
    while it was high admits requests again once they stop coming. :attr:`formation_ms` is
    the same quantile of how much later than predicted *when their batch was formed* the
    answers came (:attr:`formation`, :meth:`observe_formed`): the margin a batch's own lines
    need, which knows the batch and no longer the queue. :attr:`arrival_rate` follows the
    lines submitted per second (decaying with time constant :data:`ARRIVAL_TAU_S`): how many
    lines will join a batch before it starts; :attr:`arrival_length`, their mean source
    length, weighted the same way.
    """

    # OVERHEAD_*: the quantile, window and time constant of both error windows,
    # :attr:`admission` (read as :attr:`overhead_ms`) and :attr:`formation`
    SCALE_WEIGHT = BatchScales.WEIGHT
    SCALE_RANGE = BatchScales.BOUNDS
    RATIO_WINDOW = BatchScales.WINDOW
    TYPICAL_MIN_BATCHES = BatchScales.TYPICAL_MIN
    OVERHEAD_QUANTILE = 0.95
    OVERHEAD_WINDOW = 200
    OVERHEAD_TAU_S = 2.0
    ARRIVAL_TAU_S = 1.0

    def __init__(self, metrics: ServerMetrics, window_ms: float, max_batch_rows: int,
                 max_queue_rows: int,
                 estimate_ms: Callable[[list[Job]], float] | None = None,
                 nice: int = 0, by_budget: bool = True, scale_by_size: bool = False) -> None:
        if nice < 0:
            raise ValueError(f"nice must be >= 0 (a lower priority), got {nice}")
        self.metrics = metrics
        self.nice = nice
        self.by_budget = by_budget
        self.window_s = window_ms / 1000.0
        self.max_batch_rows = max_batch_rows
        self.max_queue_rows = max_queue_rows
        self.estimate_ms = estimate_ms
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._running: tuple[float, float, int] | None = None  # (start, predicted ms, lines)
        # a continuous decode's lines: key -> (when it took its row, None while it waits;
        # its predicted ms), in the order they were taken
        self._rows: dict[Hashable, tuple[float | None, float]] = {}
        self._thread: threading.Thread | None = None
        self.scales = BatchScales(scale_by_size)  # real ÷ estimated time of the batches
        self.admission = LateAnswers(self.OVERHEAD_QUANTILE, self.OVERHEAD_WINDOW,
                                     self.OVERHEAD_TAU_S)  # :meth:`observe`
        self.formation = LateAnswers(self.OVERHEAD_QUANTILE, self.OVERHEAD_WINDOW,
                                     self.OVERHEAD_TAU_S)  # :meth:`observe_formed`
        # (lines per second, source tokens per second, when): both decay alike, so their
        # ratio is the arriving lines' mean length whenever it is read
        self._arrivals = (0.0, 0.0, time.perf_counter())
        self.loop_lag_ms = 0.0  # set by the app's loop monitor

    # -- event loop side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="dynaseq-batcher",
                                        daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def queued_rows(self) -> int:
        with self._cond:
            return sum(j.rows for j in self._queue)

    def snapshot(self) -> Load:
        """What the deadline policy plans a request against (:class:`Load`)."""
        with self._cond:
            ahead = [j.queued or j.work() for j in self._queue]
            running = None
            if self._running is not None:
                start, predicted, lines = self._running
                running = max(0.0, self.scale_at(lines) * predicted
                              - 1000.0 * (time.perf_counter() - start))
            margin = self.overhead_ms
            rows, waiting = self._rows_now()
            return Load(ahead, running, self.scale, margin + self.loop_lag_ms, margin,
                        self.arrival_rate, rows, waiting, self.scales.sized())

    def _rows_now(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(:attr:`Load.rows_left`, :attr:`Load.rows_waiting`) now; the caller holds the
        lock."""
        now = time.perf_counter()
        held = self._rows.values()
        return (tuple(max(0.0, self.scale * ms - 1000.0 * (now - start))
                      for start, ms in held if start is not None),
                tuple(self.scale * ms for start, ms in held if start is None))

    def rows_now(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """A continuous decode's running and waiting lines as :meth:`snapshot` reports
        them (:attr:`Load.rows_left`, :attr:`Load.rows_waiting`)."""
        with self._cond:
            return self._rows_now()

    @property
    def overhead_ms(self) -> float:
        """The margin now: the :data:`OVERHEAD_QUANTILE` quantile of the recent errors,
        each decayed since it was observed."""
        return self.overhead_at(time.perf_counter())

    def overhead_at(self, now: float) -> float:
        """:attr:`overhead_ms` at ``now`` (``time.perf_counter()`` seconds)."""
        with self._cond:
            return self.admission.at(now)

    @property
    def formation_ms(self) -> float:
        """The margin for a batch's own lines now (see the class doc)."""
        with self._cond:
            return self.formation.at(time.perf_counter())

    @property
    def arrival_rate(self) -> float:
        """Lines submitted per second lately (decayed since the last submission)."""
        rate, _, when = self._arrivals
        return _decayed(rate, when, self.ARRIVAL_TAU_S, time.perf_counter())

    @property
    def arrival_length(self) -> int:
        """The mean source length (tokens) of the lines submitted lately, each weighted as
        :attr:`arrival_rate` weighs it, ``exp(-age / ARRIVAL_TAU_S)``, rounded (at least 1;
        1 before any line): what a line costs a saturated server on average, where a
        batch's longest line overstates it. A job counts each of its lines at its longest
        line's length (:attr:`Job.length`)."""
        rate, tokens, _ = self._arrivals
        return max(1, round(tokens / rate)) if rate > 0 else 1

    def formation_late_share(self, slack_ms: float) -> float:
        """:meth:`LateAnswers.share_above` of the formation errors, now."""
        with self._cond:
            return self.formation.share_above(slack_ms, time.perf_counter())

    def observe(self, predicted_ms: float, latency_ms: float) -> None:
        """A request predicted on arrival (without overhead) to take ``predicted_ms`` was
        answered in ``latency_ms``: one more error for :attr:`overhead_ms`."""
        with self._cond:
            self.admission.add(latency_ms - predicted_ms, time.perf_counter())

    def observe_formed(self, late_ms: float) -> None:
        """A request was answered ``late_ms`` after the time predicted when its batch was
        formed (negative: before it): one more error for :attr:`formation_ms`."""
        with self._cond:
            self.formation.add(late_ms, time.perf_counter())

    @property
    def running_rows(self) -> int:
        """The lines of a continuous decode that hold a row now or wait for one
        (:meth:`row_wait`)."""
        with self._cond:
            return len(self._rows)

    def row_wait(self, key: Hashable, predicted_ms: float) -> None:
        """A line of a continuous decode was taken off the queue and waits for a row (in
        the worker thread), predicted to hold it ``predicted_ms`` (before :attr:`scale`):
        what :meth:`snapshot` reports in :attr:`Load.rows_waiting`."""
        with self._cond:
            self._rows[key] = (None, predicted_ms)

    def row_begin(self, key: Hashable) -> None:
        """The waiting line ``key`` took its row: its time starts (:attr:`Load.rows_left`
        from here)."""
        with self._cond:
            held = self._rows.get(key)
            if held is not None:
                self._rows[key] = (time.perf_counter(), held[1])

    def row_end(self, key: Hashable, finished: bool = True) -> None:
        """The line ``key`` left its row (or left while it waited for one). Its real time
        over its prediction moves :attr:`scale` as a batch's does, each line by a batch's
        weight over ``max_batch_rows`` (a full decode's lines finish about as often as that
        many batches' would). A line dropped before it finished (``finished`` False: its
        deadline passed, its client left) counts only when it had already run longer than
        predicted, at what it ran: its real time was at least that. Leaving such lines out
        let a server whose every line ran past its deadline keep the scale that admitted
        them."""
        with self._cond:
            held = self._rows.pop(key, None)
            if held is None or held[0] is None or held[1] <= 0:
                return
            ratio = 1000.0 * (time.perf_counter() - held[0]) / held[1]
            if finished or ratio > self.scale:
                self._update_scale(ratio, self.SCALE_WEIGHT / self.max_batch_rows)

    def submit(self, job: Job) -> asyncio.Future:
        """Queue ``job`` (on the event loop); its future receives the result or exception.
        Raises :class:`QueueFull` when the queue is full or the server is draining."""
        loop = asyncio.get_running_loop()
        job.loop, job.future = loop, loop.create_future()
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            queued = sum(j.rows for j in self._queue)
            if queued + job.rows > self.max_queue_rows:
                raise QueueFull(f"{queued} lines are queued (limit {self.max_queue_rows})")
            job.enqueued = time.perf_counter()
            job.queued = job.work()
            rate, tokens, when = self._arrivals
            decay = _decayed(1.0, when, self.ARRIVAL_TAU_S, job.enqueued)
            self._arrivals = (rate * decay + job.rows / self.ARRIVAL_TAU_S,
                              tokens * decay + job.rows * job.length / self.ARRIVAL_TAU_S,
                              job.enqueued)
            self._queue.append(job)
            self.metrics.queue_rows.set(queued + job.rows)
            self._cond.notify()
        return job.future

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, run every queued one, then end the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- worker side ----------------------------------------------------------------------
    def _take(self) -> list[Job] | None:
        """The next batch (None: stopped and drained)."""
        with self._cond:
            while not self._queue:
                if self._stopping:
                    return None
                self._cond.wait()
            first = self._queue[0]
            until = first.enqueued + self.window_s
            while not self._stopping:
                rows = sum(j.rows for j in self._queue if j.group == first.group)
                left = until - time.perf_counter()
                if rows >= self.max_batch_rows or left <= 0:
                    break
                self._cond.wait(left)
            batch = self._pick(first)
            for job in batch:
                self._queue.remove(job)
            batch = self._replanned(batch)
            predicted = self.estimate_ms(batch) if self.estimate_ms is not None else 0.0
            # (lines at least 1: a batch its replan emptied runs nothing, for no time)
            self._running = (time.perf_counter(), predicted, max(1, sum(j.rows for j in batch)))
            self.metrics.queue_rows.set(sum(j.rows for j in self._queue))
            return batch

    def take_more(self, group: Hashable, rows: int) -> list[Job]:
        """For a running batch of ``group`` that takes jobs as it goes (:attr:`Job.feeds`):
        the queued jobs from the front of the queue while they are of ``group`` and fit in
        ``rows`` lines (a client gone: dropped), taken off the queue. Those with a
        deadline are planned again as they are taken (:meth:`_replanned`), and one the
        plan sheds gets its :class:`Shed` (503) instead. An empty list when the queue's
        first job is of another kind: the batch then runs out and the queue is batched as
        usual."""
        taken: list[Job] = []
        now = time.perf_counter()
        with self._cond:
            while self._queue:
                job = self._queue[0]
                if job.cancelled or (job.future is not None and job.future.done()):
                    self._queue.popleft()
                    self.metrics.cancelled.labels(job.endpoint).inc()
                    continue
                used = sum(j.rows for j in taken)
                if job.group != group or used + job.rows > rows:
                    break
                self._queue.popleft()
                taken.append(job)
            taken = self._replanned(taken)
            for job in taken:
                job.started, job.batch_rows = now, job.rows
            self.metrics.queue_rows.set(sum(j.rows for j in self._queue))
        for job in taken:
            self.metrics.batch_rows.labels(job.endpoint).observe(job.rows)
        return taken

    def _replanned(self, jobs: list[Job]) -> list[Job]:
        """``jobs``, just taken off the queue (the lock held), planned again where one
        carries a deadline (``replan(jobs, scale, queued)``, the first such job's) less
        those the plan shed, which get their :class:`Shed` (503); a planning fault fails
        these jobs (500), not the worker."""
        replan = next((j.replan for j in jobs if j.replan is not None), None)
        if replan is None:
            return jobs
        try:
            replan(jobs, self.scales.sized() or self.scale, list(self._queue))
        except Exception as e:
            self.metrics.batch_failures.labels(jobs[0].endpoint).inc()
            for job in jobs:
                _deliver(job, exc=e)
            return []
        for job in jobs:
            if job.shed is not None:
                _deliver(job, exc=job.shed)
        return [job for job in jobs if job.shed is None]

    def _pick(self, first: Job) -> list[Job]:
        """The jobs of the batch that ``first``, the oldest queued job, heads (the module
        doc): its group's jobs in arrival order while they fit; with :attr:`by_budget` and
        more of them queued than fit, ``first``'s budget's jobs among those queued ahead
        of the first deadline job, when they make at least half a batch."""
        same = [j for j in self._queue if j.group == first.group]
        fifo = _fill(same, self.max_batch_rows)
        if not self.by_budget or len(fifo) == len(same) or first.due is not None:
            return fifo
        ahead = []
        for job in same:
            if job.due is not None:  # reordered jobs never pass a deadline job
                break
            if job.budget == first.budget:
                ahead.append(job)
        pure = _fill(ahead, self.max_batch_rows)
        return pure if 2 * sum(j.rows for j in pure) >= self.max_batch_rows else fifo

    def _work(self) -> None:
        if self.nice and sys.platform.startswith("linux"):  # a thread's own priority
            tid = threading.get_native_id()
            try:
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid)
                               + self.nice)
            except OSError:  # not allowed here (a sandbox): the same priority, still correct
                pass
        while True:
            batch = self._take()
            if batch is None:
                return
            live = []
            for job in batch:
                if job.cancelled or (job.future is not None and job.future.done()):
                    self.metrics.cancelled.labels(job.endpoint).inc()
                else:
                    live.append(job)
            try:
                if live:
                    self._run(live)
            finally:
                with self._cond:
                    start, predicted, _ = self._running or (0.0, 0.0, 0)
                    if live and predicted > 0:
                        ratio = 1000.0 * (time.perf_counter() - start) / predicted
                        self._update_scale(ratio, rows=sum(j.rows for j in live))
                    self._running = None

    @property
    def scale(self) -> float:
        """The moving average of every batch's real ÷ estimated time
        (:attr:`BatchScales.overall`)."""
        return self.scales.overall.value

    def scale_at(self, rows: int) -> float:
        """:attr:`scale` for a batch of ``rows`` lines: its size class's own with
        ``scale_by_size``, once the class has run :attr:`BatchScales.CLASS_MIN` batches."""
        return self.scales.at(rows)

    @property
    def typical_scale(self) -> float:
        """The median of the last :attr:`BatchScales.WINDOW` batches' real ÷ estimated
        times (:attr:`scale` until :attr:`BatchScales.TYPICAL_MIN` have run): how long a
        batch typically runs against its estimate, unmoved by the outliers the moving
        average carries. A job predicted late at this scale is more likely late than not:
        what the deadline policy sheds."""
        with self._cond:
            return self.scales.overall.typical

    def typical_at(self, rows: int) -> float:
        """:attr:`typical_scale` for a batch of ``rows`` lines, as :meth:`scale_at`."""
        with self._cond:
            return self.scales.typical_at(rows)

    def _update_scale(self, ratio: float, weight: float = SCALE_WEIGHT,
                      rows: int | None = None) -> None:
        """One more batch (of ``rows`` lines; None: a continuous decode's line, of no size
        class) ran ``ratio`` times its estimate. The moving average weighs the k-th batch
        ``max(weight, 1 / k)``: the first batches set the scale at once (a fresh server
        does not plan its first seconds at a scale of 1), later ones move it by ``weight``
        (:data:`SCALE_WEIGHT`; less for a line of a continuous decode, :meth:`row_end`)."""
        self.scales.update(ratio, rows, weight)

    def _run(self, batch: list[Job]) -> None:
        now = time.perf_counter()
        rows = sum(j.rows for j in batch)
        for job in batch:
            job.started, job.batch_rows = now, rows
        endpoint = batch[0].endpoint
        self.metrics.batch_rows.labels(endpoint).observe(rows)
        self.metrics.batch_budgets.labels(endpoint).observe(
            len({j.budget for j in batch}))
        fed: list[Job] = []  # jobs a feeding run took while it ran

        def more(rows: int) -> list[Job]:
            jobs = self.take_more(batch[0].group, rows)
            fed.extend(jobs)
            return jobs

        try:
            results = batch[0].run(batch, more) if batch[0].feeds else batch[0].run(batch)
            if len(results) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} jobs gave {len(results)} results")
            if not all(job.settled for job in fed):
                raise RuntimeError("a feeding batch left jobs it took unanswered")
        except Exception as e:  # the batch's requests get a 500; the next batch runs
            self.metrics.batch_failures.labels(endpoint).inc()
            for job in batch + fed:
                if not job.settled:
                    _deliver(job, exc=e)
            return
        for job, result in zip(batch, results, strict=True):
            if job.settled:  # answered while its batch ran
                continue
            if job.shed is not None:  # it expired while its batch ran
                _deliver(job, exc=job.shed)
            else:
                _deliver(job, result=result)


def _fill(jobs: list[Job], max_rows: int) -> list[Job]:
    """The first of ``jobs`` while their lines fit in ``max_rows`` (the first always)."""
    batch: list[Job] = []
    rows = 0
    for job in jobs:
        if batch and rows + job.rows > max_rows:
            break
        batch.append(job)
        rows += job.rows
    return batch


def _decayed(value: float, when: float, tau_s: float, now: float) -> float:
    """``value`` observed at ``when``, decayed exponentially (time constant ``tau_s``) to
    ``now`` (``time.perf_counter()`` seconds)."""
    return value * math.exp(-(now - when) / tau_s)


def _decay_rank(value: float, when: float, tau_s: float) -> float:
    """A key that orders values observed at different times as :func:`_decayed` orders them
    at any one later time: ``log(value) + when / tau_s`` (the common factor
    ``exp(-now / tau_s)`` ranks nothing), ``-inf`` for 0. So the errors are ranked once, as
    they are observed, and :meth:`LateAnswers.at` reads its quantile without sorting on
    every request."""
    return math.log(value) + when / tau_s if value > 0 else -math.inf


def _deliver(job: Job, result: Any = None, exc: BaseException | None = None) -> None:
    """Hand a result or exception to the job's future, on its event loop."""

    def settle() -> None:
        fut = job.future
        if fut is None or fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    if job.loop is not None and not job.loop.is_closed():
        job.loop.call_soon_threadsafe(settle)
