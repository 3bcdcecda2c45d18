"""Batched greedy and beam search with incremental decoding.

Both encode once, then call ``model.decode_step`` one token at a time; keys/values of earlier
steps live in the decoder state, so step t costs O(t) attention. Finished sentences are
dropped from the batch (their rows are removed from every cache), so a batch costs what its
unfinished sentences need.

A search may also be given each sentence's expiry (``expires``, seconds on ``clock``, e.g. a
server's deadline, or a function giving it at each step, e.g. ``-inf`` once the server's
client has gone): a sentence still decoding when its expiry passes is dropped at the end
of that step like a finished one, and its result is None (its answer would be late, or
nobody would read it).

Models only need ``encode(src, control=None) -> EncoderOutput``, ``init_state()`` (a state
with ``reorder``, ``reorder_self`` and ``reorder_cross`` of batch rows, and optionally
``expand_beams(index, beams)``: the first beam step's ``reorder``, free to let a sentence's
beams share what is the same for all of them),
``decode_step(tokens (B, 1), enc, state) -> logits (B, V)`` and ``bos_id``/``eos_id``.
:func:`refilled_greedy_search` (continuous batching: new sentences take the rows of
finished ones) also needs ``begin``, ``put`` and ``join``
(:class:`~dynaseq.models.lean.LeanDecoder`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from dynaseq.nn.lean_step import StepTally
from dynaseq.nn.outputs import AuxOutputs

Finished = Callable[[list[int], list[list[int]]], None]
"""``on_done(rows, tokens)`` of a search: the sentences (indices into its ``src``) that
finished at one step, and their final tokens (no bos/eos), while the search goes on for
the others (e.g. to answer each request of a batch as soon as its own lines are done)."""

Counted = tuple[AuxOutputs, dict[str, Tensor]]
"""What a greedy decode through a lean decoder counted (:func:`counted_greedy_search`): the
encoder's records and each row's decoding counts (:meth:`StepTally.counts`)."""


def max_lengths(src_lengths: Tensor, max_len_a: float, max_len_b: int, cap: int) -> Tensor:
    """Per-sentence output budget ``a · src_len + b`` (tokens incl. eos), capped at ``cap``
    (reckoned in float64 and capped before the cast, so a huge ``a`` or ``b``, "no limit",
    is the cap rather than a wrapped-around int64)."""
    lengths = (src_lengths.double() * max_len_a).floor_() + float(max_len_b)
    return lengths.clamp_(min=1, max=cap).long()


Expires = float | Callable[[], float]
"""A sentence's expiry: a time on the search's clock (``inf``: never), or a function giving
it at each step (it may move, e.g. to ``-inf`` when nobody waits for the answer any more)."""


class Expiry:
    """Which sentences of a search have run past their expiry.

    expires: one :data:`Expires` per sentence. :meth:`due` reads the clock only while some
    active sentence can expire (an expiry of ``-inf`` needs no clock), and compares per
    sentence only once the earliest has passed.
    """

    def __init__(self, expires: Sequence[Expires], clock: Callable[[], float]) -> None:
        self.expires = [e if callable(e) else float(e) for e in expires]
        self.clock = clock

    def due(self, active: list[int]) -> list[bool] | None:
        """For the sentences ``active`` (original indices): which have expired now (None:
        none has)."""
        return expired_now([self.expires[i] for i in active], self.clock)


def expired_now(expires: Sequence[Expires], clock: Callable[[], float]) -> list[bool] | None:
    """Which of ``expires`` have passed now (None: none has). The clock is read only when
    one can have (an expiry of ``-inf`` needs no clock), and compared per expiry only once
    the earliest has passed."""
    times = [e() if callable(e) else e for e in expires]
    first = min(times, default=math.inf)
    if first == math.inf:
        return None
    now = -math.inf if first == -math.inf else clock()
    if now < first:
        return None
    return [t <= now for t in times]


def _expiry(expires: Sequence[Expires] | None, n: int,
            clock: Callable[[], float]) -> Expiry | None:
    """The search's :class:`Expiry`; None when no sentence can expire (no per-step check)."""
    if expires is None:
        return None
    if len(expires) != n:
        raise ValueError(f"expires needs one time per sentence: {n} sentences, "
                         f"{len(expires)} times")
    if all(not callable(e) and e == math.inf for e in expires):
        return None
    return Expiry(expires, clock)


