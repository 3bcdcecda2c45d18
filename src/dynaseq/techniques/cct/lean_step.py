"""Lean decoding-step parts of the CCT's gated sub-layers (see :mod:`dynaseq.nn.lean_step`).

The same hard-gated computation as :class:`ConditionalAttention` and
:class:`ConditionalFeedForward` at inference (gates ``1[G(x) + δ_b >= 0]``, eq. 2), for one
new token per row, with what the arithmetic needs and nothing else. Each part first runs its
control network(s) and reads the decisions with one host sync, then:

* **self-attention** (eq. 12-13): the step's key and value are projected and normalised
  only for the rows whose ``g_KV`` is on and written to the layer's cache (zero rows where
  off: eq. 12's ``g_KV · LN(Y W_k)``, which enters the softmax with score 0 and adds
  nothing, exactly as the module counts it); the query, output LayerNorm and projection
  run only for the rows whose ``g_q`` is on (the attention itself for every row, the off
  ones with a zero query, which costs less than gathering their cache). All rows on:
  q/k/v come from one fused ``(3d, d)`` product; every ``g_q`` off: the part returns None
  (the sub-layer's output is 0, the residual stays as it is). The two control nets read
  the same input and run as one fused product. Attention scores against an off key's zero
  row are computed (``2·d`` multiply-adds per key and query, as padding would be); nothing
  else of it runs.
* **cross-attention**: at ``start`` the encoder tokens whose ``g_KV`` is on (and that are
  not padding) are projected once and packed to the left per row; the off ones become one
  zero key slot whose score carries ``log n_off`` (``e^{0 + log n_off} = n_off`` zero rows
  in the softmax, exactly the module's :func:`attend_with_zero_rows`), so every later step
  attends over the on keys only. Queries as for self-attention.
* **encoder self-attention** (role ``"encoder"``, whole sequences, eq. 12-13): both
  control nets as one product over the valid tokens (none over padding), one host sync for
  the open queries and keys/values. Queries and keys/values are limited to valid
  (non-padding) tokens, keys/values also to rows with an open query (as the module does).
  Every token open and no padding: one fused q/k/v product. Otherwise keys/values are projected and normalised for the open
  tokens only (zero rows elsewhere, entering the softmax with score 0, eq. 12), and the
  query, the output LayerNorm and projection run for the open queries only, packed per
  sequence (:class:`~dynaseq.techniques.cct.packing.Packing`), attending over all of
  their sequence's valid keys. Outputs at padding positions are left unspecified (nothing
  reads them: padding keys are masked and the head reads the first token).
* **fixed decisions**: where every row has the same offset of +inf (every gate open, the
  full network) or -inf, or the gates are pinned (``gate_override``), the decisions do not
  depend on the control networks, and they do not run.
* **feed-forward** (eq. 15): the M pieces' input LayerNorms share their normalisation, so
  their affine weights are folded into the pieces' first layers, which run as one
  ``(ffn_dim, d)`` product when every piece is open for every row, with the second layers
  as one batched product (each piece's weight on the right or on the left, whichever reads
  faster here: :meth:`GatedFeedForward._second`) and the output LayerNorms as one call.
  Mixed: the same fused products over the span of pieces from the first to the last one open for any row
  (those outside it do not run; their rows of the folded weights are sliced off, views):
  with no mask when every row opens the whole span (a batch-1 step with two adjacent
  pieces open runs half the feed-forward, not all of it times a mask), else over the rows
  with an open piece, each closed piece's output times 0, when that computes at most
  :attr:`GatedFeedForward.FUSE_WASTE` times the open pieces' work; otherwise (and for a
  span of one piece) piece i runs on the rows where it is open; none open: None.

* **counting**: given a :class:`~dynaseq.nn.lean_step.StepTally`, each part adds every
  row's open gates of the step under its sub-layer's name (``.q``, ``.kv``; ``.keys``, the
  on memory keys, once at ``start``; ``.pieces``, ``(B, M)``), from which a row's realized
  MACs follow without a teacher-forced pass (``dynaseq.serve.compute.counted_per_row``).

Folding and fusing change float rounding only: outputs equal the modules' up to it (the
tests compare every step's logits). Parts decline (the general step runs) for int8 or
otherwise non-``nn.Linear`` projections, LayerNorms without affine weights, and pieces whose
input norms differ in ``eps``.
"""

from __future__ import annotations

