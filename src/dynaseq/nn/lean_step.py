"""The parts of a lean decoding step, and the table that says which sub-layer runs how.

A decoder layer's step is ``x + SA(LN(x))``, ``x + CA(LN(x))``, ``x + FFN(LN(x))`` for one new
token per row. :class:`~dynaseq.models.lean.LeanDecoder` runs it without module dispatch; the
sub-layers' own arithmetic comes from a *lean part* per sub-layer, built once from the
module by the factory its type registered here (:func:`register_lean`), as
:mod:`dynaseq.nn.int8` does for quantization. So the decoder names no technique: the dense
parts live in :mod:`dynaseq.nn.lean_dense`, the CCT's gated parts with the CCT.

A part is inference only and runs on a decoding step's ``x`` ``(B, 1, d)`` (already the
sub-layer's input LayerNorm) with ``offset``, the rows' gate offsets
(:class:`~dynaseq.models.seq2seq.EncoderOutput`'s ``gate_offset``): a ``(B,)`` tensor, one
float when every row has the same, or None. Its ``step`` returns the
sub-layer's output ``(B, 1, d)``, or **None when the output is exactly zero for every row**
(a gated sub-layer whose gates are all off): the residual is then left as it is and nothing
of the sub-layer ran but its control network.

* self-attention: ``step(x, cache, offset)`` with the layer's :class:`StepCache`;
* cross-attention: ``start(memory, pad_mask, offset) -> CrossKeys`` once per batch,
  ``step(x, keys, offset)`` every step;
* feed-forward: ``step(x, offset)``; it reads rows, so an encoder runs it on its valid
  tokens, each a row ``(N, 1, d)`` with its row's offset;
* an encoder's self-attention (role ``"encoder"``): ``encode(x, valid, offset)`` on whole
  sequences ``(B, S, d)``, and ``encode_first`` for the first token's output alone
  (:class:`~dynaseq.models.lean_encoder.LeanEncoder`).

``sources`` lists the tensors a part copied (fused or folded weights): the decoder compares
their version counters to know when its copies went stale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.int8 import Int8Linear
from dynaseq.nn.layouts import Layouts, call_key


@dataclass(frozen=True)
class Norm:
    """A LayerNorm's tensors: ``F.layer_norm(x, (d,), weight, bias, eps)``."""

    weight: Tensor
    bias: Tensor
    eps: float

    @classmethod
    def of(cls, m: nn.Module) -> Norm | None:
        """The norm of an ``nn.LayerNorm`` with affine weights, None for anything else."""
        if type(m) is not nn.LayerNorm or m.weight is None or m.bias is None:
            return None
        return cls(m.weight, m.bias, m.eps)

    def __call__(self, x: Tensor) -> Tensor:
        # the op F.layer_norm calls, without its Python-side checks (a CCT decoding step
        # at batch 1 runs about 29 norms, a dense one 10)
        return torch.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def linear_of(m: nn.Module) -> nn.Linear | None:
    """``m`` if it is a plain ``nn.Linear`` with a bias (what the lean parts run), else None."""
    return m if type(m) is nn.Linear and m.bias is not None else None


LinearFn = Callable[[Tensor], Tensor]
"""A projection as a function: ``(..., in)`` -> ``(..., out)``."""