def _force_eos(logits: Tensor, eos_id: int, rows: Tensor) -> None:
    """In place: rows where ``rows`` is True may only produce eos."""
    if rows.any():
        eos_col = logits[rows, eos_id].clone()
        logits[rows] = float("-inf")
        logits[rows, eos_id] = eos_col


@torch.inference_mode()
def greedy_search(model, src: Tensor, max_len_a: float = 1.2, max_len_b: int = 10,
                  min_len: int = 0, max_positions: int = 1024,
                  control: Tensor | int | None = None, aux: object = None,
                  tally: object = None, expires: Sequence[Expires] | None = None,
                  clock: Callable[[], float] = time.perf_counter,
                  on_done: Finished | None = None) -> list[list[int] | None]:
    """src (B, S) padded with ``model.pad_id`` -> one token list per sentence (no bos/eos);
    None for a sentence that ran past its ``expires`` (see the module doc; ``clock``: the
    time they are read on). ``on_done``: called as sentences finish (:data:`Finished`),
    before the others do.

    ``min_len`` forbids eos before that many tokens (used to time fixed-length outputs).
    ``control``: the compute budget, for models that have one: (B,) control-symbol ids, one
    id, or a :class:`~dynaseq.techniques.cct.gating.BudgetControl` (ids plus per-row calibrated
    gate offsets); rows may differ. It enters at ``encode``; the encoder output carries it
    to every step, and rows dropped or expanded keep theirs.
    ``aux``: an :class:`~dynaseq.nn.outputs.AuxOutputs` the encoder records into;
    ``tally``: a :class:`~dynaseq.nn.lean_step.StepTally` of ``B`` rows that the decoding
    steps count into (a model whose state takes one: a lean decoder).
    """
    enc = model.encode(src, control=control) if aux is None else model.encode(
        src, control=control, aux=aux)
    n = src.size(0)
    limits = max_lengths((~enc.pad_mask).sum(1), max_len_a, max_len_b, max_positions - 1)
    limits = limits.clamp(min=min_len + 1)
    state = model.init_state()
    if tally is not None:
        if not hasattr(state, "tally"):
            raise ValueError("this model's decoding steps keep no tally: decode through "
                             "its lean decoder")
        state.tally = tally
    active = torch.arange(n, device=src.device)  # original row of each active row
    steps = int(limits.max())
    out = torch.full((n, steps), model.pad_id, dtype=torch.long, device=src.device)
    lengths: list[int | None] = [steps] * n  # set when a row finishes (None: expired)
    expiry = _expiry(expires, n, clock)
    tokens = torch.full((n, 1), model.bos_id, dtype=torch.long, device=src.device)
    first_limit = int(limits.min())  # no row is at its length limit before this step
    for step in range(steps):
        logits = model.decode_step(tokens, enc, state)  # (n_active, V)
        if step < min_len:
            logits[:, model.eos_id] = float("-inf")
        if step + 1 >= first_limit:
            _force_eos(logits, model.eos_id, step + 1 >= limits[active])
        nxt = logits.argmax(-1)  # (n_active,)
        out[active, step] = nxt
        done = nxt.eq(model.eos_id)
        n_done = int(done.sum())  # the step's one host sync
        finished = active[done].tolist() if n_done else []
        for row in finished:
            lengths[row] = step
        late = None if expiry is None else expiry.due(active.tolist())
        if late is not None:
            for row, gone in zip(active.tolist(), late, strict=True):
                if gone and lengths[row] == steps:  # still decoding: dropped
                    lengths[row] = None
            done = done | torch.tensor(late, device=done.device)
            n_done = int(done.sum())
        if n_done == active.numel():
            _report(on_done, out, finished, lengths)
            break
        if n_done:
            keep = _kept(done, active.numel() - n_done)
            active, nxt = active[keep], nxt[keep]
            enc = enc.index_select(keep)
            state.reorder(keep)
        _report(on_done, out, finished, lengths)
        tokens = nxt.unsqueeze(1)
    return [None if length is None else row[:length]
            for row, length in zip(out.tolist(), lengths, strict=True)]


