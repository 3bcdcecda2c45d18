"""CCT conditional attention (Bapna, Arivazhagan, Firat 2020, section 3.1, eq. 12-13).

Two control networks gate one attention sub-layer:

* ``g_KV`` gates, per attended token y, the key/value projections (eq. 12)::

      K^c = g_KV(Y) · LN(Y W_k),   V^c = g_KV(Y) · LN(Y W_v)

* ``g_q`` gates, per query token x_t, the query projection, the attention and the output
  projection (eq. 13)::

      q_t = x_t W_q,   a_t = MultiHeadAtten(K^c, V^c, q_t),   out_t = g_q(x_t) · LN(a_t) W_o

  (``x`` already is LN(x) of the pre-LN layer; the layer adds the residual. The paper's
  Dropout(a_t) is this library's attention-probability dropout, as in the dense
  :class:`~dynaseq.nn.MultiHeadAttention`.)

**What a gated-off key/value token means.** Eq. 12 multiplies its key and value by its
gate, so with ``g_KV = 0`` it becomes a *zero key/value row*: it stays in the softmax with
score ``q·0 = 0`` and adds nothing to the output, i.e. for query t::

    a_t = Σ_{j on} e^{s_tj} v_j / (Σ_{j on} e^{s_tj} + n_off(t) · e^0)

where ``n_off(t)`` counts the keys t may attend (padding and causal masks allow them) whose
gate is off. This module implements exactly that, so hard inference is the exact 0/1 limit
of the soft training computation, not an approximation (excluding the token from the
softmax would change the denominator and differ from what training saw). At inference the
off rows are not computed: their projections are skipped, their score is known to be 0 and
enters only as the count ``n_off``, so the score/value products run over the "on" keys only.

**Training** (``self.training``): the dense computation of eq. 12-13 with soft noisy gates
(:class:`~dynaseq.techniques.cct.gating.Gate`), scaled dot-product attention as in the dense layer.

**Inference**: hard 0/1 gates ``g = 1[G(x) + δ_b >= 0]`` (eq. 2; δ_b: the call's gate offset
of row b, the same for its queries and the keys/values it attends, 0 if none), and work for
gated-off tokens is not executed:

1. K/V projections and their LayerNorms run only on tokens whose ``g_KV`` is on (and that a
   query can use: keys every query is masked from, i.e. padding, and, without a cache, keys
   of sequences with no open query are skipped too); the others are zero rows.
2. The query projection runs only on tokens whose ``g_q`` is on; their queries and the "on"
   keys are packed per sequence (:class:`~dynaseq.techniques.cct.packing.Packing`) and attend;
   the output LayerNorm and projection run on those queries only and are scattered back.
   A gated-off query's output is exactly 0, so the residual passes unchanged.
3. Keys are packed only where that narrows them: when a sequence with an open query has
   every key on, the packed width would be S anyway, so attention runs over all keys (plain
   scaled-dot-product attention), the off ones entering as the zero rows they are. A static
   (cross-attention) cache packs its on keys once (:class:`PackedKeys`) for every step.
4. Fast paths (``fast_paths=True``, the default): one host sync counts the open queries,
   one the open K/V tokens. A call with every query off (always the case for a one-token
   decoding step whose ``g_q`` is off) enters neither the query/output projections nor the
   attention and returns zeros; K/V tokens all off project nothing (a cache still records
   them, as the zero rows they are), all on are projected as they are, without
   gather/scatter; every query open over a sequence with every key on runs plain attention.
   ``fast_paths=False`` (set at construction) takes the general gather/pack/scatter path
   for every call with an open token; outputs and MAC records are the same.

Incremental decoding needs a :class:`GatedKVCache`: it keeps the keys/values (zero rows where
off) and which keys are on, so step-by-step decoding equals the full-sequence pass.

Gate traces (``AuxOutputs.traces["cct.gates"]``) hold ``q`` per query and ``kv`` per new
attended token: the soft gates in training, 0/1 "ran" at inference. At inference a
:class:`~dynaseq.techniques.cct.gating.MacsRecord` per call gives the MACs that ran
(:meth:`ConditionalAttention.realized_macs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.attention import KVCache
from dynaseq.nn.int8 import Int8Linear
from dynaseq.nn.outputs import MACS_TRACE, AuxOutputs, MacsRecord
from dynaseq.techniques.cct.gating import ControlNet, Gate, NoiseSchedule, trace_gate
from dynaseq.techniques.cct.packing import Packing, scatter_rows


@dataclass
class GatedKVCache(KVCache):
    """A :class:`~dynaseq.nn.KVCache` that also remembers which cached keys are on.

    k, v: ``(B, S, d_model)``, heads not split (so the rows of the "on" keys are picked with
    one ``index_select``); zero rows where the key is off.
    on: ``(B, S)`` bool, True where the key/value row was computed (hard inference); ``None``
    for caches filled in training mode, whose rows already carry their soft gates.
    """

    on: Tensor | None = None
    packed: PackedKeys | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.size(1)

    def reorder(self, index: Tensor) -> None:
        super().reorder(index)
        if self.on is not None:
            self.on = self.on.index_select(0, index)
        if self.packed is not None:
            self.packed = self.packed.select(index)


@dataclass
class PackedKeys:
    """A static cache's on keys packed to the left per sequence, once for every step.

    k, v: ``(B, H, W, d_head)`` contiguous; W is the most on keys of any sequence.
    valid: ``(B, W)`` bool, True at real slots.
    n_off: ``(B,)`` float, keys every query may attend that are off (zero rows of the
    softmax; the mask of a static cache does not depend on the query).
    """

    k: Tensor
    v: Tensor
    valid: Tensor
    n_off: Tensor

    @classmethod
    def of(cls, k: Tensor, v: Tensor, on: Tensor, allowed: Tensor | None,
           split: Callable[[Tensor], Tensor]) -> PackedKeys:
        """k, v ``(B, S, d)``; on ``(B, S)``; allowed broadcastable to ``(B, 1, 1, S)``;
        ``split``: ``(B, W, d)`` -> ``(B, H, W, d_head)``."""
        assert allowed is None or allowed.size(1) == allowed.size(2) == 1, "query-independent"
        kp = Packing.of(on, rows=torch.arange(on.size(0), device=on.device))
        may = on.new_ones(()) if allowed is None else allowed[:, 0, 0, :]
        n_off = (may & ~on).sum(1).to(k.dtype)
        return cls(split(kp.select(k)).contiguous(), split(kp.select(v)).contiguous(),
                   kp.valid, n_off)

    @property
    def width(self) -> int:
        return self.valid.size(1)

    def select(self, rows: Tensor) -> PackedKeys:
        return PackedKeys(self.k.index_select(0, rows), self.v.index_select(0, rows),
                          self.valid.index_select(0, rows), self.n_off.index_select(0, rows))


def _linear_macs(m: nn.Module, n: int) -> int:
    # nn.Linear, or its int8 version (dynaseq.nn.int8)
    assert isinstance(m, (nn.Linear, Int8Linear)), "MAC counts assume dense projections"
    return n * m.in_features * m.out_features


def allowed_mask(attn_mask: Tensor | None, is_causal: bool, n_queries: int, n_keys: int,
                 past: int, device: torch.device) -> Tensor | None:
    """Combine a padding/attention mask and causality into one bool mask, True = may attend.

    attn_mask: bool, broadcastable to ``(B, H, T, S)``. Query t sits at absolute position
    ``past + t`` and may see keys ``<= past + t`` when causal. Returns a 4-d mask
    broadcastable to ``(B, H, T, S)``, or None when everything is allowed.
    """
    mask = None
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError(f"attn_mask must be bool (True = attend), got {attn_mask.dtype}")
        mask = attn_mask
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    if is_causal and past < n_keys - 1:  # else the first query already sees every key
        q_pos = torch.arange(n_queries, device=device) + past
        causal = torch.arange(n_keys, device=device)[None, :] <= q_pos[:, None]  # (T, S)
        mask = causal[None, None] if mask is None else mask & causal
    return mask


def attend_with_zero_rows(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor,
                          n_off: Tensor) -> Tensor:
    """softmax(q kᵀ/√d_head) v over the given keys plus ``n_off`` zero key/value rows.

    q ``(B, H, Q, hd)``, k/v ``(B, H, K, hd)``, allowed ``(B, H|1, Q, K)`` bool, n_off
    ``(B, H|1, Q, 1)`` float: how many zero rows (score 0, value 0) each query also sees.
    Returns ``(B, H, Q, hd)``; a query that sees no key at all gets 0.
    """
    if k.size(2) == 0:
        return q.new_zeros(q.shape)
    scores = (q @ k.transpose(-1, -2)) * q.size(-1) ** -0.5  # (B, H, Q, K)
    scores = scores.masked_fill(~allowed, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    m = torch.where(n_off > 0, m.clamp_min(0), m)  # the zero rows' score 0 joins the max
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    denom = p.sum(-1, keepdim=True) + n_off * torch.exp(-m)
    return (p @ v) / denom.clamp_min(torch.finfo(denom.dtype).tiny)


class ConditionalAttention(nn.Module):
    """Multi-head attention gated per token by ``g_q`` and ``g_KV`` (CCT eq. 12-13).

    Drop-in for :class:`~dynaseq.nn.MultiHeadAttention` inside ``EncoderLayer`` /
    ``DecoderLayer`` (same ``forward`` signature); see the module docstring for the exact
    semantics. Build it with :func:`conditional_attention`.

    Args:
        d_model, n_heads: width and heads (``d_model % n_heads == 0``).
        q_proj, k_proj, v_proj, out_proj: ``nn.Linear(d_model, d_model)`` projections.
        q_control, kv_control: :class:`ControlNet` with one gate each.
        gate: logits -> gates (noise schedule, hard threshold, override).
        k_norm, v_norm, out_norm: the LayerNorms of eq. 12-13 (``nn.Identity()`` turns the
            layer into plain attention, e.g. to compare with a dense layer).
        dropout: attention-probability dropout (training only).
        name: sub-layer name carried by its traces (see ``name_conditional_sublayers``).
        fast_paths: at inference, a call whose queries are all off returns zeros without
            entering the query/output projections or the attention, K/V tokens all off or
            all on skip the gather/scatter, and all-open queries over all-on keys run plain
            attention (see the module docstring); False forces the general gather/pack/
            scatter path (tests and benchmarks compare the two).
    """

    def __init__(self, d_model: int, n_heads: int, q_proj: nn.Module, k_proj: nn.Module,
                 v_proj: nn.Module, out_proj: nn.Module, *, q_control: ControlNet,
                 kv_control: ControlNet, gate: Gate, k_norm: nn.Module, v_norm: nn.Module,
                 out_norm: nn.Module, dropout: float = 0.0, name: str = "attention",
                 fast_paths: bool = True) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if q_control.n_gates != 1 or kv_control.n_gates != 1:
            raise ValueError("q_control and kv_control must each produce one gate per token, "
                             f"got {q_control.n_gates} and {kv_control.n_gates}")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj
        self.q_control, self.kv_control, self.gate = q_control, kv_control, gate
        self.k_norm, self.v_norm, self.out_norm = k_norm, v_norm, out_norm
        self.dropout = dropout
        self.name = name
        self.fast_paths = fast_paths

    def _split(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, hd)

    def _merge(self, x: Tensor) -> Tensor:
        b, _, t, _ = x.shape
        return x.transpose(1, 2).reshape(b, t, self.d_model)  # (B, T, d)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, attn_mask: Tensor | None = None,
                is_causal: bool = False, cache: KVCache | None = None,
                aux: AuxOutputs | None = None, gate_offset: Tensor | None = None) -> Tensor:
        """x ``(B, T, d)`` queries; keys/values from ``memory`` ``(B, S, d)`` or ``x``.

        attn_mask: bool, broadcastable to ``(B, H, T, S)``, True where attention is allowed.
        is_causal: query t attends keys at positions ``<= t`` (after any cached ones).
        cache: a :class:`GatedKVCache`, updated in place (``static=True``: filled once).
        gate_offset: ``(B,)`` per-row inference offsets of both gates (see
            :class:`~dynaseq.techniques.cct.gating.Gate`); None: no offset.
        Returns ``(B, T, d)``, exactly 0 at gated-off query tokens (at inference; in
        training, where the gate is exactly 0).
        """
        if cache is not None and not isinstance(cache, GatedKVCache):
            raise TypeError("ConditionalAttention needs a GatedKVCache for incremental decoding "
                            f"(it records which keys are on), got {type(cache).__name__}")
        if self.training:
            return self._forward_soft(x, memory, attn_mask, is_causal, cache, aux)
        return self._forward_hard(x, memory, attn_mask, is_causal, cache, aux, gate_offset)

    # -- training: dense, soft gates ------------------------------------------------------------

    def _forward_soft(self, x: Tensor, memory: Tensor | None, attn_mask: Tensor | None,
                      is_causal: bool, cache: GatedKVCache | None,
                      aux: AuxOutputs | None) -> Tensor:
        q_logits = self.q_control(x)
        g_q = self.gate(q_logits)  # (B, T, 1)
        past = cache.length if cache is not None and not cache.static else 0
        g_kv = b_kv = None
        if cache is not None and cache.static and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            src = x if memory is None else memory
            kv_logits = self.kv_control(src)
            g_kv = self.gate(kv_logits)  # (B, S, 1)
            b_kv = self.gate.for_budget(kv_logits, g_kv)
            k = g_kv * self.k_norm(self.k_proj(src))  # (B, S, d)
            v = g_kv * self.v_norm(self.v_proj(src))
            if cache is not None:
                k, v, _ = _store(cache, k, v, None)
        allowed = allowed_mask(attn_mask, is_causal, x.size(1), k.size(1), past, x.device)
        out = g_q * self._attend_all(x, k, v, allowed)  # (B, T, d)
        if aux is not None:
            self._trace(aux, self.gate.for_budget(q_logits, g_q), b_kv, allowed, k.size(1),
                        memory is not None)
        return out

    # -- inference: hard gates, gated-off work skipped ------------------------------------------

    def _forward_hard(self, x: Tensor, memory: Tensor | None, attn_mask: Tensor | None,
                      is_causal: bool, cache: GatedKVCache | None,
                      aux: AuxOutputs | None, gate_offset: Tensor | None) -> Tensor:
        b, t, d = x.shape
        q_on = self.gate(self.q_control(x), gate_offset)[..., 0].bool()  # (B, T)
        past = cache.length if cache is not None and not cache.static else 0
        kv_ran = None
        if cache is not None and cache.static and cache.k is not None:
            if cache.on is None:
                raise ValueError("this cache was filled in training mode; start a new one")
            k, v, key_on = cache.k, cache.v, cache.on
        else:
            src = x if memory is None else memory
            kv_ran = self.gate(self.kv_control(src), gate_offset)[..., 0].bool()  # (B, S)
            if attn_mask is not None and (cache is None or cache.static):
                kv_ran = kv_ran & _attendable(attn_mask, b, src.size(1))
            if cache is None:  # nobody else will read these keys
                kv_ran = kv_ran & q_on.any(1, keepdim=True)
            k, v = self._project_kv(src, kv_ran)  # (B, S, d), zero rows where off
            key_on = kv_ran
            if cache is not None:
                k, v, key_on = _store(cache, k, v, kv_ran)
        s = k.size(1)
        allowed = allowed_mask(attn_mask, is_causal, t, s, past, x.device)  # None: no mask
        # Fast paths (one host sync counts the open queries): with every query off nothing
        # attends and the sub-layer returns zeros; with every query open and a sequence whose
        # keys are all on, packing would not narrow anything, and attention runs over all
        # keys (the off ones as the zero rows they are: the same products, no packing).
        key_width = None  # packed over the open sequences (realized_macs' default)
        n_q = int(q_on.sum()) if self.fast_paths else -1  # -1: not counted (general path)
        if n_q == 0:
            out = x.new_zeros(b * t, d)
        elif n_q == b * t and int(key_on.sum(1).max()) == s:
            out = self._attend_all(x, k, v, allowed).reshape(b * t, d)
        else:
            out = x.new_zeros(b * t, d)
            if bool(q_on.any()):
                qp = Packing.of(q_on)  # the B' sequences with an open query
                if int(key_on.sum(1).index_select(0, qp.rows).max()) == s:
                    y = self._attend_packed_queries(x, k, v, allowed, qp)
                elif cache is not None and cache.static and (allowed is None
                                                             or allowed.size(2) == 1):
                    if cache.packed is None:  # packed once; every later step reuses it
                        cache.packed = PackedKeys.of(k, v, key_on, allowed, self._split)
                    key_width = cache.packed.width
                    y = self._attend_static_packed(x, cache.packed, qp)
                else:
                    y = self._attend_packed(x, k, v, allowed, key_on, qp)
                out.index_copy_(0, qp.flat, y.to(out.dtype))  # (autocast: y lower)
        if aux is not None:
            dtype = x.dtype
            self._trace(aux, q_on[..., None].to(dtype),
                        None if kv_ran is None else kv_ran[..., None].to(dtype),
                        allowed, s, memory is not None)
            rows = None if cache is not None else partial(self._valid_rows, q_on, kv_ran,
                                                          attn_mask)
            aux.add_trace(MACS_TRACE, MacsRecord(
                self.name, self.realized_macs(q_on, kv_ran, key_on, key_width=key_width),
                self.realized_macs_per_row(q_on, kv_ran, key_on),
                None if rows is None else rows(None, None, True),
                rows=rows, keys_from_memory=memory is not None))
        return out.view(b, t, d)

    def _attend_packed_queries(self, x: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None,
                               qp: Packing) -> Tensor:
        """Open queries packed per sequence (``qp``) attend over every key of their sequence,
        the off keys as zero rows of ``k``/``v`` (for when packing the keys would not narrow
        them). Returns ``(Nq, d)``, the open queries' outputs in ``qp.flat`` order."""
        b, t, d = x.shape
        q = self.q_proj(x.reshape(b * t, d).index_select(0, qp.flat))  # (Nq, d)
        q = self._split(qp.pack(q))  # (B', H, Q, hd)
        k_r, v_r = self._split(k.index_select(0, qp.rows)), self._split(v.index_select(0, qp.rows))
        mask = None
        if allowed is not None:  # padding query slots take position 0's row (always valid)
            mask = qp.gather(allowed.expand(b, allowed.size(1), t, k.size(1)), 2)
        a = F.scaled_dot_product_attention(q, k_r, v_r, attn_mask=mask)  # (B', H, Q, hd)
        return self.out_proj(self.out_norm(qp.unpack(self._merge(a))))

    def _attend_static_packed(self, x: Tensor, packed: PackedKeys, qp: Packing) -> Tensor:
        """Open queries (``qp``) attend over a static cache's :class:`PackedKeys` (no
        per-step packing of the keys). Returns ``(Nq, d)`` in ``qp.flat`` order."""
        b, t, d = x.shape
        keys = packed if qp.n_rows == b else packed.select(qp.rows)  # (B', H, W, hd)
        q = self.q_proj(x.reshape(b * t, d).index_select(0, qp.flat))  # (Nq, d)
        q = self._split(qp.pack(q))  # (B', H, Q, hd)
        a = attend_with_zero_rows(q, keys.k, keys.v, keys.valid[:, None, None, :],
                                  keys.n_off[:, None, None, None])  # (B', H, Q, hd)
        return self.out_proj(self.out_norm(qp.unpack(self._merge(a))))

    def _attend_packed(self, x: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None,
                       key_on: Tensor, qp: Packing) -> Tensor:
        """Open queries and on keys packed per sequence; the off keys a query may see enter
        its softmax as a count (:func:`attend_with_zero_rows`). Returns ``(Nq, d)`` in
        ``qp.flat`` order."""
        b, t, d = x.shape
        s = k.size(1)
        if allowed is None:
            allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=x.device)
        allowed = allowed.expand(b, allowed.size(1), t, s)  # (B, Hm, T, S)
        n_off = (allowed & ~key_on[:, None, None, :]).sum(-1, keepdim=True)  # (B, Hm, T, 1)
        kp = Packing.of(key_on, rows=qp.rows)
        q = self.q_proj(x.reshape(b * t, d).index_select(0, qp.flat))  # (Nq, d)
        q = self._split(qp.pack(q))  # (B', H, Q, hd)
        k_p, v_p = self._split(kp.select(k)), self._split(kp.select(v))  # (B', H, K, hd)
        n_off_p = qp.gather(n_off, 2).to(x.dtype)  # (B', Hm, Q, 1)
        allowed_p = kp.gather(qp.gather(allowed, 2), 3, rows_selected=True)
        allowed_p = allowed_p & kp.valid[:, None, None, :]  # (B', Hm, Q, K)
        a = attend_with_zero_rows(q, k_p, v_p, allowed_p, n_off_p)  # (B', H, Q, hd)
        return self.out_proj(self.out_norm(qp.unpack(self._merge(a))))

    def _attend_all(self, x: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None) -> Tensor:
        """LN(MultiHeadAtten(K, V, x W_q)) W_o for every query: x ``(B, T, d)``, k/v
        ``(B, S, d)`` -> ``(B, T, d)`` (the ungated part of eq. 13; dropout in training)."""
        a = F.scaled_dot_product_attention(self._split(self.q_proj(x)), self._split(k),
                                           self._split(v), attn_mask=allowed,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(self.out_norm(self._merge(a)))

    def _project_kv(self, src: Tensor, on: Tensor) -> tuple[Tensor, Tensor]:
        """LN(src W_k), LN(src W_v) ``(B, S, d)`` on the ``on`` ``(B, S)`` tokens only; zero
        rows elsewhere. Fast paths (one host sync): every token on runs the projections on
        ``src`` as it is (no gather/scatter), every token off projects nothing."""
        b, s, d = src.shape
        if self.fast_paths:
            n_on = int(on.sum())
            if n_on == b * s:
                return self.k_norm(self.k_proj(src)), self.v_norm(self.v_proj(src))
            if n_on == 0:
                return _zero_rows(src)
        flat = on.reshape(-1).nonzero().squeeze(1)  # (N_kv,)
        if flat.numel() == 0:
            return _zero_rows(src)
        rows = src.reshape(b * s, d).index_select(0, flat)  # (N_kv, d)
        k = scatter_rows(self.k_norm(self.k_proj(rows)), flat, b * s).view(b, s, d)
        v = scatter_rows(self.v_norm(self.v_proj(rows)), flat, b * s).view(b, s, d)
        return k, v

    # -- accounting -----------------------------------------------------------------------------

    def _trace(self, aux: AuxOutputs, g_q: Tensor, g_kv: Tensor | None, allowed: Tensor | None,
               n_keys: int, cross: bool) -> None:
        """Record the gates with the MACs each one controls per token (budget costs C_l)."""
        if allowed is None:
            keys_seen = torch.full(g_q.shape[:2], float(n_keys), device=g_q.device)
        else:  # keys each query may attend (averaged over heads if the mask differs by head)
            keys_seen = allowed.float().mean(1).sum(-1).expand(g_q.shape[:2])  # (B, T)
        per_query = _linear_macs(self.q_proj, 1) + _linear_macs(self.out_proj, 1)
        cost_q = (per_query + 2 * self.d_model * keys_seen)[..., None].to(g_q.dtype)
        trace_gate(aux, self.name, "q", g_q, cost_q, self.q_control)
        if g_kv is not None:
            per_kv = _linear_macs(self.k_proj, 1) + _linear_macs(self.v_proj, 1)
            cost_kv = torch.tensor(float(per_kv), dtype=g_kv.dtype, device=g_kv.device)
            stream = "memory" if cross else "input"
            trace_gate(aux, self.name, "kv", g_kv, cost_kv, self.kv_control, stream)

    def new_cache(self, static: bool = False) -> GatedKVCache:
        """An empty :class:`GatedKVCache` (``static``: cross-attention)."""
        return GatedKVCache(static=static)

    def macs(self, n_queries: int, n_keys: int, n_kv_tokens: int | None = None) -> dict[str, int]:
        """Dense maximum (every gate on) of one call, like ``MultiHeadAttention.macs``.

        Same keys plus ``control_q`` / ``control_kv``, the control networks' own cost
        (``n_kv_tokens`` defaults to ``n_keys``; 0 when keys come from a static cache).
        """
        n_kv = n_keys if n_kv_tokens is None else n_kv_tokens
        products = n_queries * n_keys * self.d_model
        return {
            "q_proj": _linear_macs(self.q_proj, n_queries),
            "k_proj": _linear_macs(self.k_proj, n_kv),
            "v_proj": _linear_macs(self.v_proj, n_kv),
            "attn_scores": products,
            "attn_values": products,
            "out_proj": _linear_macs(self.out_proj, n_queries),
            "control_q": self.q_control.macs(n_queries),
            "control_kv": self.kv_control.macs(n_kv),
        }

    def realized_macs(self, q_on: Tensor, kv_on: Tensor | None, key_on: Tensor | None = None,
                      key_width: int | None = None) -> dict[str, int]:
        """MACs the inference path executes for a hard gate pattern (keys as in :meth:`macs`).

        q_on: ``(B, T)`` bool, queries whose gate is on.
        kv_on: ``(B, S_new)`` bool, tokens whose K/V were projected in this call (their
            control net ran on all ``B·S_new`` tokens); None when they came from a filled
            static cache.
        key_on: ``(B, S)`` bool, all keys attended to that are on (cached + new); defaults
            to ``kv_on``.

        Projections count per open token. The attention products run on the packed layout:
        ``B'`` sequences with an open query, each padded to the most open queries (``Q``)
        and the most open keys (``K``) among them: ``B'·Q·K·d_model`` each.
        key_width: ``K`` when the keys were packed over more sequences than the open ones
            (a static cache's :class:`PackedKeys`, packed once for every step).
        """
        if key_on is None:
            if kv_on is None:
                raise ValueError("give key_on when kv_on is None (keys from a static cache)")
            key_on = kv_on
        n_q = int(q_on.sum())
        products = 0
        if n_q:
            rows = q_on.any(1)
            width_q = int(q_on.sum(1).max())
            width_k = int(key_on[rows].sum(1).max()) if key_width is None else key_width
            products = int(rows.sum()) * width_q * width_k * self.d_model
        n_kv = 0 if kv_on is None else int(kv_on.sum())
        return {
            "q_proj": _linear_macs(self.q_proj, n_q),
            "k_proj": _linear_macs(self.k_proj, n_kv),
            "v_proj": _linear_macs(self.v_proj, n_kv),
            "attn_scores": products,
            "attn_values": products,
            "out_proj": _linear_macs(self.out_proj, n_q),
            "control_q": self.q_control.macs(q_on.numel()),
            "control_kv": self.kv_control.macs(0 if kv_on is None else kv_on.numel()),
        }

    def realized_macs_per_row(self, q_on: Tensor, kv_on: Tensor | None,
                              key_on: Tensor | None = None) -> Tensor:
        """``(B,)`` long: the MACs each row's own tokens ran (arguments as
        :meth:`realized_macs`).

        Row b's attention products are its open queries times its on keys,
        ``Q_b·K_b·d_model`` each, which is what :meth:`realized_macs` counts for the row run
        alone (batch 1); the packed layout's padding slots, where a row is padded to the
        widest row of its batch, are attributed to no row. So a row costs the same whatever
        budgets the other rows of its batch run at.
        """
        if key_on is None:
            if kv_on is None:
                raise ValueError("give key_on when kv_on is None (keys from a static cache)")
            key_on = kv_on
        return self.row_macs(q_on.sum(1), key_on.sum(1),
                             None if kv_on is None else kv_on.sum(1), q_on.size(1),
                             None if kv_on is None else kv_on.size(1))

    def row_macs(self, n_q: Tensor | int, n_keys: Tensor | int, n_kv: Tensor | int | None,
                 q_tokens: Tensor | int, kv_tokens: Tensor | int | None) -> Tensor | int:
        """MACs of a row (numbers, or ``(B,)`` tensors, one per row) whose ``n_q`` open
        queries each attend over ``n_keys`` on keys, ``n_kv`` key/value tokens projected
        (None: keys from a cache), and whose control networks ran on ``q_tokens`` query and
        ``kv_tokens`` key/value tokens."""
        per_query = _linear_macs(self.q_proj, 1) + _linear_macs(self.out_proj, 1)
        ran = n_q * (per_query + 2 * self.d_model * n_keys) + q_tokens * self.q_control.macs(1)
        if n_kv is not None:
            per_kv = _linear_macs(self.k_proj, 1) + _linear_macs(self.v_proj, 1)
            ran = ran + n_kv * per_kv + kv_tokens * self.kv_control.macs(1)
        return ran

    def all_on_row_macs(self, n_queries: int | Tensor, n_keys: int | Tensor) -> int | Tensor:
        """What one row of ``n_queries`` tokens over ``n_keys`` key tokens (its own: no
        padding) runs with every gate open, as :meth:`realized_macs_per_row` counts it (keys
        projected in the call: self-attention's own tokens, or cross-attention's memory;
        numbers, or ``(B,)`` tensors, one per row). Depends on the lengths only, so it
        needs no forward pass."""
        return self.row_macs(n_queries, n_keys, n_keys, n_queries, n_keys)

    def _valid_rows(self, q_on: Tensor, kv_ran: Tensor, attn_mask: Tensor | None,
                    q_valid: Tensor | None, k_valid: Tensor | None, all_on: bool) -> Tensor:
        """:data:`~dynaseq.nn.outputs.RowCounter` of a call without a cache (its keys are
        the tokens whose K/V it projected, ``kv_ran``): per row, the MACs of its own
        queries (``q_valid``) over its own keys (``k_valid``), as the row alone would run
        them: its keys are projected only if one of its own queries is open, and its
        control networks run on its own tokens. ``all_on``: every gate open (every own
        query, every own key that a query may attend)."""
        b, s = kv_ran.shape
        if all_on:
            q_on = torch.ones_like(q_on)
            kv_ran = (torch.ones_like(kv_ran) if attn_mask is None
                      else _attendable(attn_mask, b, s))
        if q_valid is not None:
            q_on = q_on & q_valid
        if k_valid is not None:
            kv_ran = kv_ran & k_valid
        kv_ran = kv_ran & q_on.any(1, keepdim=True)  # as the hard path: nobody else reads them
        q_tokens = q_on.size(1) if q_valid is None else q_valid.sum(1)
        kv_tokens = s if k_valid is None else k_valid.sum(1)
        n_kv = kv_ran.sum(1)
        return self.row_macs(q_on.sum(1), n_kv, n_kv, q_tokens, kv_tokens)


def _attendable(attn_mask: Tensor, batch: int, n_keys: int) -> Tensor:
    """``(B, S)`` bool: keys that at least one query may attend under ``attn_mask``."""
    mask = allowed_mask(attn_mask, False, 1, n_keys, 0, attn_mask.device)
    assert mask is not None
    return mask.any(2).any(1).expand(batch, n_keys)


def _zero_rows(src: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values of ``src`` ``(B, S, d)`` with every token off: two zero tensors."""
    zeros = torch.zeros_like(src)
    return zeros, zeros.clone()


def _store(cache: GatedKVCache, k: Tensor, v: Tensor,
           on: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Append (or, for a static cache, set) keys/values/on-flags; return the full ones."""
    if cache.k is not None and not cache.static:
        if (cache.on is None) != (on is None):
            raise ValueError("a cache cannot mix training-mode and inference-mode steps")
        k = torch.cat([cache.k, k], dim=1)
        v = torch.cat([cache.v, v], dim=1)
        on = None if on is None else torch.cat([cache.on, on], dim=1)
    cache.k, cache.v, cache.on = k, v, on
    cache.packed = None  # packed from these keys when first needed
    return k, v, on


def _linear(d_in: int, d_out: int) -> nn.Linear:
    layer = nn.Linear(d_in, d_out)
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def conditional_attention(d_model: int, n_heads: int, dropout: float = 0.0, *,
                          control_hidden: int = 128, schedule: NoiseSchedule | None = None,
                          hard_budget: bool = False, norms: bool = True,
                          name: str = "attention", fast_paths: bool = True
                          ) -> ConditionalAttention:
    """CCT attention with ``nn.Linear`` projections, LayerNorms on K, V and the attention
    output (``norms=False``: none, plain attention maths), and two control nets of width
    ``control_hidden`` sharing one :class:`Gate` (``fast_paths``: see
    :class:`ConditionalAttention`)."""

    def norm() -> nn.Module:
        return nn.LayerNorm(d_model) if norms else nn.Identity()

    return ConditionalAttention(
        d_model, n_heads, _linear(d_model, d_model), _linear(d_model, d_model),
        _linear(d_model, d_model), _linear(d_model, d_model),
        q_control=ControlNet(d_model, 1, control_hidden),
        kv_control=ControlNet(d_model, 1, control_hidden), gate=Gate(schedule, hard_budget),
        k_norm=norm(), v_norm=norm(), out_norm=norm(), dropout=dropout, name=name,
        fast_paths=fast_paths)