import math
import struct

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.layouts import Layouts, call_key
from dynaseq.nn.lean_step import (
    CrossKeys,
    LinearFn,
    Norm,
    Offset,
    StepCache,
    StepTally,
    attend_keys,
    float_linear,
    linear_of,
    merge_heads,
    register_lean,
    split_heads,
)
from dynaseq.techniques.cct.conditional_attention import ConditionalAttention, PackedKeys
from dynaseq.techniques.cct.conditional_ffn import ConditionalFeedForward
from dynaseq.techniques.cct.gating import ControlNet, Gate
from dynaseq.techniques.cct.packing import Packing

_IDENTITY = "identity"


def _norm_or_identity(m: nn.Module) -> Norm | str | None:
    """A LayerNorm's :class:`Norm`, :data:`_IDENTITY` for ``nn.Identity``, None otherwise."""
    return _IDENTITY if type(m) is nn.Identity else Norm.of(m)


def _apply(norm: Norm | str, x: Tensor) -> Tensor:
    return x if norm == _IDENTITY else norm(x)


def _control_ok(c: nn.Module) -> bool:
    return (type(c) is ControlNet and linear_of(c.w1) is not None
            and type(c.w2) is nn.Linear and c.w2.bias is None)


class _Controls:
    """One or more :class:`ControlNet` that read the same input, as one fused product:
    ``(B, 1, d)`` -> logits ``(B, 1, n)``, the nets' gates side by side."""

    def __init__(self, nets: list[ControlNet]) -> None:
        self.w1 = torch.cat([c.w1.weight for c in nets])  # (Σ hidden, d)
        self.b1 = torch.cat([c.w1.bias for c in nets])
        self.w2 = torch.block_diag(*(c.w2.weight for c in nets))  # (Σ gates, Σ hidden)
        self.sources = [t for c in nets for t in (c.w1.weight, c.w1.bias, c.w2.weight)]
        self.n_gates = self.w2.size(0)

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(F.linear(x, self.w1, self.b1).relu_(), self.w2)


def _fixed(gate: Gate, offset: Offset) -> bool | None:
    """Every gate's decision where it does not depend on the control network: pinned by the
    gate's override, or one offset of ±inf for every row (``1[G(x) ± inf >= 0]`` for any
    finite logit); None where the control network decides."""
    if gate.gate_override is not None:
        return gate.gate_override >= 0.5
    if isinstance(offset, float) and math.isinf(offset):
        return offset > 0
    return None


def _decide(gate: Gate, controls: _Controls, x: Tensor,
            offset: Offset) -> tuple[Tensor | None, list[int]]:
    """Hard gates ``(B, n)`` bool of the rows ``x`` ``(B, 1, d)`` and the open rows per gate
    (the one host sync of a part's step). Decisions fixed by :func:`_fixed` run no control
    network and give no mask (every count is then 0 or B); nor does one row of float32
    logits (:func:`_one_row`), whose counts (0 or 1) say all a part reads of its mask."""
    fixed = _fixed(gate, offset)
    if fixed is not None:
        return None, [x.size(0) if fixed else 0] * controls.n_gates
    logits = controls(x)  # (B, 1, n)
    row = _one_row(logits, offset)
    if row is not None:
        return None, row
    on = gate.hard(logits[:, 0], offset)  # (B, n)
    return on, on.sum(0).tolist()


_F32 = struct.Struct("f")


def _one_row(logits: Tensor, offset: Offset) -> list[int] | None:
    """The gates (1 open, 0 closed) of one row's float32 ``logits`` ``(1, 1, n)``, read with
    one host read and compared on the host as :meth:`Gate.hard` compares them
    (``G(x) >= -δ``, eq. 2): a float offset is rounded to float32 first, as a scalar compared
    with a float32 tensor is; a per-row offset tensor's value compares as it is. At batch 1
    that is the whole decision, with no comparison op and no mask. None for more rows or
    another dtype (bfloat16 rounds the threshold otherwise): the tensor path."""
    if logits.size(0) != 1 or logits.dtype != torch.float32:
        return None
    if offset is None:
        threshold = 0.0
    elif isinstance(offset, Tensor):
        threshold = -offset.item()  # (1,): compared in the wider dtype, which a float holds
    else:
        threshold = _F32.unpack(_F32.pack(-offset))[0]  # beyond float32's range: +-inf, as cast
    return [int(v >= threshold) for v in logits.view(-1).tolist()]


def _tally(tally: StepTally | None, name: str, gate: str, on: Tensor | None,
           column: int | None, fixed_on: bool, shape: tuple[int, ...]) -> None:
    """Add to ``tally`` (if any; nothing is built otherwise) each row's open gates under
    ``name.gate``: column ``column`` of ``on`` (all of it for None), or, where the decisions
    are fixed (``on`` None), ``fixed_on`` for every gate of ``shape``."""
    if tally is None:
        return
    if on is None:
        counts = torch.full(shape, int(fixed_on), dtype=torch.long, device=tally.device)
    else:
        counts = on if column is None else on[:, column]
    tally.add(f"{name}.{gate}", counts)