def _kept(done: Tensor, n_keep: int) -> Tensor:
    """The ``n_keep`` rows that go on after a step that finished ``done`` ``(B,)``: the
    first ``n_keep`` rows, each finished one among them replaced by one that goes on from
    the rows after them (swap-remove: a lean decoder's caches then copy only the rows that
    moved, in place, :func:`~dynaseq.nn.lean_step.in_place`, instead of every row that
    goes on: at 32 rows of the Multi30k CCT at (0.2, 0.2), dropping rows was up to 15% of a
    served batch's time). The search follows each row by its original index, so the
    order is free."""
    keep = torch.arange(n_keep, device=done.device)
    holes = done[:n_keep].nonzero().squeeze(1)
    if holes.numel():
        keep[holes] = (~done[n_keep:]).nonzero().squeeze(1) + n_keep
    return keep


def _report(on_done: Finished | None, out: Tensor, rows: list[int],
            lengths: list[int | None]) -> None:
    """Hand the rows that finished this step (original indices) and their tokens to
    ``on_done``, after the caches (and a tally) let them go."""
    if on_done is None or not rows:
        return
    tokens = out[torch.tensor(rows, device=out.device)].tolist()
    on_done(rows, [t[: lengths[r]] for r, t in zip(rows, tokens, strict=True)])


@dataclass
class Sentences:
    """Sentences handed to a running :func:`refilled_greedy_search`: ``keys`` (the caller's
    name for each, given back with its tokens), ``src`` ``(n, S)`` padded with ``pad_id``
    and ending in eos, and ``control`` (their budget: as :func:`greedy_search`'s, for these
    rows)."""

    keys: list[Any]
    src: Tensor
    control: Any = None
    expires: Sequence[Expires] | None = None
    """One expiry per sentence (as :func:`greedy_search`'s ``expires``), or None: never."""


@dataclass(frozen=True)
class RowCount:
    """What a counted :func:`refilled_greedy_search` ran for one sentence: the source
    ``src`` ``(n, S)`` and encoder records ``aux`` of the sentences encoded with it, its
    index ``row`` among them, and its decoding steps' counts (``{key: (1, ...)}``, as
    :meth:`StepTally.counts` gives a row's)."""

    src: Tensor
    aux: AuxOutputs
    row: int
    counts: dict[str, Tensor]


Refill = Callable[[int], "Sentences | None"]
"""``refill(limit)``: at most ``limit`` more sentences for a :func:`refilled_greedy_search`
to decode beside the ones it runs, or None (none now: it asks again at a later step; with
no sentence running or waiting, None ends the search)."""