class StepLinear:
    """``x Wᵀ + b`` for a float32 projection ``W`` ``(out, in)`` on the CPU, in whichever of
    three layouts reads the weight fastest on this machine at the call's size class
    (:mod:`dynaseq.nn.layouts`: the first calls of each class try each in turn):

    * ``linear``: ``F.linear`` on ``W`` itself;
    * ``copy``: ``x @ Wᵀ`` against an ``(in, out)`` copy of the weight (made before the
      first call that tries it, and dropped once every class tried is settled on another);
    * ``left``: ``(W xᵀ + b)ᵀ``, the weight itself on the left (the small result made
      contiguous).

    ``layout``: one of them for every call instead (a test's or a benchmark's pin). A weight
    that is not float32 on the CPU runs ``F.linear`` only. ``x``: ``(..., in)`` ->
    ``(..., out)``; the layouts differ by float rounding only.
    """

    LAYOUTS = ("linear", "copy", "left")

    def __init__(self, weight: Tensor, bias: Tensor | None, layout: str | None = None,
                 layouts: Layouts | None = None) -> None:
        if layout is not None and layout not in self.LAYOUTS:
            raise ValueError(f"layout must be one of {self.LAYOUTS}, got {layout!r}")
        self.weight, self.bias = weight, bias  # (out, in), (out,)
        self.n_in = weight.size(1)
        cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.pinned = self.LAYOUTS.index(layout) if layout is not None else None if cpu else 0
        self.layouts = layouts or Layouts(len(self.LAYOUTS))
        assert self.layouts.n == len(self.LAYOUTS), "one time list per layout"
        self.bias_column = None if bias is None else bias[:, None]  # (out, 1), a view
        self.weight_t: Tensor | None = None  # (in, out), while the copy is tried or chosen

    def __call__(self, x: Tensor) -> Tensor:
        if self.pinned is not None:
            return self._run(self.pinned, x)
        key = call_key(x.numel() // self.n_in)
        i = self.layouts.chosen.get(key)
        if i is not None:
            return self._run(i, x)
        if self.weight_t is None:  # made untimed: the trial times the product alone
            self._copy()
        y = self.layouts.trial(key, self._run, x)
        if (self.layouts.settled and self.weight_t is not None
                and 1 not in self.layouts.chosen.values()):
            self.weight_t = None  # no class reads it
        return y

    def _copy(self) -> Tensor:
        with torch.no_grad():  # a race only makes the same copy twice
            weight_t = self.weight_t = self.weight.detach().t().contiguous()
        return weight_t

    def _run(self, layout: int, x: Tensor) -> Tensor:
        n_in = self.n_in
        rows = x.numel() // n_in
        x2 = x.reshape(rows, n_in)  # (a strided 3-d x would make F.linear a batched product)
        if layout == 0:
            return F.linear(x2, self.weight, self.bias).view(*x.shape[:-1], -1)
        if layout == 2:
            xt = x2.t()  # (in, rows)
            y = (torch.mm(self.weight, xt) if self.bias_column is None
                 else torch.addmm(self.bias_column, self.weight, xt))  # (out, rows)
            return y.t().contiguous().view(*x.shape[:-1], -1)
        weight_t = self.weight_t
        if weight_t is None:  # chosen, then dropped by a concurrent trial: made anew
            weight_t = self._copy()
        y = torch.mm(x2, weight_t) if self.bias is None else torch.addmm(self.bias, x2,
                                                                          weight_t)
        return y.view(*x.shape[:-1], -1)


def float_linear(weight: Tensor, bias: Tensor | None) -> LinearFn:
    """``x Wᵀ + b`` as a function: :class:`StepLinear` for a float32 CPU weight ``(out, in)``,
    else ``F.linear`` bound to the tensors (no copy). bfloat16 weights keep ``F.linear``:
    there the two plain layouts measured within 0.86-1.08x of each other."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return StepLinear(weight, bias)
    return partial(F.linear, weight=weight, bias=bias)


def linear_fn(m: nn.Module, bias: bool = True) -> LinearFn | None:
    """``m``'s map without the module call's hook dispatch, for a plain ``nn.Linear`` (float
    weights: :func:`float_linear`) or an :class:`~dynaseq.nn.int8.Int8Linear` (its int8
    kernel); None for anything else, or when ``bias`` asks for a bias that ``m`` lacks."""
    if type(m) is nn.Linear and (m.bias is not None or not bias):
        return float_linear(m.weight, m.bias)
    if type(m) is Int8Linear and (m.bias is not None or not bias):
        return m.forward
    return None


def linear_tensors(m: nn.Module) -> list[Tensor]:
    """The tensors of a projection :func:`linear_fn` accepts (their version counters tell a
    lean part that copied or bound them that they changed)."""
    names = ("weight", "bias") if type(m) is nn.Linear else ("weight_int8", "weight_scale",
                                                                 "bias")
    return [t for t in (getattr(m, n) for n in names) if t is not None]


def fused_linear(mods: tuple[nn.Module, ...]) -> LinearFn | None:
    """One function for several projections of the same input, stacked along the outputs
    (a copy): float ``nn.Linear`` weights concatenated, or int8 rows and their per-channel
    scales concatenated (the input is quantized per row, so the stacked product equals the
    separate ones exactly). None unless all are float, or all int8, with biases."""
    if all(type(m) is nn.Linear and m.bias is not None for m in mods):
        with torch.no_grad():
            weight = torch.cat([m.weight for m in mods])
            bias = torch.cat([m.bias for m in mods])
        return float_linear(weight, bias)
    if all(type(m) is Int8Linear and m.bias is not None for m in mods):
        return Int8Linear.stacked(mods).forward
    return None


class StepCache:
    """One layer's self-attention keys and values, preallocated: ``k``/``v``
    ``(B, H, capacity, d_head)``, the first :attr:`length` positions filled. A step writes in
    place; a full cache doubles its capacity (so no step concatenates).

    Rows that joined a running decode (:meth:`join`) began at a later slot than the others:
    :attr:`mask` then says which filled slots each row's own steps wrote, and the
    self-attention parts pass it to the attention (set by the decoding state before each
    step; None while every row began at slot 0)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a cache holds at least one step, got capacity={capacity}")
        self.capacity = capacity
        self.length = 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.mask: Tensor | None = None
        """``(B, 1, 1, length + 1)`` bool, True at the slots the step's rows may attend (theirs
        and the one this step writes), or None: every slot."""

    def join(self, rows: int) -> None:
        """Make room for ``rows`` more rows after the present ones (their slots unwritten:
        the state's :attr:`mask` keeps them out of the attention until their own steps write
        them); the filled slots of the present rows are copied."""
        if self.k is None:
            return  # allocated at the first append, with every row
        assert self.v is not None
        self.k, self.v = (_more_rows(c, rows, self.length) for c in (self.k, self.v))

    def compact(self, shift: int) -> None:
        """Drop the first ``shift`` filled slots (no row's any more: every row began at or
        after slot ``shift``); the others move to the front."""
        if not shift:
            return
        assert 0 < shift <= self.length
        for cache in (self.k, self.v):
            if cache is not None:
                cache[:, :, : self.length - shift] = cache[:, :, shift: self.length].clone()
        self.length -= shift

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one step's keys and values ``(B, H, 1, d_head)`` at position :attr:`length`;
        return every filled position's, ``(B, H, length + 1, d_head)`` views."""
        n = self.length
        if self.k is None:
            shape = (*k.shape[:2], self.capacity, k.size(3))
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        elif n >= self.k.size(2):  # full: double the capacity
            self.k, self.v = _grow(self.k, n), _grow(self.v, n)
        self.k[:, :, n: n + 1].copy_(k)
        self.v[:, :, n: n + 1].copy_(v)
        self.length = n + 1
        return self.k[:, :, : n + 1], self.v[:, :, : n + 1]

    def filled(self) -> tuple[Tensor, Tensor]:
        """The filled positions' keys and values, ``(B, H, length, d_head)`` views."""
        assert self.k is not None and self.v is not None, "nothing written yet"
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def reorder(self, index: Tensor, moved: Tensor | None = None) -> None:
        """Keep/reorder batch rows (filled positions only are copied). ``moved``: the rows
        ``i`` with ``index[i] != i`` (:func:`moved_rows`): only those are copied, in place,
        and an index that keeps fewer rows keeps the first ones as a view (rows that
        finished, swapped to the end by the search: :func:`in_place`)."""
        if self.k is None:
            return
        assert self.v is not None
        if not in_place(index, moved, self.k.size(0)):
            self.k = _take_rows(self.k, index, self.length)
            self.v = _take_rows(self.v, index, self.length)
            return
        assert moved is not None
        _copy_moved([c[:, :, : self.length] for c in (self.k, self.v)], index, moved)
        self.k, self.v = self.k[: index.numel()], self.v[: index.numel()]


SHARE_MIN = 8
"""Sentences from which a beam search's beams share their sentence's cross-attention keys
(:meth:`CrossKeys.shared`) instead of a copy each. One product per sentence with its beams
as a block of queries (:func:`attend_keys`) against one-query attention per beam over
copies, microbenchmarked on this project's AVX-512 EPYC (4 beams, 30 source tokens, heads
x width 8 x 64 / 4 x 32 / 4 x 64): 32 sentences 0.30x / 0.61x / 0.71x the time at 2
threads, 0.18x-0.55x at 1; 8 sentences 0.59x-0.94x; one sentence 1.8x slower at 2
threads. Whole fixed-length beam-4 decodes of the dense models, in one process against
copies (7-9 interleaved rounds): batch 32 at 2 threads 0.83x / 1.03x (`tiny`, two runs),
0.93x (`small`), 0.90x / 0.97x (`base`); at 1 thread 0.98x (`tiny`), 0.91x (`small`);
`small` batch 8 1.03x at 2 threads, 0.96x at 1."""


@dataclass
class CrossKeys:
    """A cross-attention's keys and values for every later step, projected once.

    k, v: ``(B, H, W, d_head)``; mask: broadcastable to ``(B, H, 1, W)``, bool (True =
    attend) or float (added to the scores), or None (every key attended). ``group``: the
    consecutive query rows each row of keys serves (the beams of a sentence, when they
    share its keys; 1: one query row each).
    """

    k: Tensor
    v: Tensor
    mask: Tensor | None = None
    group: int = 1

    def index_select(self, index: Tensor, moved: Tensor | None = None) -> CrossKeys:
        """The keys of query rows ``index``: rows of keys for ``group`` 1; for shared keys,
        ``index`` keeps or drops whole groups (``index[g·i] // g`` names group i's keys).
        ``moved`` (``group`` 1: :func:`moved_rows`): an index that drops rows, where
        :func:`in_place` says so, copies only those rows, in place (these keys are no one
        else's), and keeps the first ``len(index)`` as views."""
        if self.group == 1 and index.numel() < self.k.size(0) and in_place(
                index, moved, self.k.size(0)):
            assert moved is not None
            per_row = self.mask is not None and self.mask.size(0) == self.k.size(0)
            _copy_moved([self.k, self.v] + ([self.mask] if per_row else []), index, moved)
            n = index.numel()  # a mask of one row serves every row as it is
            return CrossKeys(self.k[:n], self.v[:n],
                             self.mask[:n] if per_row else self.mask, self.group)
        if self.group > 1:
            assert index.numel() % self.group == 0, "shared keys keep whole groups"
            index = index[:: self.group] // self.group
        mask = None if self.mask is None else self.mask.index_select(0, index)
        return CrossKeys(self.k.index_select(0, index), self.v.index_select(0, index), mask,
                         self.group)

    def shared(self, group: int) -> CrossKeys:
        """The same keys, each row serving ``group`` consecutive query rows (no copy)."""
        assert self.group == 1, "keys are shared once"
        return CrossKeys(self.k, self.v, self.mask, group)

    @staticmethod
    def cat(parts: Sequence[CrossKeys]) -> CrossKeys:
        """The rows of ``parts`` one after the other (one query row each), padded to the
        widest: zero keys and values that the mask leaves out (False, or ``-inf`` where a
        part's mask is float, as the CCT's packed keys are: then every mask is float)."""
        assert all(p.group == 1 for p in parts), "rows of their own (greedy search)"
        width = max(p.k.size(2) for p in parts)
        if all(p.mask is None and p.k.size(2) == width for p in parts):
            return CrossKeys(torch.cat([p.k for p in parts]), torch.cat([p.v for p in parts]))
        floats = any(p.mask is not None and p.mask.is_floating_point() for p in parts)
        ks, vs, masks = zip(*(p._padded(width, floats) for p in parts), strict=True)
        return CrossKeys(torch.cat(ks), torch.cat(vs), torch.cat(masks))

    def put(self, rows: Tensor, other: CrossKeys) -> CrossKeys:
        """These keys with rows ``rows`` ``(n,)`` replaced by the ``n`` rows of ``other``
        (in place where the widths and masks allow, else a padded copy as :meth:`cat`)."""
        assert self.group == other.group == 1, "rows of their own (greedy search)"
        width = max(self.k.size(2), other.k.size(2))
        if self.mask is None and other.mask is None and self.k.size(2) == other.k.size(2):
            base = self
        else:
            floats = any(p.mask is not None and p.mask.is_floating_point()
                         for p in (self, other))
            base = self if (self.k.size(2) == width and self.mask is not None
                            and self.mask.is_floating_point() == floats
                            and self.mask.size(0) == self.k.size(0)) \
                else CrossKeys(*self._padded(width, floats))
            other = CrossKeys(*other._padded(width, floats))
        base.k.index_copy_(0, rows, other.k)
        base.v.index_copy_(0, rows, other.v)
        if base.mask is not None:
            assert other.mask is not None
            base.mask.index_copy_(0, rows, other.mask)
        return base

    def _padded(self, width: int, floats: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Keys, values and a mask of one row each ``(B, 1, 1, width)`` (float ``0/-inf``
        if ``floats``, else bool), padded to ``width`` with zero keys left out: new tensors."""
        rows, w = self.k.size(0), self.k.size(2)
        mask = (torch.ones(rows, 1, 1, w, dtype=torch.bool, device=self.k.device)
                if self.mask is None else self.mask.expand(rows, 1, 1, w))
        if floats and not mask.is_floating_point():
            mask = torch.zeros(mask.shape, dtype=self.k.dtype, device=self.k.device
                               ).masked_fill_(~mask, float("-inf"))
        pad = width - w
        return (F.pad(self.k, (0, 0, 0, pad)), F.pad(self.v, (0, 0, 0, pad)),
                F.pad(mask, (0, pad), value=float("-inf") if floats else False))


def attend_keys(q: Tensor, keys: CrossKeys) -> Tensor:
    """One query per row, q ``(R, H, 1, hd)``, over ``keys`` -> ``(R, H, 1, hd)``: scaled
    dot-product attention (eq. 1 of Vaswani et al.), each query row over its own row of
    keys (``group`` 1: ``F.scaled_dot_product_attention``), or each group of
    ``keys.group`` rows over their shared row as one block of queries: ``softmax(Q Kᵀ /
    √hd + mask) V`` by two batched products.

    Why by hand: SDPA's CPU kernel took 1.0-1.7x longer with a block of 4 queries than with
    4 rows of one at 2 threads on this project's EPYC (see :data:`SHARE_MIN` for the
    products' gain)."""
    if keys.group == 1:
        return F.scaled_dot_product_attention(q, keys.k, keys.v, attn_mask=keys.mask)
    r, h, _, d = q.shape
    b = keys.k.size(0)
    assert r == b * keys.group, "a block of queries per row of keys"
    block = q.view(b, keys.group, h, d).transpose(1, 2)  # (B, H, g, hd)
    scores = torch.matmul(block, keys.k.transpose(-1, -2)).mul_(d ** -0.5)  # (B, H, g, W)
    mask = keys.mask
    if mask is not None:
        scores = (scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores.add_(mask))
    # the weights in float32 whatever the dtype (SDPA's accumulate so); a row with every
    # key masked attends nothing (0, as SDPA gives), not NaN
    weights = scores.softmax(-1, dtype=torch.float32).nan_to_num_(0.0).to(keys.v.dtype)
    a = torch.matmul(weights, keys.v)  # (B, H, g, hd)
    return a.transpose(1, 2).reshape(r, h, 1, d)


Offset = Tensor | float | None
"""The rows' gate offsets a part's step receives (see the module docstring)."""


def autocast_on(model: nn.Module) -> bool:
    """Whether the caller's ``torch.autocast`` is on for ``model``'s device. The lean parts
    call their products on copies in the weights' own dtype and write into buffers of it,
    which autocast's lower-precision products do not match (a dtype error): a predictor
    runs the model's general path then, which follows autocast."""
    p = next(model.parameters(), None)
    return p is not None and torch.is_autocast_enabled(p.device.type)


def refreshed(held: Any, prepare: Callable[[nn.Module], Any], model: nn.Module) -> Any:
    """``held`` (a lean decoder or encoder a predictor keeps) while it is current (its
    ``is_current()``: no copied weight or module changed), else ``prepare(model)`` anew
    (None where the model has none)."""
    return held if held is not None and held.is_current() else prepare(model)


def uniform_offset(offset: Tensor | None) -> Offset:
    """The rows' gate offsets ``(B,)`` as one float when every row has the same (e.g. ±inf,
    which fixes every gate without its control network), else as they are."""
    if offset is None or offset.numel() == 0:
        return offset
    first = offset[0]
    return float(first) if bool((offset == first).all()) else offset


class StepTally:
    """Per-row counts of what a decode's gated parts ran, added step by step: the decode's
    realized compute, without running the sequences again teacher forced.

    Written by hand: no library keeps per-row counters through a search that drops rows.
    Rows follow the search's: :meth:`reorder` keeps and drops rows as the caches do (greedy
    search: a finished row leaves), and a row's counts stay readable under its original
    index (:meth:`counts`). Keys are chosen by the parts (e.g. ``"decoder.layers.0.ffn"``);
    a part adds ``(B,)`` or ``(B, M)`` counts of the active rows, or one number for all.
    The key ``"steps"`` counts the steps each row ran (the decoder's :meth:`step`).
    """

    def __init__(self, n_rows: int, device: torch.device | str | None = None,
                 keep: bool = True) -> None:
        self.n_rows = n_rows
        self.keep = keep  # False: rows that leave are forgotten (read them first: active)
        self._rows = torch.arange(n_rows, device=device)  # original row of each active row
        self._active: dict[str, Tensor] = {}
        self._final: dict[str, Tensor] = {}
        self.add("steps", 0)

    def active(self, rows: Tensor) -> dict[str, Tensor]:
        """The counts so far of active rows ``rows`` ``(n,)`` (positions among the active
        ones), ``{key: (n, ...)}``: a continuous decode reads a row's as it finishes."""
        return {k: v.index_select(0, rows) for k, v in self._active.items()}

    def select(self, rows: Tensor) -> StepTally:
        """A tally of active rows ``rows`` ``(n,)`` alone (``keep=False``; the sentences of a
        continuous decode that wait are split as they take rows)."""
        part = StepTally(0, self.device, keep=False)
        part._active = self.active(rows)
        part._rows = torch.arange(rows.numel(), device=self.device)
        part.n_rows = rows.numel()
        return part

    def join(self, other: StepTally) -> None:
        """Append ``other``'s active rows (new sentences of a continuous decode) after these;
        a key one side has not counted yet is 0 for its rows."""
        self._merge(other, lambda mine, theirs: torch.cat([mine, theirs]))

    def put(self, rows: Tensor, other: StepTally) -> None:
        """Active rows ``rows`` ``(n,)`` (finished: read them first) take ``other``'s ``n``
        rows' counts."""
        self._merge(other, lambda mine, theirs: mine.index_copy(0, rows, theirs))

    def _merge(self, other: StepTally, how: Callable[[Tensor, Tensor], Tensor]) -> None:
        assert not self.keep, "counts of rows that come and go are read as they finish"
        b, n = self._rows.numel(), other._rows.numel()
        for key in set(self._active) | set(other._active):
            mine, theirs = self._active.get(key), other._active.get(key)
            like = mine if mine is not None else theirs
            if mine is None:
                mine = like.new_zeros((b, *like.shape[1:]))
            if theirs is None:
                theirs = like.new_zeros((n, *like.shape[1:]))
            self._active[key] = how(mine, theirs)
        self._rows = how(self._rows, other._rows + self.n_rows)
        self.n_rows += other.n_rows

    @property
    def device(self) -> torch.device:
        return self._rows.device

    def add(self, key: str, counts: Tensor | int) -> None:
        """Add ``counts`` (``(B, ...)`` per active row, or one number for each) to ``key``."""
        b = self._rows.numel()
        if not isinstance(counts, Tensor):
            counts = torch.full((b,), int(counts), dtype=torch.long, device=self._rows.device)
        assert counts.size(0) == b, f"{counts.size(0)} counts for {b} active rows"
        now = self._active.get(key)
        self._active[key] = counts.long() if now is None else now + counts.long()

    def step(self) -> None:
        """One more step for every active row."""
        self._active["steps"] = self._active["steps"] + 1

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` ``(B',)`` of the active ones (the others are done)."""
        if self.keep:
            self._store()
        self._rows = self._rows.index_select(0, index)
        self._active = {k: v.index_select(0, index) for k, v in self._active.items()}

    def counts(self) -> dict[str, Tensor]:
        """``{key: (n_rows, ...) long}``, every row's counts in original row order."""
        self._store()
        return dict(self._final)

    @torch.inference_mode()  # the counts of a decode (run under it) are inference tensors
    def _store(self) -> None:
        for key, value in self._active.items():
            final = self._final.get(key)
            if final is None:
                final = self._final[key] = value.new_zeros((self.n_rows, *value.shape[1:]))
            final[self._rows] = value


class LeanSelfAttention(Protocol):
    sources: list[Tensor]

    def step(self, x: Tensor, cache: StepCache, offset: Offset,
             tally: StepTally | None = None) -> Tensor | None: ...


class LeanCrossAttention(Protocol):
    sources: list[Tensor]

    def start(self, memory: Tensor, pad_mask: Tensor, offset: Offset,
              tally: StepTally | None = None) -> CrossKeys: ...

    def step(self, x: Tensor, keys: CrossKeys, offset: Offset,
             tally: StepTally | None = None) -> Tensor | None: ...


class LeanFeedForward(Protocol):
    sources: list[Tensor]

    def step(self, x: Tensor, offset: Offset, tally: StepTally | None = None
             ) -> Tensor | None: ...


class LeanEncoderAttention(Protocol):
    sources: list[Tensor]

    def encode(self, x: Tensor, valid: Tensor | None, offset: Offset,
               tally: StepTally | None = None) -> Tensor | None:
        """x ``(B, S, d)`` (the layer's normalised input); ``valid`` ``(B, S)`` bool, False
        at padding (None: no padding) -> ``(B, S, d)`` at the valid positions (padding
        positions hold anything), or None when the output is 0 for every token. A gated
        part adds each row's open gates to ``tally`` (``(B,)`` counts)."""

    def encode_first(self, x: Tensor, valid: Tensor | None, offset: Offset
                     ) -> Tensor | None:
        """:meth:`encode`'s output at each row's first token alone, ``(B, 1, d)`` (what a
        first-token head reads), computing no more of the other queries than the part
        must; None when it is 0 for every row. Counts no gates."""


LeanFactory = Callable[[nn.Module, str], object | None]
"""``factory(module, role)`` with a role of :data:`ROLES`: the module's lean part for that
role, or None when this module cannot run lean (then the model keeps the general path)."""

LEAN_PARTS: dict[type[nn.Module], LeanFactory] = {}
"""Module type (exact, not subclasses) -> its :data:`LeanFactory`."""

ROLES = ("self", "cross", "ffn", "encoder")
"""A part's role: a decoder's causal self-attention step, its cross-attention, a
feed-forward sub-layer (decoder or encoder: it reads rows), or an encoder's
bidirectional self-attention over whole sequences (:class:`LeanEncoderAttention`)."""


def register_lean(module_type: type[nn.Module], factory: LeanFactory) -> None:
    """Declare how sub-layers of ``module_type`` run in a lean decoding step (beside the
    type's definition or its technique)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_lean takes an nn.Module type, got {module_type!r}")
    LEAN_PARTS[module_type] = factory


def lean_part(module: nn.Module, role: str) -> object | None:
    """The lean part of sub-layer ``module`` in ``role`` (:data:`ROLES`), or None when its type
    registered none or its factory declines it."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    factory = LEAN_PARTS.get(type(module))
    return None if factory is None else factory(module, role)


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """``(B, T, H·hd)`` -> ``(B, H, T, hd)``."""
    b, t, d = x.shape
    return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)


def merge_heads(a: Tensor) -> Tensor:
    """``(B, H, T, hd)`` -> ``(B, T, H·hd)``."""
    b, h, t, d = a.shape
    return a.transpose(1, 2).reshape(b, t, h * d)


def _grow(cache: Tensor, filled: int) -> Tensor:
    """A cache of twice the capacity holding ``cache``'s first ``filled`` positions."""
    bigger = cache.new_empty((*cache.shape[:2], 2 * cache.size(2), cache.size(3)))
    bigger[:, :, :filled].copy_(cache[:, :, :filled])
    return bigger


def _more_rows(cache: Tensor, rows: int, filled: int) -> Tensor:
    """``cache`` with ``rows`` more rows after its own, the same capacity, its first
    ``filled`` positions copied and the new rows' zero (masked slots still enter the
    attention's product with weight 0, and 0 times a stale NaN would be NaN)."""
    out = cache.new_empty((cache.size(0) + rows, *cache.shape[1:]))
    out[: cache.size(0), :, :filled].copy_(cache[:, :, :filled])
    out[cache.size(0):].zero_()
    return out


def moved_rows(index: Tensor, rows: int) -> Tensor | None:
    """The rows ``i`` whose ``index[i] != i``, ``(n,)`` long, for an ``index`` into ``rows``
    rows that keeps at most that many (a beam step's, or a greedy step that drops finished
    rows); None when it keeps more (beams expanded: a gather then)."""
    if index.numel() > rows:
        return None
    return (index != torch.arange(index.numel(), device=index.device)).nonzero().squeeze(1)


IN_PLACE_SHARE = 0.5
"""An index that drops rows is applied in place (:func:`in_place`) when it moves at most
this share of the rows it keeps: copying the moved rows costs two passes over them, a
gather one pass over every kept row."""


def in_place(index: Tensor, moved: Tensor | None, rows: int) -> bool:
    """Whether rows ``index`` of ``rows`` rows are taken by copying the ``moved`` ones in
    place (:func:`moved_rows`; then the first ``len(index)`` rows are the result) rather
    than gathered: always for an index that keeps the count (a beam step), for one that
    keeps fewer when it moves at most :data:`IN_PLACE_SHARE` of them (greedy search
    swaps the rows that go on from the end into the places of those that finished, so
    dropping one row moves at most one). Each row's values are the same either way."""
    if moved is None:
        return False
    return index.numel() == rows or moved.numel() <= IN_PLACE_SHARE * index.numel()


def _copy_moved(tensors: Sequence[Tensor], index: Tensor, moved: Tensor) -> None:
    """Rows ``moved`` of each of ``tensors`` set, in place, to their rows ``index[moved]``
    (read before any is written): with the rows that did not move, the first
    ``len(index)`` rows are then ``t[index]``."""
    if not moved.numel():
        return
    sources = index.index_select(0, moved)
    for t in tensors:
        t.index_copy_(0, moved, t.index_select(0, sources))


def _take_rows(cache: Tensor, index: Tensor, filled: int) -> Tensor:
    """Rows ``index`` of a cache, same capacity, its first ``filled`` positions copied."""
    out = cache.new_empty((index.numel(), *cache.shape[1:]))
    torch.index_select(cache[:, :, :filled], 0, index, out=out[:, :, :filled])
    return out


__all__ = ["LEAN_PARTS", "CrossKeys", "LeanCrossAttention", "LeanEncoderAttention",
           "LeanFeedForward", "LeanSelfAttention", "LinearFn", "Norm", "Offset", "StepCache",
           "StepLinear", "SHARE_MIN", "attend_keys",
           "float_linear", "fused_linear", "lean_part", "linear_fn", "linear_of",
           "linear_tensors", "moved_rows", "in_place",
           "merge_heads", "refreshed", "register_lean", "split_heads", "uniform_offset"]