def _rows(on: Tensor) -> Tensor:
    """``(N,)`` indices of the True entries of ``on`` ``(B,)``."""
    return on.nonzero().squeeze(1)


class _GatedAttention:
    """What the self- and cross-attention parts share: projections, norms, gate, queries."""

    def __init__(self, m: ConditionalAttention, norms: tuple[Norm | str, ...]) -> None:
        self.k_norm, self.v_norm, self.out_norm = norms
        self.gate, self.name = m.gate, m.name
        self.n_heads, self.d = m.n_heads, m.d_model
        with torch.no_grad():  # rows [q; k; v]: k/v alone are the slice [d:]
            self.qkv_weight = torch.cat([p.weight for p in (m.q_proj, m.k_proj, m.v_proj)])
            self.qkv_bias = torch.cat([p.bias for p in (m.q_proj, m.k_proj, m.v_proj)])
        self.qkv = float_linear(self.qkv_weight, self.qkv_bias)  # every query and key open
        self.q_fn = float_linear(m.q_proj.weight, m.q_proj.bias)  # the weights themselves
        self.out_fn = float_linear(m.out_proj.weight, m.out_proj.bias)
        self.kv = float_linear(self.qkv_weight[self.d:], self.qkv_bias[self.d:])
        self.sources = [t for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj)
                        for t in (p.weight, p.bias)]

    def _kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """LN(x W_k), LN(x W_v) of rows ``x`` ``(N, ..., d)``."""
        kv = self.kv(x)
        return _apply(self.k_norm, kv[..., : self.d]), _apply(self.v_norm, kv[..., self.d:])

    def _output(self, a: Tensor) -> Tensor:
        """LN(a) W_o of merged attention outputs ``a`` ``(N, 1, d)``."""
        return self.out_fn(_apply(self.out_norm, a))

    def _attend(self, q: Tensor, keys: CrossKeys) -> Tensor:
        """q ``(N, T, d)`` over ``keys`` (``(N, H, W, hd)``; shared by groups of rows, one
        query each: :func:`attend_keys`) -> ``LN(a) W_o`` ``(N, T, d)``."""
        return self._output(merge_heads(attend_keys(split_heads(q, self.n_heads), keys)))

    def _attend_rows(self, x: Tensor, rows: Tensor, keys: CrossKeys) -> Tensor:
        """The open queries of rows ``rows`` of ``x`` ``(B, 1, d)`` over every row's
        ``keys`` (as in :meth:`_attend`) -> ``(B, 1, d)``, zero where the query is off.

        Every row attends (the off rows with a zero query), so the keys and values are
        not gathered per step: a row's scores cost ``2·d·W`` multiply-adds, far less than
        copying its keys and values; the projections and norms run for the open rows
        only."""
        b, d = x.size(0), self.d
        q = x.new_zeros(b, 1, d).index_copy_(0, rows, self.q_fn(x.index_select(0, rows)))
        a = attend_keys(split_heads(q, self.n_heads), keys)
        y = self._output(merge_heads(a).index_select(0, rows))
        return x.new_zeros(b, 1, d).index_copy_(0, rows, y)


class GatedSelfAttention(_GatedAttention):
    """CCT self-attention of one new token per row (see the module docstring)."""

    def __init__(self, m: ConditionalAttention, norms: tuple[Norm | str, ...]) -> None:
        super().__init__(m, norms)
        self.controls = _Controls([m.q_control, m.kv_control])  # logits [q, kv]
        self.sources += self.controls.sources

    def step(self, x: Tensor, cache: StepCache, offset: Offset,
             tally: StepTally | None = None) -> Tensor | None:
        """x ``(B, 1, d)`` -> ``(B, 1, d)`` or None (every ``g_q`` off); appends this step's
        keys and values (zero rows where ``g_KV`` is off) to ``cache``; ``tally``: adds each
        row's open query and key/value gates (keys ``NAME.q``, ``NAME.kv``)."""
        b, d = x.size(0), self.d
        on, (n_q, n_kv) = _decide(self.gate, self.controls, x, offset)  # on: (B, 2)
        _tally(tally, self.name, "q", on, 0, n_q == b, (b,))
        _tally(tally, self.name, "kv", on, 1, n_kv == b, (b,))
        q = None
        if n_q == b and n_kv == b:  # everything open: one fused product
            qkv = self.qkv(x)
            q = qkv[..., :d]
            k = _apply(self.k_norm, qkv[..., d: 2 * d])
            v = _apply(self.v_norm, qkv[..., 2 * d:])
        elif n_kv == b:
            k, v = self._kv(x)
        else:
            k, v = x.new_zeros(b, 1, d), x.new_zeros(b, 1, d)
            if n_kv:
                rows = _rows(on[:, 1])
                kr, vr = self._kv(x.index_select(0, rows))
                k.index_copy_(0, rows, kr)
                v.index_copy_(0, rows, vr)
        keys, values = cache.append(split_heads(k, self.n_heads), split_heads(v, self.n_heads))
        if n_q == 0:
            return None
        own = CrossKeys(keys, values, cache.mask)  # the mask: rows that began later
        if n_q == b:
            return self._attend(self.q_fn(x) if q is None else q, own)
        return self._attend_rows(x, _rows(on[:, 0]), own)


