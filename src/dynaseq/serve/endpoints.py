"""What each task kind serves: a table ``run kind -> endpoints`` (:data:`TASK_ENDPOINTS`).

An :class:`Endpoint` is a path, its request and response models and three functions:
``plan`` (on the event loop: check the request, choose its budget, build the
:class:`~dynaseq.serve.batcher.Job`), ``run`` (in the worker thread: one batch of jobs ->
one result per job) and ``answer`` (result -> response body). The app adds a route per
entry of its run's kind, so a task is served by adding its row here.

Translation (``POST /v1/translate``) batches every request's lines together, each line at
its request's budget (per-row control ids and calibrated offsets:
:meth:`Translator.control_for`); so does classification (``POST /v1/classify``: one
encoder budget per request, per-row controls from
:func:`~dynaseq.tasks.encoder.budget.control_for`; a pair task takes two tab-separated
sentences per line, as :meth:`Classifier.classify`). Both take ``deadline_ms`` where the
run has a latency table (``dynaseq profile RUN --latency-table``): the deadline policy
chooses the budget on arrival (:func:`plan_deadline`) and again when the batch is taken
(:func:`replan_budgets`). Language models run one request at a time (they have no budget
knob).

A budget that ran is a tuple with one fraction per budgeted part (:data:`BudgetParts`):
``(encoder, decoder)`` for translation, ``(encoder,)`` for classification; responses give
a pair as a list and a single fraction as a number (:func:`budget_json`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel

from dynaseq.core.arguments import check_text
from dynaseq.core.errors import DynaseqError
from dynaseq.data import collate_source
from dynaseq.data.tokenizer import with_subwords
from dynaseq.metrics.latency_table import Pair
from dynaseq.models.search import RowCount, Sentences, refilled_greedy_search
from dynaseq.nn.outputs import AuxOutputs
from dynaseq.serve import schemas
from dynaseq.serve.batcher import BudgetParts, Job, Shed
from dynaseq.serve.compute import (
    CountedRows,
    all_open_reports,
    counts_while_decoding,
    encoder_compute_per_row,
    realized_per_row,
)
from dynaseq.serve.scales import Scale, scale_at
from dynaseq.tasks.classify.data import Row
from dynaseq.tasks.classify.predictor import RealizedCompute
from dynaseq.tasks.encoder.budget import exit_for
from dynaseq.tasks.translation.predictor import (
    LinesDone,
    budget_pair,
    control_rows,
    decode_corpus,
    one_budget,
)
from dynaseq.techniques.cct.gating import BudgetControl, every_gate_open

if TYPE_CHECKING:
    from dynaseq.serve.app import ServeState


class TooLarge(DynaseqError):
    """A request over a size limit (413)."""


class Overloaded(DynaseqError):
    """No budget meets the deadline, or the queue is full (503 with ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Endpoint:
    """One route of a task kind (see the module doc)."""

    path: str
    name: str
    request: type[BaseModel]
    response: type[BaseModel]
    plan: Callable[[ServeState, Any], Job]
    answer: Callable[[ServeState, Any, Job, Any], dict[str, Any]]
    summary: str
    realized: bool = False  # its answers carry each line's realized compute (metrics)
    warm: Callable[[ServeState], None] | None = None  # run once before the server is ready


def check_lines(state: ServeState, lines: list[str]) -> None:
    """The per-request line limits (413), and text every endpoint can read (422: a lone
    surrogate has no UTF-8 form)."""
    check_text(lines)
    cfg = state.config
    if len(lines) > cfg.max_lines:
        raise TooLarge(f"{len(lines)} lines in one request; the limit is {cfg.max_lines}")
    for i, line in enumerate(lines, start=1):  # counted from 1, as check_text counts
        if len(line) > cfg.max_line_chars:
            raise TooLarge(f"line {i} has {len(line)} characters; the limit is "
                           f"{cfg.max_line_chars}")
        if "\n" in line or "\r" in line:
            raise DynaseqError(f"line {i} holds a line break: send each line as its own "
                               'entry of "texts"')


def _check_tokens(state: ServeState, n_tokens: int) -> None:
    if n_tokens > state.config.max_tokens:
        raise TooLarge(f"{n_tokens} tokens in one request; the limit is "
                       f"{state.config.max_tokens}")


# -- translation --------------------------------------------------------------------------

@dataclass(frozen=True)
class TranslateWork:
    lines: list[str]
    ids: list[list[int]]  # each line's subwords, encoded once by the plan; the batch reuses them
    budget: Budget | None  # what Translator.control_for takes for every line
    pair: Pair | None  # the (encoder, decoder) budget that runs (None: dense model)
    degraded: bool


Budget = float | tuple[float, float]

def _plan_translate(state: ServeState, req: schemas.TranslateRequest) -> Job:
    t = state.predictor
    lines = req.lines
    check_lines(state, lines)
    ids = t.tokenizer.encode(lines)
    _check_tokens(state, sum(len(x) for x in ids))
    length = max((len(x) for x in ids), default=0) + 1
    d = plan_deadline(state, req.deadline_ms, len(lines), length)
    budget = (req.budget_value if req.budget is not None else state.default_budget
              ) if d.budget is None else d.budget
    pair = state.budget_ran(budget)  # DynaseqError (422) for an untrained budget
    work = TranslateWork(lines, ids, budget, pair, d.degraded)
    return Job(group=("translate", state.beam), run=state.run_translate, payload=work,
               rows=len(lines), length=length, budget=pair, endpoint="translate",
               feeds=state.config.continuous,
               deadline_ms=req.deadline_ms, **d.job_fields(state, pair, len(lines), length),
               replan=None if req.deadline_ms is None else partial(
                   replan_rows if state.config.continuous else replan_budgets, state,
                   rebudget=_rebudget_translate))


@dataclass(frozen=True)
class DeadlinePlan:
    """What a request's arrival decided (:func:`plan_deadline`): the budget the deadline
    policy chose (None: the request gave no deadline, the server has no policy, or the
    model is dense), whether it is degraded, and the queue it was planned against (None
    without a policy)."""

    budget: tuple[float, ...] | None
    degraded: bool
    load: Any

    def job_fields(self, state: ServeState, ran: tuple[float, ...] | None, rows: int,
                   length: int) -> dict[str, Any]:
        """The Job's ``predicted_ms`` (completion at the budget that runs, where the table
        has it) and ``plan`` (what it was planned with), for the access log."""
        load = self.load
        if load is None:
            return {"predicted_ms": None, "plan": None}
        key = ran or state.policy.largest  # a dense model: its one row
        predicted = (None if not state.policy.table.has(key)
                     else state.policy.predicted(load, key, rows, length))
        return {"predicted_ms": predicted,
                "plan": {"margin_ms": round(load.overhead_ms, 1), "scale": round(load.scale, 3),
                         "ahead_lines": sum(w.rows for w in load.ahead)}}


def plan_deadline(state: ServeState, deadline_ms: float | None, rows: int,
                  length: int) -> DeadlinePlan:
    """A request of ``rows`` lines, the longest ``length`` tokens, on arrival: with a
    ``deadline_ms``, the largest budget the policy predicts in time against the queue now
    (503 :class:`Overloaded` when none is; 422 without a latency table)."""
    if deadline_ms is not None and state.policy is None:
        raise DynaseqError("deadline_ms needs the run's latency table (dynaseq profile "
                           "RUN --latency-table), which this server has not loaded")
    load = state.batcher.snapshot() if state.policy is not None else None
    if deadline_ms is None:
        return DeadlinePlan(None, False, load)
    d = state.policy.plan(load, deadline_ms, rows, length)
    if d.reject:
        raise Overloaded(f"no budget can answer within {deadline_ms:g} ms now "
                         f"(predicted {d.predicted_ms:.0f} ms at the smallest)",
                         d.retry_after_s)
    # a dense model's table has one row, (1, 1) or (1,), which is no budget it takes
    return DeadlinePlan(d.budget if state.budgets else None, d.degraded, load)


def _rebudget_translate(job: Job, budget: tuple[float, ...], degraded: bool) -> None:
    job.payload = replace(job.payload, budget=budget, pair=budget, degraded=degraded)


def replan_budgets(state: ServeState, jobs: list[Job], scale: Scale, behind: list[Job], *,
                   rebudget: Callable[[Job, tuple[float, ...], bool], None]) -> None:
    """A batch is about to run (in the batcher's thread): its deadline jobs that can no
    longer answer in time even at the smallest budget are shed (503, with the
    ``"reject"`` overload policy: :meth:`~dynaseq.serve.policy.DeadlinePolicy.late`); the
    others all take the budget :meth:`~dynaseq.serve.policy.DeadlinePolicy.batch_budget`
    chooses for the time left to each of them and to the jobs of their kind queued
    ``behind`` (the event loop's lag and the margin that admission planned with kept
    aside); ``rebudget(job, budget, degraded)`` sets a job's payload to the new budget.
    ``scale``: the batcher's factor, one or per batch size (the batch's own for shedding)."""
    policy = state.policy
    flexible = [j for j in jobs if j.due is not None and j.budget is not None]
    if policy is None or not flexible:
        return
    now = time.perf_counter()
    batcher = state.batcher
    # kept aside from each line's time left: the loop's lag and a margin for error, the
    # admission one for the lines behind (planned on arrival), per mode for the batch's own
    behind_ms = batcher.loop_lag_ms + batcher.overhead_ms
    mode = state.config.batch_margin
    if mode == "admission":
        own_ms = behind_ms
    elif mode == "formation":
        own_ms = batcher.loop_lag_ms + batcher.formation_ms
    else:  # "risk": no margin; the batch's budget weighs each line's chance of being late
        own_ms = batcher.loop_lag_ms

    def left(j: Job, aside_ms: float) -> float | None:
        return None if j.due is None else 1000.0 * (j.due - now) - aside_ms

    fixed = [j.work(policy.largest) for j in jobs if j not in flexible]
    if policy.overload == "reject":  # drop what a typical batch would answer late (by
        # ``due``, slack x the deadline: shedding by the deadline itself kept more requests
        # that then answered late, 84% of the accepted in time at 4x load against 91%)
        raw = [1000.0 * (j.due - now) - state.batcher.loop_lag_ms for j in flexible]
        lines = sum(j.rows for j in jobs)
        late = policy.late(fixed, [j.work() for j in flexible], raw,
                           min(scale_at(scale, lines), state.batcher.typical_at(lines)))
        for j, is_late in zip(flexible, late, strict=True):
            if is_late:
                j.shed = Shed(f"the deadline of {j.deadline_ms:g} ms can no longer be met "
                              "(the queue ran longer than predicted)",
                              policy.retry_after_min_s)
        flexible = [j for j in flexible if j.shed is None]
        if not flexible:
            return
    queued = [(j.work(policy.largest), left(j, behind_ms)) for j in behind
              if j.group == jobs[0].group]
    budget = policy.batch_budget(fixed, [j.work() for j in flexible],
                                 [left(j, own_ms) for j in flexible], scale, queued,
                                 late_share=(batcher.formation_late_share if mode == "risk"
                                             else None),
                                 arrival_rate=batcher.arrival_rate,
                                 max_utilization=state.config.max_utilization,
                                 arrival_length=batcher.arrival_length)
    for j in flexible:
        if j.budget != budget:
            j.budget = budget
            rebudget(j, budget, budget != policy.largest)
    answers = policy.answer_ms([*fixed, *(j.work() for j in flexible)],
                               [j.length for j in flexible], scale)
    for j, ms in zip(flexible, answers, strict=True):
        j.formed_due = now + ms / 1000.0
        if j.plan is not None:  # for the access log
            j.plan["batch_margin_ms"] = round(own_ms, 1)


def replan_rows(state: ServeState, jobs: list[Job], scale: float, behind: list[Job], *,
                rebudget: Callable[[Job, tuple[float, ...], bool], None]) -> None:
    """Jobs a continuous decode takes off the queue (in the batcher's thread, in the order
    they will take rows; ``behind``: the jobs still queued, not read: a line's budget holds
    up only its own row), planned against the decode's rows now
    (:meth:`~dynaseq.serve.batcher.Batcher.rows_now`) and the jobs before them: each
    deadline job that cannot answer in time even at the fastest budget (no margin, at the
    typical scale) is shed (503, with the ``"reject"`` overload policy); the others take
    the largest budget whose completion fits the time left to their due answer less the
    loop's lag and the formation margin
    (:meth:`~dynaseq.serve.row_policy.RowPolicy.row_budget`), with their predicted answer
    (:attr:`~dynaseq.serve.batcher.Job.formed_due`) for the formation margin."""
    policy, batcher = state.policy, state.batcher
    if policy is None or not any(j.due is not None and j.budget is not None for j in jobs):
        return
    now = time.perf_counter()
    lag = batcher.loop_lag_ms
    margin = 0.0 if state.config.batch_margin == "risk" else batcher.formation_ms
    running, waiting = batcher.rows_now()
    waiting = list(waiting)
    for j in jobs:
        if j.due is not None and j.budget is not None:
            left = 1000.0 * (j.due - now) - lag
            typical = min(scale, batcher.typical_scale)
            if policy.overload == "reject" and policy.row_budget(
                    j.rows, j.length, left, running, waiting, typical)[1] > left:
                j.shed = Shed(f"the deadline of {j.deadline_ms:g} ms can no longer be met "
                              "(the queue ran longer than predicted)",
                              policy.retry_after_min_s)
                continue
            budget, done = policy.row_budget(
                j.rows, j.length, left - margin, running, waiting, scale,
                arrival_rate=batcher.arrival_rate,
                max_utilization=state.config.max_utilization,
                arrival_length=batcher.arrival_length)
            if j.budget != budget:
                j.budget = budget
                rebudget(j, budget, budget != policy.largest)
            j.formed_due = now + done / 1000.0
            if j.plan is not None:  # for the access log
                j.plan["batch_margin_ms"] = round(lag + margin, 1)
        waiting += [scale * policy.held_ms(j.budget, j.length,
                                           len(running) + len(waiting) + 1)] * j.rows


def run_translate(t: Any, beam: int, report_compute: bool, jobs: list[Job], *,
                  retry_after_s: int = 1, early: bool = True,
                  all_on: dict[tuple[int, int], dict[str, int]] | None = None
                  ) -> list[tuple[list[str], list[dict | None]]]:
    """One batch: every job's lines decoded together, each at its job's budget, exactly as
    :meth:`Translator.translate` decodes (same search, same settings; a batch of one
    budget as that budget's call, :func:`~dynaseq.tasks.translation.predictor.one_budget`)
    -> per job its translations and each line's realized compute (None for an empty line).

    ``early``: a job is answered (:meth:`~dynaseq.serve.batcher.Job.settle`) as soon as its
    own lines are done, while the batch decodes the others, unless its compute needs a pass
    over the finished batch (beam search with gates that decide: :func:`realized_per_row`).
    A job with :attr:`~dynaseq.serve.batcher.Job.expires` whose lines are still decoding
    then is dropped from the decode (the others go on without it) and marked ``shed``
    (503 with ``Retry-After: retry_after_s``): its answer would be late. ``all_on``: as
    :class:`CountedRows` takes it."""
    lines = [line for job in jobs for line in job.payload.lines]
    owner = [k for k, job in enumerate(jobs) for _ in range(job.rows)]  # line -> its job
    starts = [sum(job.rows for job in jobs[:k]) for k in range(len(jobs))]
    budgets = [job.payload.budget for job in jobs for _ in range(job.rows)]
    d = t.config.decode
    control = t.control_for(budgets, len(lines))
    keep, src = with_subwords([x for job in jobs for x in job.payload.ids])  # as planned
    if isinstance(control, BudgetControl):
        control = control.select(torch.tensor(keep, dtype=torch.long, device=t.device))
    lean = t.lean_decoder()
    needs_pass = report_compute and counts_while_decoding(t.model, control, len(src))
    tally = needs_pass and beam == 1 and lean is not None
    per_line = tally or not needs_pass  # each line's compute is known when it finishes
    early = early and per_line
    texts = [""] * len(lines)
    compute: list[dict | None] = [None] * len(lines)
    left = [job.rows for job in jobs]  # lines of each job not yet done
    for i in set(range(len(lines))) - set(keep):  # an empty line is done
        left[owner[i]] -= 1

    def result(k: int) -> tuple[list[str], list[dict | None]]:
        a = starts[k]
        return texts[a: a + jobs[k].rows], compute[a: a + jobs[k].rows]

    counters: dict[int, CountedRows] = {}  # per decoded batch (budget_batches), made once

    def on_done(done: LinesDone) -> None:  # lines finished while the batch decodes
        if not report_compute:
            reports: list[dict | None] = [None] * len(done.idx)
        elif done.counted is not None:
            aux, counts = done.counted
            counter = counters.get(done.batch)
            if counter is None:
                counter = counters[done.batch] = CountedRows(t.model, done.src, aux, all_on)
            reports = counter.reports(counts, done.rows)
        else:  # every gate open, or no gates: the lengths tell
            rows = control_rows(control, len(src), done.idx, t.device)
            if t.model.n_controls and every_gate_open(rows, len(done.idx)):
                reports = all_open_reports(t.model, [src[j] for j in done.idx], done.tokens,
                                           all_on)
            else:
                reports = realized_per_row(t.model, [src[j] for j in done.idx], done.tokens,
                                           rows)
        for j, text, rep in zip(done.idx, t.tokenizer.decode(done.tokens), reports,
                                strict=True):
            texts[keep[j]], compute[keep[j]] = text, rep
            left[owner[keep[j]]] -= 1
        if early:
            for k in {owner[keep[j]] for j in done.idx}:
                if left[k] == 0:
                    jobs[k].settle(result(k))

    if early:
        for k, job in enumerate(jobs):
            if left[k] == 0:  # only empty lines
                job.settle(result(k))
    expires = [job.expiry for job in jobs for _ in range(job.rows)]  # read at every step
    hyps = decode_corpus(t.model, src, beam=beam, length_penalty=d.length_penalty,
                         max_len_a=d.max_len_a, max_len_b=d.max_len_b,
                         batch_size=max(len(src), 1), device=t.device, control=control,
                         lean=lean, on_batch=_counted_as_lines_finish if tally else None,
                         expires=[expires[i] for i in keep],
                         on_done=on_done if per_line else None)
    for j, h in enumerate(hyps):
        job = jobs[owner[keep[j]]]
        if h is None and not job.cancelled:  # expired while decoding: a 503, others answer
            job.shed = Shed(f"the deadline of {job.deadline_ms:g} ms passed while the "
                            "batch was decoding", retry_after_s)
    if not per_line:  # beam search with gates that decide: one pass over what finished
        done = [j for j, h in enumerate(hyps) if h is not None]
        for j, text in zip(done, t.tokenizer.decode([hyps[j] for j in done]), strict=True):
            texts[keep[j]] = text
        if done:
            rows = control_rows(control, len(src), done, t.device)
            per_row = realized_per_row(t.model, [src[j] for j in done],
                                       [hyps[j] for j in done], rows)
            for j, c in zip(done, per_row, strict=True):
                compute[keep[j]] = c
    return [result(k) for k in range(len(jobs))]


def run_translate_continuous(t: Any, report_compute: bool, jobs: list[Job],
                             more: Callable[[int], list[Job]], *, max_rows: int = 32,
                             all_on: dict[tuple[int, int], dict[str, int]] | None = None,
                             clock: Any = None,
                             line_ms: Callable[[tuple[float, ...] | None, int], float]
                             | None = None,
                             retry_after_s: int = 1) -> list[None]:
    """Continuous batching (``dynaseq serve --continuous``): ``jobs`` and every job
    ``more(rows)`` hands over while they decode, line by line through one greedy decode of
    ``max_rows`` rows whose finished lines' rows new lines take over
    (:func:`~dynaseq.models.search.refilled_greedy_search`), each line at its job's budget.
    Each job is answered (:meth:`~dynaseq.serve.batcher.Job.settle`) as soon as its own
    lines are done, with its translations, exactly as :meth:`Translator.translate`
    decodes them (greedy), and each line's realized compute: from the lengths where every
    gate was open, else from what the decode counted for the line (``on_counted``:
    :class:`~dynaseq.serve.compute.CountedRows` over its group's encoder records), as the
    batch server's greedy batches report it. The decode ends when no line runs
    and ``more`` has nothing. Returns one ``None`` per job of ``jobs`` (all answered).

    A client that went away before its job joined is dropped (:meth:`Batcher.take_more`);
    the lines of one whose job waits or runs leave the decode at its next step
    (:meth:`~dynaseq.serve.batcher.Job.expiry`), as do those of a job whose deadline
    passes (:attr:`~dynaseq.serve.batcher.Job.expires`), which gets a 503 (``Shed``, with
    ``Retry-After: retry_after_s``) instead of an answer. ``clock``: told when each line
    is taken to wait for a row, takes it and leaves it
    (:meth:`~dynaseq.serve.batcher.Batcher.row_wait`, ``row_begin``, ``row_end``), with
    the time ``line_ms(budget, length)`` predicts it holds its row (the deadline policy's
    rows; both None: not told)."""
    lean = t.lean_decoder()
    assert lean is not None, "continuous decoding runs through the lean decoder"
    d, device = t.config.decode, t.device
    pending: list[tuple[Job, int, list[int]]] = []  # lines waiting: (job, line, subwords)
    open_jobs: dict[int, dict[str, Any]] = {}  # id(job) -> its texts, compute, lines left
    count = report_compute and t.model.n_controls > 0  # gates decide: count as it decodes
    timed = clock is not None and line_ms is not None  # the batcher keeps a clock of rows
    counters: dict[int, tuple[AuxOutputs, CountedRows]] = {}  # per encoded group, recent

    def admit(new: list[Job]) -> None:
        for job in new:
            ids = job.payload.ids
            entry = {"job": job, "texts": [""] * job.rows, "compute": [None] * job.rows,
                     "tokens": {}, "counted": {}, "left": sum(1 for x in ids if x)}
            open_jobs[id(job)] = entry
            pending.extend((job, i, x) for i, x in enumerate(ids) if x)
            if not entry["left"]:  # only empty lines
                finish(entry)

    def refill(limit: int) -> Sentences | None:
        if not pending:
            admit(more(limit))
        take, pending[:limit] = pending[:limit], []
        if not take:
            return None
        if timed:
            for job, i, x in take:
                clock.row_wait((id(job), i), line_ms(job.budget, len(x) + 1))
        src = collate_source([x for _, _, x in take], t.model.pad_id, t.model.eos_id)
        budgets = [job.payload.budget for job, _, _ in take]
        control = one_budget(t.control_for(budgets, len(take)))
        return Sentences([(id(job), i) for job, i, _ in take], src.to(device), control,
                         expires=[job.expiry for job, _, _ in take])  # -inf: client gone

    def done(key: tuple[int, int], tokens: list[int] | None,
             counted: RowCount | None = None) -> None:
        entry = open_jobs[key[0]]
        if timed:
            clock.row_end(key, finished=tokens is not None)
        if tokens is not None:  # None: its client went away or its deadline passed
            entry["tokens"][key[1]] = tokens
            entry["counted"][key[1]] = counted
        elif not entry["job"].cancelled:
            entry["late"] = True
        entry["left"] -= 1
        if not entry["left"]:
            finish(entry)

    def counted_report(counted: RowCount | None) -> dict:
        """A line's compute from what its decode counted (its group's encoder records)."""
        assert counted is not None, "a gated line of a counted decode"
        held = counters.get(id(counted.aux))
        if held is None or held[0] is not counted.aux:  # new group (or a reused id)
            if len(counters) >= 64:
                del counters[next(iter(counters))]
            held = counters[id(counted.aux)] = (counted.aux, CountedRows(
                t.model, counted.src, counted.aux, all_on))
        return held[1].reports(counted.counts, [counted.row], at=[0])[0]

    def finish(entry: dict[str, Any]) -> None:
        job, got = entry["job"], entry["tokens"]
        if entry.get("late"):  # a line expired at its deadline: no late answer
            del open_jobs[id(job)]
            job.refuse(Shed(f"the deadline of {job.deadline_ms:g} ms passed while its "
                            "lines were decoding", retry_after_s))
            return
        lines = sorted(got)
        hyps = [got[i] for i in lines]
        for i, text in zip(lines, t.tokenizer.decode(hyps), strict=True):
            entry["texts"][i] = text
        if report_compute and lines:
            srcs = [job.payload.ids[i] for i in lines]
            control = t.control_for(job.payload.budget, len(lines))
            if not t.model.n_controls or every_gate_open(control, len(lines)):
                reports = all_open_reports(t.model, srcs, hyps, all_on)  # the lengths tell
            else:
                reports = [counted_report(entry["counted"][i]) for i in lines]
            for i, rep in zip(lines, reports, strict=True):
                entry["compute"][i] = rep
        del open_jobs[id(job)]
        job.settle((entry["texts"], entry["compute"]))

    admit(jobs)
    refilled_greedy_search(lean, refill, done, max_rows=max_rows, max_len_a=d.max_len_a,
                           max_len_b=d.max_len_b,
                           max_positions=t.model.encoder.positions.max_positions,
                           on_counted=done if count else None,
                           on_start=(lambda keys: [clock.row_begin(k) for k in keys])
                           if timed else None)
    assert not open_jobs and not pending, "every job answered"
    return [None] * len(jobs)


def _counted_as_lines_finish(idx: list[int], src: torch.Tensor, aux: AuxOutputs,
                             counts: dict[str, torch.Tensor]) -> None:
    """``on_batch`` of a decode that counts what it runs: each line's compute is formed
    from the counts when it finishes (``on_done``), so nothing is left for the batch's
    end."""


def _answer_translate(state: ServeState, req: schemas.TranslateRequest, job: Job,
                      result: Any) -> dict[str, Any]:
    texts, compute = result
    work: TranslateWork = job.payload
    body: dict[str, Any] = {"budget": None if work.pair is None else list(work.pair),
                            "degraded": work.degraded}
    if req.text is not None:
        body.update(translation=texts[0], compute=compute[0])
    else:
        body.update(translations=texts, compute=compute)
    return body


# -- classification -----------------------------------------------------------------------

@dataclass(frozen=True)
class ClassifyWork:
    """One classify request: its non-empty lines as model input (``rows``, from
    :meth:`Classifier.encode`), their indices among the request's lines (``keep``), the
    budget each row runs at (what :meth:`Classifier.classify_rows` takes) and the fraction
    that runs (None: a dense model); ``gamma``: the exit threshold of an adaptive-depth
    model (None: it has none)."""

    rows: list[Row]
    keep: list[int]
    budget: float | None
    ran: float | None
    gamma: float | None = None
    degraded: bool = False


def _plan_classify(state: ServeState, req: schemas.ClassifyRequest) -> Job:
    c = state.predictor
    check_lines(state, req.lines)
    exit = exit_for(c.config.model, req.gamma)  # 422: no predictor, γ not in (0, 1)
    rows, keep = c.encode(req.lines)  # DynaseqError (422): a wrong number of tab fields
    _check_tokens(state, sum(len(ids) for ids, _ in rows))
    length = max((len(ids) for ids, _ in rows), default=1)
    d = plan_deadline(state, req.deadline_ms, len(req.lines), length)
    budget = (req.budget if req.budget is not None else state.default_budget
              ) if d.budget is None else d.budget[0]
    ran = state.budget_ran(budget)  # DynaseqError (422): dense, untrained, not in (0, 1]
    work = ClassifyWork(rows, keep, budget, None if ran is None else ran[0],
                        None if exit is None else float(exit.gamma), d.degraded)
    return Job(group=("classify",), run=state.run_classify, payload=work,
               rows=len(req.lines), length=length, budget=ran, endpoint="classify",
               deadline_ms=req.deadline_ms, **d.job_fields(state, ran, len(req.lines), length),
               replan=None if req.deadline_ms is None else partial(
                   replan_budgets, state, rebudget=_rebudget_classify))


def _rebudget_classify(job: Job, budget: tuple[float, ...], degraded: bool) -> None:
    job.payload = replace(job.payload, budget=budget[0], ran=budget[0], degraded=degraded)


def run_classify(c: Any, report_compute: bool, jobs: list[Job]
                 ) -> list[tuple[list[str | float | None], list[dict | None],
                                 list[int | None] | None]]:
    """One batch: every job's rows classified together, each at its job's budget (per-row
    control ids and calibrated offsets) and exit threshold (per-row γ of an adaptive-depth
    model), exactly as :meth:`Classifier.classify` does -> per job a label (or score) per
    line, each line's realized compute (None for an empty line, or every line with
    ``report_compute`` off) and, for an adaptive-depth model, the layers each line ran."""
    rows: list[Row] = []
    budgets: list[float | None] = []
    gammas: list[float] = []
    for job in jobs:
        rows.extend(job.payload.rows)
        budgets.extend([job.payload.budget] * len(job.payload.rows))
        gammas.extend([job.payload.gamma] * len(job.payload.rows))
    cct = c.config.model.cct is not None
    depth = c.config.model.depth is not None
    realized = RealizedCompute() if (report_compute and cct) or depth else None
    values = c.classify_rows(rows, budgets, batch_size=max(len(rows), 1), compute=realized,
                             gamma=gammas if depth else None)
    compute: list[dict | None] = [None] * len(rows)
    if report_compute:
        compute = list(encoder_compute_per_row(
            c.model, rows, realized if cct else None,
            realized.row_layers if depth and not cct else None))
    out, start = [], 0
    for job in jobs:
        work: ClassifyWork = job.payload
        labels: list[str | float | None] = [None] * job.rows
        computes: list[dict | None] = [None] * job.rows
        layers: list[int | None] = [None] * job.rows
        for k, i in enumerate(work.keep):
            labels[i], computes[i] = values[start + k], compute[start + k]
            if depth:
                layers[i] = int(realized.row_layers[start + k])
        out.append((labels, computes, layers if depth else None))
        start += len(work.rows)
    return out


def _answer_classify(state: ServeState, req: schemas.ClassifyRequest, job: Job,
                     result: Any) -> dict[str, Any]:
    labels, compute, layers = result
    body: dict[str, Any] = {"budget": job.payload.ran, "degraded": job.payload.degraded,
                            "gamma": job.payload.gamma}
    if req.text is not None:
        body.update(label=labels[0], compute=compute[0],
                    layers=None if layers is None else layers[0])
    else:
        body.update(labels=labels, compute=compute, layers=layers)
    return body


# -- language models ----------------------------------------------------------------------

def _no_knob(req: schemas._Budgeted) -> None:
    if req.budget is not None:
        raise DynaseqError("a language model has no compute-budget knob: leave out "
                           '"budget"')
    if req.deadline_ms is not None:
        raise DynaseqError("a language model has no budgets to choose from: leave out "
                           '"deadline_ms"')


def _plan_generate(state: ServeState, req: schemas.GenerateRequest) -> Job:
    _no_knob(req)
    check_lines(state, req.lines)
    if req.tokens > state.config.max_generate_tokens:
        raise TooLarge(f"tokens={req.tokens}; the limit is {state.config.max_generate_tokens}")
    _check_tokens(state, sum(len(x.split()) + 1 for x in req.lines))
    return Job(group=None, run=state.run_generate, payload=req, rows=len(req.lines),
               length=1, endpoint="generate")


def run_generate(lm: Any, jobs: list[Job]) -> list[list[str]]:
    """One request (a language model's batches hold one job): each prompt continued, as
    ``LanguageModel.generate`` (``dynaseq generate``) does. A job whose client went away
    (:meth:`Job.cancel`) stops at its next word: a disconnect costs one more word, not the
    request's other words and prompts (32 prompts of 512 tokens held the worker for
    ~100 s, ~55 s after the client had gone)."""
    out = []
    for job in jobs:
        r: schemas.GenerateRequest = job.payload
        texts: list[str] = []
        for p in r.lines:
            if job.cancelled:  # nobody reads the rest
                break
            texts.append(lm.generate(p or None, r.tokens, r.temperature, r.seed, r.top_k,
                                     stop=lambda job=job: job.cancelled))
        out.append(texts)
    return out


def lm_compute(lm: Any) -> dict[str, Any]:
    """A language model's compute per generated token (dense: everything runs)."""
    from dynaseq.metrics.lm_profile import lm_macs_per_token

    macs = {k: float(v) for k, v in lm_macs_per_token(lm.model).items()}
    return {"fraction": {"total": 1.0}, "macs_per_token": macs}


def _answer_generate(state: ServeState, req: schemas.GenerateRequest, job: Job,
                     result: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"budget": None, "compute": state.lm_compute}
    if req.text is not None:
        body["text"] = result[0]
    else:
        body["texts"] = result
    return body


def _plan_score(state: ServeState, req: schemas.ScoreRequest) -> Job:
    _no_knob(req)
    check_lines(state, req.lines)
    _check_tokens(state, sum(len(x.split()) + 2 for x in req.lines))
    return Job(group=None, run=state.run_score, payload=req, rows=len(req.lines), length=1,
               endpoint="score")


def run_score(lm: Any, jobs: list[Job]) -> list[list[dict]]:
    """Each line's loss and perplexity: its words and end of line after a line start
    (``<eos>``), i.e. what ``LanguageModel.evaluate`` gives for a file holding an empty
    line and then this line (batch size 1)."""
    from dynaseq.tasks.lm.predictor import evaluate_stream

    out = []
    for job in jobs:
        scores = []
        for line in job.payload.lines:
            ids = lm.vocab.encode_lines(["", line])
            r = evaluate_stream(lm.model, ids, 1, lm.config.model.extended_context, lm.device)
            scores.append({"loss": r["loss"], "ppl": r["ppl"], "tokens": r["tokens"]})
        out.append(scores)
    return out


def _answer_score(state: ServeState, req: schemas.ScoreRequest, job: Job,
                  result: Any) -> dict[str, Any]:
    if req.text is not None:
        return {"budget": None, "score": result[0]}
    return {"budget": None, "scores": result}


def warm_translate(state: ServeState) -> None:
    """Translate one short line at each budget the server runs (the default when it has
    none), as its batches will (lean decoder prepared, first allocations made), before it
    reports ready: otherwise the first requests pay for that (~90 ms against ~35 here) and
    their errors enter the deadline policy's margin."""
    t = state.predictor
    for budget in state.budgets or [None]:
        t.translate(["a ."], beam=state.beam, budget=None if budget is None else [budget])


def warm_classify(state: ServeState) -> None:
    """Classify one short line (a pair for a pair task) at each budget the server runs (the
    default when it has none) before it reports ready, as :func:`warm_translate` does: the
    first request otherwise pays for the lean encoder's preparation and first allocations
    (SST-2 CCT-BERT, one thread: 17 ms against 6 for the next). It runs the plain
    :meth:`classify`: the realized-compute count and an adaptive-depth exit, which batches
    add, are not warmed."""
    c = state.predictor
    line = ("a", "a") if c.layout.is_pair else "a"
    for budget in state.budgets or [None]:
        c.classify([line], budget=None if budget is None else budget[0])


TRANSLATE = Endpoint("/v1/translate", "translate", schemas.TranslateRequest,
                     schemas.TranslateResponse, _plan_translate, _answer_translate,
                     "Translate one line or several, at a budget or within a deadline",
                     realized=True, warm=warm_translate)
GENERATE = Endpoint("/v1/generate", "generate", schemas.GenerateRequest,
                    schemas.GenerateResponse, _plan_generate, _answer_generate,
                    "Continue one prompt or several")
SCORE = Endpoint("/v1/score", "score", schemas.ScoreRequest, schemas.ScoreResponse,
                 _plan_score, _answer_score, "Loss and perplexity of one line or several")
CLASSIFY = Endpoint("/v1/classify", "classify", schemas.ClassifyRequest,
                    schemas.ClassifyResponse, _plan_classify, _answer_classify,
                    "Label (or score) one line or several, at a budget", realized=True,
                    warm=warm_classify)

#: run kind (:func:`dynaseq.tasks.registry.run_kind`) -> its endpoints.
TASK_ENDPOINTS: dict[str, tuple[Endpoint, ...]] = {
    "seq2seq": (TRANSLATE,),
    "lm": (GENERATE, SCORE),
    "classify": (CLASSIFY,),
}


def budget_ran(predictor: Any, budget: Budget | None) -> Pair | None:
    """The ``(encoder, decoder)`` budget a request's ``budget`` runs at (the calibration's,
    the trained control's, or the largest for None); None for a model without budgets.
    Raises :class:`DynaseqError` naming the trained budgets for one that was not."""
    cct = predictor.config.model.cct
    control, cal = predictor.budget_setting(budget)
    if cct is None:
        return None
    if cal is not None:
        return budget_pair(cal.budget)
    return budget_pair(cct.controls[control])


def classify_budget_ran(predictor: Any, budget: float | None) -> tuple[float] | None:
    """The ``(encoder,)`` budget a classify request's ``budget`` runs at (None for a dense
    encoder); DynaseqError as :meth:`Classifier.budget_ran`."""
    ran = predictor.budget_ran(budget)
    return None if ran is None else (ran,)


#: run kind -> the budget a request's ``budget`` runs at (checked), for the kinds that
#: take one.
BUDGET_RAN: dict[str, Callable[[Any, Any], BudgetParts | None]] = {
    "seq2seq": budget_ran,
    "classify": classify_budget_ran,
}


def budget_label(budget: BudgetParts | None) -> str:
    """A budget as a metrics label: ``"0.5,0.5"``, ``"0.5"``, ``"none"``."""
    return "none" if budget is None else ",".join(f"{x:g}" for x in budget)


def budget_json(budget: BudgetParts) -> float | list[float]:
    """A budget as responses give it: a pair as a list, a single fraction as a number."""
    return budget[0] if len(budget) == 1 else list(budget)