@torch.inference_mode()
def refilled_greedy_search(model, refill: Refill,
                           on_done: Callable[[Any, list[int] | None], None],
                           max_rows: int = 32, min_free: int = 1, max_len_a: float = 1.2,
                           max_len_b: int = 10, min_len: int = 0,
                           max_positions: int = 1024,
                           clock: Callable[[], float] = time.perf_counter,
                           on_counted: Callable[[Any, list[int] | None, RowCount | None],
                                                None] | None = None,
                           on_start: Callable[[list[Any]], None] | None = None) -> None:
    """Greedy search of the sentences ``refill`` hands over, each answered by
    ``on_done(key, tokens)`` (no bos/eos) the step it finishes, with the freed rows filled
    by new sentences while the others go on (continuous batching): every step runs about
    ``max_rows`` rows however long each sentence's output is, where a batch of
    :func:`greedy_search` runs fewer and fewer rows for as many steps as its longest
    output needs. Each sentence gets the tokens :func:`greedy_search` gives it alone (its
    rows attend their own keys only: :meth:`LeanState.join`), up to float rounding.

    ``model``: a decoder that joins sentences to a running decode (``begin``, ``put``,
    ``join``: :class:`~dynaseq.models.lean.LeanDecoder`). ``refill(max_rows)`` is asked
    for up to ``max_rows`` sentences when none is waiting and at least ``min_free`` rows
    are free (or none runs): they are encoded together and their cross-attention keys
    projected once (an encoder pass costs about as much for a few sentences as for many),
    then wait until rows free up; a sentence takes over a finished one's row in place
    (:meth:`~dynaseq.models.lean.LeanDecoder.put`: no other row's cache moves). Rows no
    waiting sentence takes are dropped. Length limits as :func:`greedy_search`'s, per
    sentence. A sentence still decoding when its expiry (:attr:`Sentences.expires`, read on
    ``clock`` at every step) has passed leaves at the end of that step, answered
    ``on_done(key, None)``. ``on_counted``: count what each sentence runs (a lean
    decoder's :class:`StepTally`, the encoder's records) and answer
    ``on_counted(key, tokens, RowCount)`` instead of ``on_done`` (``None, None`` for an
    expired one). ``on_start(keys)``: told the keys of the sentences that take rows, at
    the step whose decoding they join (a server's clock of its rows).
    """
    answer = on_counted if on_counted is not None else partial(_answer, on_done)
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    eos, bos = model.eos_id, model.bos_id
    state = enc = None
    keys: list[Any] = []  # per row: its sentence's key (None: finished, its row free)
    limits: list[int] = []  # per row: its output budget (tokens incl. eos)
    made: list[list[int]] = []  # per row: its tokens so far
    last: list[int] = []  # per row: the token its next step reads
    dues: list[Expires | None] = []  # per row: its sentence's expiry (None: never)
    origin: list[tuple[Any, int] | None] = []  # per row: (its encoding group, its index)
    done: list[int] = []  # rows whose sentences finished at the last step
    waiting: _Waiting | None = None  # sentences encoded and started, not yet in a row
    while True:
        running = len(keys) - len(done)
        free = max_rows - running
        if waiting is None and (free >= min_free or not running):
            new = refill(max_rows)
            if new is not None:
                waiting = _Waiting.of(model, new, max_rows, (max_len_a, max_len_b,
                                                             max_positions, min_len),
                                      counted=on_counted is not None)
        if waiting is not None:  # no row for a sentence nobody waits for any more
            waiting = waiting.without(_expired(waiting.dues, waiting.keys, clock), answer)
        n = 0 if waiting is None else min(free, waiting.rows)
        if n:
            fresh, e, new_keys, new_limits, new_dues, new_from, waiting = waiting.take(n)
            taken, more = done[:n], n - min(n, len(done))
            if state is None:
                state, enc = fresh, e
            else:
                if taken:  # new sentences in the rows of finished ones: no cache moves
                    part, e_part, fresh, e = _split(fresh, e, len(taken))
                    enc = model.put(state, enc, torch.tensor(taken, device=e_part.out.device),
                                    part, e_part)
                if more:
                    enc = model.join(state, enc, fresh, e)
            rows = taken + list(range(len(keys), len(keys) + more))
            keys += [None] * more
            limits += [0] * more
            made += [[] for _ in range(more)]
            last += [bos] * more
            dues += [None] * more
            origin += [None] * more
            for r, key, cap, due, came in zip(rows, new_keys, new_limits, new_dues, new_from,
                                              strict=True):
                keys[r], limits[r], made[r], last[r], dues[r] = key, cap, [], bos, due
                origin[r] = came
            done = done[len(taken):]
            if on_start is not None:
                on_start(list(new_keys))
        if done:  # finished rows no sentence took over: dropped
            keep = [i for i in range(len(keys)) if keys[i] is not None]
            keys, limits, made, last, dues, origin = (
                [x[i] for i in keep] for x in (keys, limits, made, last, dues, origin))
            done = []
            if not keep:
                state = enc = None
                continue
            index = torch.tensor(keep, device=enc.out.device)
            state.reorder(index)
            enc = enc.index_select(index)
        if not keys:
            return
        tokens = torch.tensor(last, device=enc.out.device)[:, None]
        logits = model.decode_step(tokens, enc, state)  # (rows, V)
        early = [i for i, m in enumerate(made) if len(m) < min_len] if min_len else []
        if early:
            logits[torch.tensor(early, device=logits.device), eos] = float("-inf")
        at_limit = [len(m) + 1 >= cap for m, cap in zip(made, limits, strict=True)]
        if any(at_limit):
            _force_eos(logits, eos, torch.tensor(at_limit, device=logits.device))
        last = logits.argmax(-1).tolist()  # the step's one host sync
        for i, t in enumerate(last):
            if t == eos:
                answer(keys[i], made[i], _row_count(state, origin[i], i))
                keys[i] = None
                done.append(i)
            else:
                made[i].append(t)
        for i in _expired(dues, keys, clock):
            answer(keys[i], None, None)
            keys[i] = None
            done.append(i)