class GatedEncoderAttention(_GatedAttention):
    """CCT self-attention of an encoder layer over whole sequences (see the module
    docstring)."""

    def __init__(self, m: ConditionalAttention, norms: tuple[Norm | str, ...]) -> None:
        super().__init__(m, norms)
        self.controls = _Controls([m.q_control, m.kv_control])  # logits [q, kv]
        self.sources += self.controls.sources

    def encode(self, x: Tensor, valid: Tensor | None, offset: Offset,
               tally: StepTally | None = None) -> Tensor | None:
        """x ``(B, S, d)``, valid ``(B, S)`` (None: no padding) -> ``(B, S, d)`` (0 at gated-off
        queries), or None when every query is off. ``tally``: adds each row's open queries
        and projected keys/values, ``(B,)`` each (keys ``NAME.q``, ``NAME.kv``)."""
        b, s, d = x.shape
        fixed = _fixed(self.gate, offset)
        if fixed is False:
            if tally is not None:
                tally.add(f"{self.name}.q", 0)
                tally.add(f"{self.name}.kv", 0)
            return None
        q_on = kv_on = valid  # None: every token
        if fixed is None:
            on = self._decisions(x, valid, offset)  # (B, S, 2), False at padding
            q_on, kv_on = on[..., 0], on[..., 1]
        n_q = n_kv = b * s
        if q_on is not None:  # keys no query reads are not projected
            kv_on = kv_on & q_on.any(1, keepdim=True)
            n_q, n_kv = torch.stack([q_on.sum(), kv_on.sum()]).tolist()  # one host sync
        if tally is not None:
            tally.add(f"{self.name}.q", s if q_on is None else q_on.sum(1))
            tally.add(f"{self.name}.kv", s if kv_on is None else kv_on.sum(1))
        if n_q == 0:
            return None
        if n_q == n_kv == b * s:  # every token open, no padding: one fused product
            qkv = self.qkv(x)
            k = _apply(self.k_norm, qkv[..., d: 2 * d])
            v = _apply(self.v_norm, qkv[..., 2 * d:])
            return self._attend(qkv[..., :d], CrossKeys(split_heads(k, self.n_heads),
                                                        split_heads(v, self.n_heads)))
        keys, values = self._keys_values(x, None if n_kv == b * s else kv_on)
        mask = None if valid is None else valid[:, None, None, :]
        if n_q == b * s:
            return self._attend(self.q_fn(x), CrossKeys(keys, values, mask))
        qp = Packing.of(q_on)  # the open queries, packed per sequence
        q = self.q_fn(x.reshape(b * s, d).index_select(0, qp.flat))  # (Nq, d)
        if qp.n_rows < b:
            keys, values = keys.index_select(0, qp.rows), values.index_select(0, qp.rows)
            mask = None if mask is None else mask.index_select(0, qp.rows)
        q = split_heads(qp.pack(q), self.n_heads)  # (B', H, W, hd)
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        y = self._output(qp.unpack(merge_heads(a)))  # (Nq, d): no product on packing slots
        return x.new_zeros(b * s, d).index_copy_(0, qp.flat, y).view(b, s, d)

    def _decisions(self, x: Tensor, valid: Tensor | None, offset: Offset) -> Tensor:
        """Hard gates ``(B, S, 2)`` (query, key/value) of the tokens of ``x`` ``(B, S, d)``,
        False at padding (``valid`` ``(B, S)``; None: none): the control nets read the valid
        tokens only. A batch of sentences in arrival order is about half padding (32
        random SST-2 dev sentences: 51% of the padded tokens are real), and at a small budget
        the control nets were a quarter of the encoder's time."""
        if valid is None:
            return self.gate.hard(self.controls(x), offset)
        b, s, d = x.shape
        idx = valid.reshape(-1).nonzero().squeeze(1)  # (N,) the valid tokens
        if isinstance(offset, Tensor):  # one per row -> one per token
            offset = offset.index_select(0, torch.div(idx, s, rounding_mode="floor"))
        on = torch.zeros(b * s, 2, dtype=torch.bool, device=x.device)
        on[idx] = self.gate.hard(self.controls(x.reshape(b * s, d).index_select(0, idx)),
                                 offset)
        return on.view(b, s, 2)

    def _keys_values(self, x: Tensor, kv_on: Tensor | None) -> tuple[Tensor, Tensor]:
        """Keys and values of ``x`` ``(B, S, d)`` in heads, ``(B, H, S, hd)`` each: LN(x W_k)
        and LN(x W_v) at the tokens ``kv_on`` ``(B, S)`` (None: every one), 0 at the others
        (not projected)."""
        b, s, d = x.shape
        if kv_on is None:
            k, v = self._kv(x)
        else:
            k, v = x.new_zeros(b * s, d), x.new_zeros(b * s, d)
            rows = _rows(kv_on.reshape(-1))
            if rows.numel():
                kr, vr = self._kv(x.reshape(b * s, d).index_select(0, rows))
                k.index_copy_(0, rows, kr)
                v.index_copy_(0, rows, vr)
        return (split_heads(k.view(b, s, d), self.n_heads),
                split_heads(v.view(b, s, d), self.n_heads))

    def encode_first(self, x: Tensor, valid: Tensor | None, offset: Offset) -> Tensor | None:
        """:meth:`encode`'s output at each row's first token alone, ``(B, 1, d)`` (what a
        first-token head reads), or None when no row's first query is open: the keys and
        values of the rows whose first query is open, that query, nothing else. Counts no
        gates."""
        b, s, d = x.shape
        fixed = _fixed(self.gate, offset)
        if fixed is False:
            return None
        kv_on, first = valid, None  # None: every token; every row's first query open
        if fixed is None:
            on = self._decisions(x, valid, offset)  # (B, S, 2), False at padding
            first, kv_on = on[:, 0, 0], on[..., 1]
            kv_on = kv_on & first[:, None]
            rows = _rows(first)
            if not rows.numel():
                return None
        keys, values = self._keys_values(x, kv_on)
        mask = None if valid is None else valid[:, None, None, :]
        if first is None:
            return self._attend(self.q_fn(x[:, :1]), CrossKeys(keys, values, mask))
        return self._attend_rows(x[:, :1], rows, CrossKeys(keys, values, mask))


class GatedCrossAttention(_GatedAttention):
    """CCT cross-attention of one new token per row over the encoder output's on keys,
    packed once by :meth:`start` (see the module docstring)."""

    shares_keys = True
    """Its step attends keys shared by groups of rows (:func:`attend_keys`)."""

    def __init__(self, m: ConditionalAttention, norms: tuple[Norm | str, ...]) -> None:
        super().__init__(m, norms)
        self.q_control = _Controls([m.q_control])
        self.kv_control = _Controls([m.kv_control])
        self.sources += self.q_control.sources + self.kv_control.sources

    def start(self, memory: Tensor, pad_mask: Tensor, offset: Offset,
              tally: StepTally | None = None) -> CrossKeys:
        """memory ``(B, S, d)``, pad_mask ``(B, S)`` bool (True at padding) -> the on keys
        of every row packed to the left, behind one zero slot that stands for the row's off
        keys (score bias ``log n_off``; ``-inf`` when none is off); ``tally``: adds each
        row's on keys (key ``NAME.keys``)."""
        b, s, d = memory.shape
        fixed = _fixed(self.gate, offset)
        if fixed is None:
            on = self.gate.hard(self.kv_control(memory)[..., 0], offset) & ~pad_mask  # (B, S)
        else:
            on = ~pad_mask if fixed else torch.zeros_like(pad_mask)
        if tally is not None:
            tally.add(f"{self.name}.keys", on.sum(1))
        n_on = int(on.sum())
        if n_on == b * s:  # nothing off, no padding: every key as it is
            k, v = self._kv(memory)
            return CrossKeys(split_heads(k, self.n_heads), split_heads(v, self.n_heads))
        k, v = memory.new_zeros(b, s, d), memory.new_zeros(b, s, d)
        if n_on:
            flat = on.reshape(-1).nonzero().squeeze(1)
            kr, vr = self._kv(memory.reshape(b * s, d).index_select(0, flat))
            k.view(b * s, d).index_copy_(0, flat, kr)
            v.view(b * s, d).index_copy_(0, flat, vr)
        allowed = (~pad_mask)[:, None, None, :]
        packed = PackedKeys.of(k, v, on, allowed, lambda t: split_heads(t, self.n_heads))
        zero = packed.k.new_zeros(b, self.n_heads, 1, packed.k.size(-1))
        bias = torch.where(packed.n_off > 0, packed.n_off.log(),
                           torch.full_like(packed.n_off, -math.inf))  # (B,)
        slots = torch.zeros(packed.valid.shape, dtype=k.dtype, device=k.device)
        slots.masked_fill_(~packed.valid, -math.inf)  # (B, W)
        mask = torch.cat([bias[:, None], slots], 1)[:, None, None, :]  # (B, 1, 1, 1 + W)
        return CrossKeys(torch.cat([zero, packed.k], 2), torch.cat([zero, packed.v], 2), mask)

    def step(self, x: Tensor, keys: CrossKeys, offset: Offset,
             tally: StepTally | None = None) -> Tensor | None:
        """x ``(B, 1, d)`` -> ``(B, 1, d)`` or None (every ``g_q`` off); ``tally``: adds each
        row's open query gate (key ``NAME.q``)."""
        b = x.size(0)
        on, (n_q,) = _decide(self.gate, self.q_control, x, offset)  # on: (B, 1)
        _tally(tally, self.name, "q", on, 0, n_q == b, (b,))
        if n_q == 0:
            return None
        if n_q == b:
            return self._attend(self.q_fn(x), keys)
        return self._attend_rows(x, _rows(on[:, 0]), keys)