def _answer(on_done, key, tokens, count) -> None:
    """An uncounted decode's answer: ``on_done(key, tokens)``."""
    on_done(key, tokens)


def _row_count(state, origin: tuple[Any, int] | None, row: int) -> RowCount | None:
    """Row ``row``'s :class:`RowCount` in a counted decode (None in one that does not
    count)."""
    if origin is None or state.tally is None:
        return None
    group, index = origin
    counts = state.tally.active(torch.tensor([row], device=state.tally.device))
    return RowCount(group.src, group.aux, index, counts)


def _expired(dues: list[Expires | None], keys: list[Any],
             clock: Callable[[], float]) -> list[int]:
    """The running rows (key not None) whose expiry has passed (:func:`expired_now`)."""
    rows = [i for i, due in enumerate(dues) if due is not None and keys[i] is not None]
    due = expired_now([dues[i] for i in rows], clock) if rows else None
    return [] if due is None else [i for i, late in zip(rows, due, strict=True) if late]


@dataclass
class _Waiting:
    """Sentences of a refilled search encoded and started (:meth:`LeanDecoder.begin`),
    waiting for rows: the state of their rows, its spent encoder output, their keys and
    output budgets."""

    state: Any
    enc: Any
    keys: list[Any]
    limits: list[int]
    dues: list[Expires | None]
    origin: list[tuple[Any, int] | None]

    @property
    def rows(self) -> int:
        return len(self.keys)

    @classmethod
    def of(cls, model, new: Sentences, max_rows: int,
           lengths: tuple[float, int, int, int], counted: bool = False) -> _Waiting:
        n = new.src.size(0)
        if not 0 < n <= max_rows or len(new.keys) != n:
            raise ValueError(f"refill gave {n} sentences ({len(new.keys)} keys) for at "
                             f"most {max_rows}")
        if new.expires is not None and len(new.expires) != n:
            raise ValueError(f"refill gave {n} sentences and {len(new.expires)} expiries")
        group = _Group(new.src, AuxOutputs()) if counted else None
        e = (model.encode(new.src, control=new.control) if group is None
             else model.encode(new.src, control=new.control, aux=group.aux))
        a, b, max_positions, min_len = lengths
        limit = max_lengths((~e.pad_mask).sum(1), a, b, max_positions - 1)
        tally = None if group is None else StepTally(n, new.src.device, keep=False)
        state, e = model.begin(e, tally) if tally is not None else model.begin(e)
        dues = [None] * n if new.expires is None else list(new.expires)
        origin = [None] * n if group is None else [(group, i) for i in range(n)]
        return cls(state, e, list(new.keys), limit.clamp(min=min_len + 1).tolist(), dues,
                   origin)

    def without(self, gone: list[int], on_done: Callable[[Any, None], None]
                ) -> _Waiting | None:
        """These sentences but ``gone`` (indices), each answered ``on_done(key, None)``
        (None: none left)."""
        if not gone:
            return self
        for i in gone:
            on_done(self.keys[i], None, None)
        dropped = set(gone)
        keep = [i for i in range(self.rows) if i not in dropped]
        if not keep:
            return None
        index = torch.tensor(keep, device=self.enc.out.device)
        state, enc = _rows_of(self.state, self.enc, index)
        return _Waiting(state, enc, *([x[i] for i in keep] for x in (
            self.keys, self.limits, self.dues, self.origin)))

    def take(self, n: int) -> tuple[Any, ...]:
        """The first ``n`` sentences (their state, encoder output, keys, budgets, expiries,
        origins) and the rest (None: none left)."""
        lists = (self.keys, self.limits, self.dues, self.origin)
        if n == self.rows:
            return self.state, self.enc, *lists, None
        part, e, rest, e_rest = _split(self.state, self.enc, n)
        return (part, e, *(x[:n] for x in lists),
                _Waiting(rest, e_rest, *(x[n:] for x in lists)))