class GatedFeedForward:
    """CCT feed-forward of one new token per row (eq. 15; see the module docstring)."""

    def __init__(self, m: ConditionalFeedForward, eps: float,
                 out_norms: list[Norm] | None) -> None:
        pieces = list(m.pieces)
        self.gate, self.eps, self.m, self.name = m.gate, eps, len(pieces), m.name
        self.width = pieces[0].ffn.fc1.out_features
        self.control = _Controls([m.control])
        with torch.no_grad():  # fold LN_in_i's affine into fc1_i: W1 diag(w), W1 b + c
            self.w1 = torch.cat([p.ffn.fc1.weight * p.in_norm.weight for p in pieces])
            self.b1 = torch.cat([p.ffn.fc1.weight @ p.in_norm.bias + p.ffn.fc1.bias
                                 for p in pieces])
            self.w2 = torch.stack([p.ffn.fc2.weight.t() for p in pieces])  # (M, f, d)
            self.b2 = torch.stack([p.ffn.fc2.bias for p in pieces])[:, None]  # (M, 1, d)
        self.w2_rows: Tensor | None = None  # (M, d, f), made at the first call on the left
        self.b2_column = self.b2.transpose(1, 2)  # (M, d, 1), a view
        cpu = self.w2.device.type == "cpu" and self.w2.dtype == torch.float32
        self.second_layouts = Layouts(2 if cpu else 1)  # the stack; the weights on the left
        f, spans = self.width, [(lo, hi) for lo in range(self.m)
                                for hi in range(lo + 1, self.m + 1)]
        # each span of pieces' first layers as one product, on views of the folded weights
        # (:func:`float_linear` picks the layout; (0, M): every piece)
        self._firsts: dict[tuple[int, int], LinearFn] = {
            (lo, hi): float_linear(self.w1[lo * f: hi * f], self.b1[lo * f: hi * f])
            for lo, hi in spans}
        self.out_norms = out_norms
        if out_norms is not None:
            self.out_w = torch.stack([n.weight for n in out_norms])[:, None]  # (M, 1, d)
            self.out_bs = torch.stack([n.bias for n in out_norms])[:, None]  # (M, 1, d)
            self._out_biases = {(lo, hi): self.out_bs[lo:hi].sum((0, 1))  # (d,) a span
                                for lo, hi in spans}
            self.out_eps = out_norms[0].eps
        self.sources = [t for p in pieces for t in (p.ffn.fc1.weight, p.ffn.fc1.bias,
                                                     p.in_norm.weight, p.in_norm.bias,
                                                     p.ffn.fc2.weight, p.ffn.fc2.bias)]
        self.sources += self.control.sources + [t for n in out_norms or () for t in
                                                (n.weight, n.bias)]

    def _piece(self, i: int, n: Tensor) -> Tensor:
        """Piece i on normalised rows ``n`` ``(N, 1, d)`` -> ``(N, 1, d)``."""
        f = self.width
        h = F.linear(n, self.w1[i * f: (i + 1) * f], self.b1[i * f: (i + 1) * f]).relu_()
        y = torch.addmm(self.b2[i], h[:, 0], self.w2[i])[:, None]
        return y if self.out_norms is None else self.out_norms[i](y)

    def _fused(self, n: Tensor, on: Tensor | None = None, lo: int = 0,
               hi: int | None = None) -> Tensor:
        """Pieces ``lo`` to ``hi - 1`` (default every piece) on normalised rows ``n``
        ``(N, 1, d)`` as fused products -> ``(N, 1, d)``: the sum of their outputs, each
        times its gate ``on`` ``(N, M)`` (None: every one of them open; the pieces outside
        the span are closed for every row and do not run)."""
        hi = self.m if hi is None else hi
        b, d = n.size(0), n.size(-1)
        h = self._first(n[:, 0], lo, hi).relu_().view(b, hi - lo, self.width)  # (N, k, f)
        y = self._second(h, lo, hi)  # (k, N, d)
        if self.out_norms is not None:
            y = F.layer_norm(y, (d,), None, None, self.out_eps)
            if on is None:
                return ((y * self.out_w[lo:hi]).sum(0) + self._out_biases[(lo, hi)])[:, None]
            y = torch.addcmul(self.out_bs[lo:hi], y, self.out_w[lo:hi])
        if on is not None:
            y = y * on[:, lo:hi].t()[:, :, None].to(y.dtype)
        return y.sum(0)[:, None]

    def _first(self, x: Tensor, lo: int, hi: int) -> Tensor:
        """The first layers of pieces ``lo`` to ``hi - 1``, one product: x ``(N, d)`` ->
        ``(N, (hi - lo)·f)``."""
        return self._firsts[(lo, hi)](x)

    def _second(self, h: Tensor, lo: int = 0, hi: int | None = None) -> Tensor:
        """The second layers of pieces ``lo`` to ``hi - 1`` (default every piece): h
        ``(N, k, f)`` -> ``(k, N, d)``, in the layout that runs fastest here at the call's
        size class and span (:class:`~dynaseq.nn.layouts.Layouts`): ``h_i · W2_iᵀ`` against
        the ``(M, f, d)`` stack, or (float32 on the CPU) ``W2_i · h_iᵀ`` with each piece's
        ``(d, f)`` weight (a copy, made at the first call that tries it) on the left, then
        transposed (a view).

        Why both: 1 thread, M = 4 pieces of 256 x 256, weights out of L2 as in a decode, at
        one row the left form took 63 against 159 us on an AMD EPYC AVX-512, and the stack
        41 against 82 on an Intel Xeon AVX-512 (from 8 rows on the stack won on both)."""
        hi = self.m if hi is None else hi
        return self.second_layouts.run((call_key(h.size(0)), hi - lo), self._second_as, h,
                                       lo, hi)

    def _second_as(self, layout: int, h: Tensor, lo: int, hi: int) -> Tensor:
        """:meth:`_second` in ``layout``: 0 the stack, 1 the weights on the left."""
        if layout == 0:
            return torch.baddbmm(self.b2[lo:hi], h.transpose(0, 1), self.w2[lo:hi])
        w2_rows = self.w2_rows
        if w2_rows is None:  # a race only makes the same copy twice
            w2_rows = self.w2_rows = self.w2.transpose(1, 2).contiguous()
        return torch.baddbmm(self.b2_column[lo:hi], w2_rows[lo:hi],
                             h.permute(1, 2, 0)).transpose(1, 2)

    FUSE_WASTE = 2.0
    """Mixed gates run the fused products over the rows with any piece open (the closed
    pieces' outputs multiplied by 0) when that computes at most this many times the open
    pieces' work; otherwise each piece runs on its own open rows. One fused pass costs a
    few operations where the pieces cost a few each, which at decoding's small batches
    outweighs some wasted arithmetic (a mixed-budget batch: rows at budget 1 open every
    piece, the others few). Above :attr:`FUSE_ROWS` rows (an encoder's tokens at batch 32)
    the arithmetic dominates and no waste is allowed: measured on a CCT-BERT at budget .8,
    SST-2 dev, 2 threads, AMD EPYC AVX2: 2x waste cost 13% at batch 32 (~800 token rows)
    and saved 6% at batch 1 (~33)."""

    SPANS = True
    """Mixed gates fuse the span of pieces from the first open to the last (see the module
    doc; False: every piece, the closed ones times 0, as before spans; a benchmark's and a
    test's switch). Measured with ``benchmarks/ffn_spans.py`` (``ffn_spans.md``)."""

    FUSE_ROWS = 128
    """Rows with an open piece up to which :attr:`FUSE_WASTE` applies (decoding's batches,
    beam 4 x 32 included)."""

    def step(self, x: Tensor, offset: Offset, tally: StepTally | None = None
             ) -> Tensor | None:
        """x ``(B, 1, d)`` -> ``(B, 1, d)``, or None when no piece is open for any row;
        ``tally``: adds each row's open pieces, ``(B, M)`` (key ``NAME.pieces``)."""
        b, d = x.size(0), x.size(-1)
        fixed = _fixed(self.gate, offset)
        if fixed is not None:
            on, counts, n_any = None, [b if fixed else 0] * self.m, b if fixed else 0
        else:  # the part's one host sync: open rows per piece, rows with any piece open
            logits = self.control(x)  # (B, 1, M)
            row = _one_row(logits, offset)
            if row is not None:  # one row: a mask only where the pieces differ or are counted
                counts, n_any = row, int(any(row))
                on = (None if tally is None and sum(row) in (0, self.m) else
                      torch.tensor([row], dtype=torch.bool, device=x.device))
            else:
                on = self.gate.hard(logits[:, 0], offset)  # (B, M)
                *counts, n_any = torch.cat([on.sum(0), on.any(1).sum().view(1)]).tolist()
        _tally(tally, self.name, "pieces", on, None, bool(fixed), (b, self.m))
        if not n_any:
            return None
        n = F.layer_norm(x, (d,), None, None, self.eps)  # LN_in without its affine
        if all(c == b for c in counts):  # every piece for every row
            return self._fused(n)
        used = [i for i, c in enumerate(counts) if c]
        # the pieces outside the span are closed for every row
        lo, hi = (used[0], used[-1] + 1) if self.SPANS else (0, self.m)
        span = hi - lo  # one piece: its own products (below) cost less than a span's
        if span > 1 and all(counts[i] == b for i in range(lo, hi)):  # open for every row
            return self._fused(n, None, lo, hi)
        waste = self.FUSE_WASTE if n_any <= self.FUSE_ROWS else 1.0
        if span > 1 and n_any * span <= waste * sum(counts):
            if n_any == b:
                return self._fused(n, on, lo, hi)
            rows = _rows(on.any(1))
            y = self._fused(n.index_select(0, rows), on.index_select(0, rows), lo, hi)
            return x.new_zeros(b, 1, d).index_copy_(0, rows, y)
        out = x.new_zeros(b, 1, d)
        for i, c in enumerate(counts):
            if c == b:
                out += self._piece(i, n)
            elif c:
                rows = _rows(on[:, i])
                out.index_add_(0, rows, self._piece(i, n.index_select(0, rows)))
        return out