@dataclass(frozen=True)
class _Group:
    """Sentences of a counted refilled decode encoded together: their source and the
    encoder's records of them."""

    src: Tensor
    aux: AuxOutputs


def _rows_of(state, enc, index: Tensor):
    """Rows ``index`` of a started state that ran no step (its cross keys, and its tally's
    rows, are all it holds) and of its spent encoder output."""
    part = copy.copy(state)
    part.cross = [keys.index_select(index) for keys in state.cross]
    if state.tally is not None:
        part.tally = state.tally.select(index)
    return part, enc.index_select(index)


def _split(state, enc, n: int):
    """A started state that ran no step, and its spent encoder output, as its first ``n``
    rows and the others (each a state of its own: its cross keys are all it holds)."""
    device = enc.out.device
    head, tail = (torch.arange(0, n, device=device),
                  torch.arange(n, enc.out.size(0), device=device))
    return (*_rows_of(state, enc, head), *_rows_of(state, enc, tail))


def counted_greedy_search(model, src: Tensor,
                          on_counted: Callable[[list[int], list[list[int]], Counted], None]
                          | None = None, **kwargs) -> tuple[list[list[int] | None], Counted]:
    """:func:`greedy_search` (``kwargs``: its) through a lean decoder, counting what it runs:
    the hypotheses and :data:`Counted`. ``on_counted(rows, tokens, counted)``: as
    ``on_done``, with what was counted so far (final for the rows that finished)."""
    aux, tally = AuxOutputs(), StepTally(src.size(0), src.device)
    on_done = None if on_counted is None else (
        lambda rows, tokens: on_counted(rows, tokens, (aux, tally.counts())))
    hyps = greedy_search(model, src, aux=aux, tally=tally, on_done=on_done, **kwargs)
    return hyps, (aux, tally.counts())


@torch.inference_mode()
def beam_search(model, src: Tensor, beam: int = 4, length_penalty: float = 1.0,
                max_len_a: float = 1.2, max_len_b: int = 10, min_len: int = 0,
                max_positions: int = 1024,
                control: Tensor | int | None = None, expires: Sequence[Expires] | None = None,
                clock: Callable[[], float] = time.perf_counter,
                on_done: Finished | None = None) -> list[list[int] | None]:
    """Batched beam search; src (B, S) -> best hypothesis per sentence (no bos/eos); None
    for a sentence that ran past its ``expires`` before its search ended (see the module
    doc). ``on_done``: called with the sentences whose search ended at a step
    (:data:`Finished`), before the others' does.

    A finished hypothesis of n tokens (eos included) scores ``log p / n^length_penalty``.
    Each step takes the top 2·beam candidates of every sentence: eos candidates within the
    first ``beam`` are finished, the best ``beam`` others go on. Only each beam's best
    beam + 1 tokens are ranked against the other beams': a kept candidate ranks at most
    beam-th among its own beam's tokens, or beam + 1-th behind its beam's eos (ranking
    every beam × vocabulary sum cost a full-vocabulary pass and a top-k over it per step;
    the kept candidates are the same, up to the order of exact ties).
    A sentence stops once it has ``beam`` finished hypotheses; at its length limit every
    live beam is closed with eos.
    The beams of a sentence are identical until the first token, so the first step runs
    one row per sentence (projecting its cross-attention keys/values once, not ``beam``
    times) and then copies its rows and caches to the ``beam`` beams (a lean state's
    ``expand_beams`` may let them share the cross-attention keys). ``control`` as in
    :func:`greedy_search` (each sentence's beams run at its budget).
    """
    if beam < 1:
        raise ValueError("beam must be >= 1")
    k = beam
    enc0 = model.encode(src, control=control)
    n = src.size(0)
    device = src.device
    limits = max_lengths((~enc0.pad_mask).sum(1), max_len_a, max_len_b, max_positions - 1)
    limits = limits.clamp(min=min_len + 1)
    expand = torch.arange(n, device=device).repeat_interleave(k)  # (n*k,)
    ranks = list(range(k))  # a sentence's beam slots in rank order
    enc = enc0  # one row per sentence for the first step, then k
    state = model.init_state()
    active = torch.arange(n, device=device)
    active_list = list(range(n))  # the same sentences, for Python-side bookkeeping
    scores = torch.full((n, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    history = torch.full((n * k, 0), model.pad_id, dtype=torch.long, device=device)
    tokens = torch.full((n, 1), model.bos_id, dtype=torch.long, device=device)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(n)]
    expiry, expired = _expiry(expires, n, clock), [False] * n
    for step in range(int(limits.max())):
        m = active.numel()
        logp = torch.log_softmax(model.decode_step(tokens, enc, state).float(), dim=-1)
        if step < min_len:
            logp[:, model.eos_id] = float("-inf")
        at_limit = step + 1 >= limits[active]
        _force_eos(logp, model.eos_id, at_limit if step == 0 else at_limit.repeat_interleave(k))
        # a row's best k + 1 tokens hold every candidate the step keeps (see the doc)
        row_scores, row_toks = logp.topk(min(k + 1, logp.size(-1)), dim=1)  # (rows, c)
        if step == 0:  # the k beams of each sentence start from its one row
            row_scores, row_toks = row_scores[expand], row_toks[expand]
            enc = enc0.index_select(expand)
            expand_beams = getattr(state, "expand_beams", None)  # a lean state's
            if expand_beams is None:
                state.reorder(expand)
            else:
                expand_beams(expand, k)
        c = row_scores.size(1)
        cand = (scores.unsqueeze(2) + row_scores.view(m, k, c)).view(m, k * c)
        top_scores, top_idx = cand.topk(2 * k, dim=1)  # (m, 2k)
        top_beam = torch.div(top_idx, c, rounding_mode="floor")
        top_tok = row_toks.view(m, k * c).gather(1, top_idx)
        is_eos = top_tok.eq(model.eos_id) & torch.isfinite(top_scores)
        closing = is_eos.clone()
        closing[:, k:] = False
        for row, rank in closing.nonzero().tolist():
            sent = active_list[row]
            if len(finished[sent]) >= k:
                continue
            prev = row * k + int(top_beam[row, rank])
            hyp = history[prev].tolist()
            norm = float(top_scores[row, rank]) / (len(hyp) + 1) ** length_penalty
            finished[sent].append((norm, hyp))
        # the best k non-eos candidates continue
        live_scores = top_scores.masked_fill(is_eos, float("-inf"))
        live_scores, order = live_scores.topk(k, dim=1)  # (m, k)
        beams = top_beam.gather(1, order)
        toks = top_tok.gather(1, order)
        done = ~torch.isfinite(live_scores[:, 0])
        full = [len(finished[s]) >= k for s in active_list]
        late = None if expiry is None else expiry.due(active_list)
        if late is not None:  # a sentence whose search has not ended is dropped
            ended = [f or d for f, d in zip(full, done.tolist(), strict=True)]
            for sent, gone, end in zip(active_list, late, ended, strict=True):
                expired[sent] = gone and not end
            full = [f or g for f, g in zip(full, late, strict=True)]
        if any(full):
            done |= torch.tensor(full, device=device)
        if on_done is not None:
            ended = [active_list[i] for i in done.nonzero().squeeze(1).tolist()]
            ended = [s for s in ended if not expired[s]]
            if ended:
                on_done(ended, [_best(finished[s]) for s in ended])
        if done.all():
            break
        orders = stay_in_place(beams.tolist()) if k > 1 else []
        if any(order != ranks for order in orders):  # rank order stays as it is
            slots = torch.tensor(orders, device=device)  # slot t takes a child of its own
            beams, toks, live_scores = (t.gather(1, slots) for t in (beams, toks, live_scores))
        keep = (~done).nonzero().squeeze(1)
        rows = (keep.unsqueeze(1) * k + beams[keep]).view(-1)  # flat rows to continue
        history = torch.cat([history[rows], toks[keep].view(-1, 1)], dim=1)
        scores = live_scores[keep]
        state.reorder_self(rows)
        if keep.numel() != m:  # sentences finished: drop their rows (any beam's will do)
            first_beams = keep.repeat_interleave(k) * k
            enc = enc.index_select(first_beams)
            state.reorder_cross(first_beams)
        active = active[keep]
        active_list = [active_list[i] for i in keep.tolist()]
        tokens = toks[keep].view(-1, 1)
    return [None if gone else _best(hyps) for hyps, gone in zip(finished, expired, strict=True)]


def stay_in_place(parents: list[list[int]]) -> list[list[int]]:
    """For each sentence, the order in which its ranked continuations fill its beam slots:
    ``parents[s][j]`` is the slot (beam) that continuation j extends, and the result's
    ``[s][t]`` is the continuation that slot t holds. A continuation takes its parent's own
    slot when no better-ranked one has; the rest fill the freed slots in rank order.

    Why: a slot that keeps extending itself keeps its keys and values where they are, so
    the caches copy only the rows that moved (:meth:`StepCache.reorder`) instead of every
    row every step. The beams of a sentence are a set: the search's result does not depend
    on the slot each sits in, up to exact ties between scores (``topk`` breaks those by
    position). The parents are read to the host once a step, beside the search's other
    host reads."""
    orders = []
    for ranked in parents:
        order, rest = [-1] * len(ranked), []
        for j, slot in enumerate(ranked):
            if order[slot] < 0:
                order[slot] = j
            else:
                rest.append(j)
        free = (t for t, j in enumerate(order) if j < 0)
        for t, j in zip(free, rest, strict=True):
            order[t] = j
        orders.append(order)
    return orders


def _best(hyps: list[tuple[float, list[int]]]) -> list[int]:
    """The tokens of the best-scoring finished hypothesis of a sentence."""
    assert hyps, "every sentence is closed at its length limit"
    return max(hyps, key=lambda h: h[0])[1]