def _attention_part(m: nn.Module, role: str
                    ) -> GatedSelfAttention | GatedCrossAttention | GatedEncoderAttention | None:
    assert isinstance(m, ConditionalAttention)
    norms = tuple(_norm_or_identity(n) for n in (m.k_norm, m.v_norm, m.out_norm))
    if (role == "ffn" or None in norms
            or any(linear_of(p) is None for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj))
            or not (_control_ok(m.q_control) and _control_ok(m.kv_control))):
        return None
    kinds = {"self": GatedSelfAttention, "cross": GatedCrossAttention,
             "encoder": GatedEncoderAttention}
    return kinds[role](m, norms)


def _ffn_part(m: nn.Module, role: str) -> GatedFeedForward | None:
    assert isinstance(m, ConditionalFeedForward)
    pieces = list(m.pieces)
    in_norms = [Norm.of(p.in_norm) for p in pieces]
    outs = [_norm_or_identity(p.out_norm) for p in pieces]
    if (role != "ffn" or not _control_ok(m.control) or None in in_norms or None in outs
            or len({n.eps for n in in_norms}) != 1
            or any(linear_of(p.ffn.fc1) is None or linear_of(p.ffn.fc2) is None
                   for p in pieces)
            or len({p.ffn.fc1.out_features for p in pieces}) != 1):
        return None
    if all(o == _IDENTITY for o in outs):
        out_norms = None
    elif _IDENTITY in outs or len({o.eps for o in outs}) != 1:
        return None
    else:
        out_norms = outs
    return GatedFeedForward(m, in_norms[0].eps, out_norms)


register_lean(ConditionalAttention, _attention_part)
register_lean(ConditionalFeedForward, _ffn_part)
