"""A lean decoding step for dense encoder-decoder Transformers (inference only).

Greedy and beam search (:mod:`dynaseq.models.search`) call one decoder step per token. The
general step (:meth:`Seq2SeqTransformer.decode_step`) goes through every sub-layer module, so
any technique's sub-layers fit, and it grows each key/value cache by concatenation. At batch 1
that per-step work, not the arithmetic, sets the time of a small model, and the output layer's
matrix-vector product with the tied ``(V, d)`` embedding reads memory at a third of the rate a
``(d, V)`` layout reaches. :class:`LeanDecoder` runs the same computation for a *dense* model
(plain :class:`~dynaseq.nn.MultiHeadAttention` and :class:`~dynaseq.nn.FeedForward` sub-layers,
no control symbols) with what the arithmetic needs and nothing else:

* self-attention's q/k/v projections fused into one ``(3·inner, d)`` matrix, and the
  cross-attention keys and values of the encoder output projected once, at the first step;
* key/value caches preallocated per layer (:class:`LeanState`): a step writes its key and
  value in place; a cache doubles its capacity when full, so no step concatenates;
* layer norms, residuals and projections called as functions on the model's own weight
  tensors (no module dispatch), and the output layer as ``x @ Wᵀ`` with ``Wᵀ`` stored
  ``(d, V)`` contiguous once.

Outputs equal the general step's up to float rounding (the same operations, some fused);
the tests decode with both and compare tokens and logits. ``torch.compile`` of this step was
measured (``benchmarks/batch1_latency.py``) and is not used: on 2 CPU cores it cost seconds of
compilation and saved nothing at batch 1.

The fused q/k/v matrix and ``Wᵀ`` are copies, made by :meth:`LeanDecoder.prepare`;
:meth:`LeanDecoder.is_current` says whether the model's weights or modules changed since
(an in-place update bumps a tensor's version), so a holder re-prepares instead of decoding
with stale copies. The other weights are the model's own tensors.

Example::

    lean = LeanDecoder.prepare(model)          # None for a CCT / DMB / MoE / int8 model
    hyps = greedy_search(lean or model, src)   # same tokens as greedy_search(model, src)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.models.seq2seq import DecoderLayer, EncoderOutput, Seq2SeqTransformer
from dynaseq.nn import FeedForward, MultiHeadAttention


def _dense_attention(m: nn.Module) -> bool:
    return (type(m) is MultiHeadAttention and m.position_scores is None and m.n_heads > 0
            and all(type(p) is nn.Linear and p.bias is not None
                    for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj)))


def _dense_ffn(m: nn.Module) -> bool:
    return (type(m) is FeedForward and type(m.fc1) is nn.Linear and type(m.fc2) is nn.Linear
            and m.fc1.bias is not None and m.fc2.bias is not None)


def is_dense(model: nn.Module) -> bool:
    """Whether ``model`` is a :class:`Seq2SeqTransformer` whose decoder :class:`LeanDecoder`
    can run: no control symbols, every decoder layer a :class:`DecoderLayer` of dense
    attention (``nn.Linear`` projections with biases, no position scores, at least one head)
    and a :class:`FeedForward` of ``nn.Linear`` layers, and an ``nn.Linear`` output layer
    without bias."""
    if not isinstance(model, Seq2SeqTransformer) or model.control_embed is not None:
        return False
    dec = model.decoder
    return (type(dec.output_proj) is nn.Linear and dec.output_proj.bias is None
            and all(type(layer) is DecoderLayer and _dense_attention(layer.self_attn)
                    and _dense_attention(layer.cross_attn) and _dense_ffn(layer.ffn)
                    for layer in dec.layers))


@dataclass(frozen=True)
class _Norm:
    """A LayerNorm's tensors: ``F.layer_norm(x, (d,), weight, bias, eps)``."""

    weight: Tensor
    bias: Tensor
    eps: float

    @classmethod
    def of(cls, m: nn.LayerNorm) -> _Norm:
        return cls(m.weight, m.bias, m.eps)

    def __call__(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


@dataclass(frozen=True)
class _LayerWeights:
    """One decoder layer's tensors; ``qkv_*`` is the fused copy, the rest the model's own."""

    self_norm: _Norm
    qkv_weight: Tensor  # (3·inner, d)
    qkv_bias: Tensor  # (3·inner,)
    self_out: nn.Linear
    cross_norm: _Norm
    cross_q: nn.Linear
    cross_k: nn.Linear
    cross_v: nn.Linear
    cross_out: nn.Linear
    ffn_norm: _Norm
    fc1: nn.Linear
    fc2: nn.Linear
    n_heads: int
    d_head: int


class LeanState:
    """Key/value caches of a :class:`LeanDecoder`, one per layer, preallocated.

    ``self_k[i]``/``self_v[i]``: ``(B, H, capacity, d_head)``, of which the first
    :attr:`length` positions are filled; ``cross_k[i]``/``cross_v[i]``: ``(B, H, S, d_head)``
    from the first step on; ``cross_mask``: ``(B, 1, 1, S)`` bool (True = attend), or None when
    no row has padding. Row-aligned like :class:`~dynaseq.models.seq2seq.DecoderState`, with
    the same ``reorder`` methods, so the searches keep, drop and copy rows of both alike.
    """

    def __init__(self, n_layers: int, capacity: int = 32) -> None:
        if capacity < 1:
            raise ValueError(f"a cache holds at least one step, got capacity={capacity}")
        self.capacity = capacity
        self.length = 0
        self.self_k: list[Tensor | None] = [None] * n_layers
        self.self_v: list[Tensor | None] = [None] * n_layers
        self.cross_k: list[Tensor | None] = [None] * n_layers
        self.cross_v: list[Tensor | None] = [None] * n_layers
        self.cross_mask: Tensor | None = None
        self.started = False

    @property
    def step(self) -> int:
        """The position of the next step (as :attr:`DecoderState.step`)."""
        return self.length

    def append_self(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one step's keys and values ``(B, H, 1, d_head)`` of layer ``i`` at position
        :attr:`length`; return every filled position's, ``(B, H, length + 1, d_head)`` views."""
        n = self.length
        if self.self_k[i] is None:
            shape = (*k.shape[:2], self.capacity, k.size(3))
            self.self_k[i] = k.new_empty(shape)
            self.self_v[i] = v.new_empty(shape)
        elif n >= self.self_k[i].size(2):  # full: double the capacity, once per layer
            self.self_k[i] = _grow(self.self_k[i], n)
            self.self_v[i] = _grow(self.self_v[i], n)
        ck, cv = self.self_k[i], self.self_v[i]
        ck[:, :, n: n + 1].copy_(k)
        cv[:, :, n: n + 1].copy_(v)
        return ck[:, :, : n + 1], cv[:, :, : n + 1]

    def reorder(self, index: Tensor) -> None:
        """Keep/reorder batch rows of every cache."""
        self.reorder_self(index)
        self.reorder_cross(index)

    def reorder_self(self, index: Tensor) -> None:
        """Keep/reorder batch rows of the self-attention caches (filled positions only)."""
        for i, k in enumerate(self.self_k):
            if k is not None:
                self.self_k[i] = _take_rows(k, index, self.length)
                self.self_v[i] = _take_rows(self.self_v[i], index, self.length)

    def reorder_cross(self, index: Tensor) -> None:
        """Keep/reorder batch rows of the cross-attention keys, values and mask."""
        for i, k in enumerate(self.cross_k):
            if k is not None:
                self.cross_k[i] = k.index_select(0, index)
                self.cross_v[i] = self.cross_v[i].index_select(0, index)
        if self.cross_mask is not None:
            self.cross_mask = self.cross_mask.index_select(0, index)


def _linear(x: Tensor, m: nn.Linear) -> Tensor:
    """``m(x)`` without the module call's hook dispatch."""
    return F.linear(x, m.weight, m.bias)


def _grow(cache: Tensor, filled: int) -> Tensor:
    """A cache of twice the capacity holding ``cache``'s first ``filled`` positions."""
    bigger = cache.new_empty((*cache.shape[:2], 2 * cache.size(2), cache.size(3)))
    bigger[:, :, :filled].copy_(cache[:, :, :filled])
    return bigger


def _take_rows(cache: Tensor, index: Tensor, filled: int) -> Tensor:
    """Rows ``index`` of a cache, same capacity, its first ``filled`` positions copied."""
    out = cache.new_empty((index.numel(), *cache.shape[1:]))
    torch.index_select(cache[:, :, :filled], 0, index, out=out[:, :, :filled])
    return out


def _decoder_modules(model: Seq2SeqTransformer) -> list[nn.Module]:
    """The decoder modules a :class:`LeanDecoder` reads: its layers' and the final norm."""
    return [*model.decoder.layers.modules(), model.decoder.norm]


class LeanDecoder:
    """Decodes for a dense :class:`Seq2SeqTransformer`, through the search protocol
    (``encode``, ``init_state``, ``decode_step``, ``pad_id``/``bos_id``/``eos_id``): pass it
    to :func:`~dynaseq.models.search.greedy_search` or ``beam_search`` in place of the model.
    Build it with :meth:`prepare`; inference only (``decode_step`` runs without autograd and
    ignores dropout)."""

    def __init__(self, model: Seq2SeqTransformer, layers: list[_LayerWeights],
                 output_t: Tensor, sources: list[Tensor]) -> None:
        self.model = model
        self.layers = layers
        self.output_t = output_t  # (d, V) contiguous copy of the output layer's weight
        self.final_norm = _Norm.of(model.decoder.norm)
        self._sources = sources
        self._versions = [t._version for t in sources]
        self._modules = _decoder_modules(model)
        self.pad_id, self.bos_id, self.eos_id = model.pad_id, model.bos_id, model.eos_id

    @classmethod
    def prepare(cls, model: nn.Module) -> LeanDecoder | None:
        """The lean decoder of ``model``, or None when ``model`` is not dense
        (:func:`is_dense`: CCT, DMB, MoE, int8 and head-pruned-to-nothing models keep the
        general step)."""
        if not is_dense(model):
            return None
        layers, sources = [], []
        with torch.no_grad():
            for layer in model.decoder.layers:
                sa, ca = layer.self_attn, layer.cross_attn
                projections = (sa.q_proj, sa.k_proj, sa.v_proj)
                sources += [t for p in projections for t in (p.weight, p.bias)]
                layers.append(_LayerWeights(
                    _Norm.of(layer.self_attn_norm),
                    torch.cat([p.weight for p in projections]),
                    torch.cat([p.bias for p in projections]),
                    sa.out_proj, _Norm.of(layer.cross_attn_norm), ca.q_proj, ca.k_proj,
                    ca.v_proj, ca.out_proj, _Norm.of(layer.ffn_norm), layer.ffn.fc1,
                    layer.ffn.fc2, sa.n_heads, sa.d_head))
            weight = model.decoder.output_proj.weight
            sources.append(weight)
            output_t = weight.detach().t().contiguous()
        return cls(model, layers, output_t, sources)

    def is_current(self) -> bool:
        """False once a copied weight was changed in place (training, ``load_state_dict``:
        each tensor's version counter, ``Tensor._version``, moves) or a decoder module was
        replaced (e.g. by int8 quantization): prepare anew then."""
        model = self.model
        return (self._modules == _decoder_modules(model)
                and model.decoder.output_proj.weight is self._sources[-1]
                and all(t._version == v for t, v in zip(self._sources, self._versions,
                                                          strict=True)))

    def encode(self, src: Tensor, control: object = None) -> EncoderOutput:
        """src (B, S) -> the model's :class:`EncoderOutput` (dense: ``control`` must be None)."""
        return self.model.encode(src, control)

    def init_state(self, capacity: int = 32) -> LeanState:
        """Empty caches (``capacity`` steps before the first doubling)."""
        return LeanState(len(self.layers), capacity)

    @torch.no_grad()
    def decode_step(self, tokens: Tensor, enc: EncoderOutput, state: LeanState) -> Tensor:
        """tokens (B, 1) at position ``state.step`` -> next-token logits (B, V)."""
        if not state.started:  # project the encoder output once for every later step
            self._start(enc, state)
        b = tokens.size(0)
        dec = self.model.decoder
        x = dec.embed(tokens) + dec.positions(1, state.length)  # (B, 1, d)
        for i, w in enumerate(self.layers):
            h, d = w.n_heads, w.d_head
            qkv = F.linear(w.self_norm(x), w.qkv_weight, w.qkv_bias)  # (B, 1, 3·H·hd)
            q, k, v = qkv.view(b, 3, h, 1, d).unbind(1)  # each (B, H, 1, hd)
            keys, values = state.append_self(i, k, v)  # (B, H, t+1, hd)
            a = F.scaled_dot_product_attention(q, keys, values)  # (B, H, 1, hd)
            x = x + _linear(a.reshape(b, 1, h * d), w.self_out)
            q = _linear(w.cross_norm(x), w.cross_q).view(b, h, 1, d)
            a = F.scaled_dot_product_attention(q, state.cross_k[i], state.cross_v[i],
                                               attn_mask=state.cross_mask)
            x = x + _linear(a.reshape(b, 1, h * d), w.cross_out)
            x = x + _linear(_linear(w.ffn_norm(x), w.fc1).relu_(), w.fc2)
        state.length += 1
        return self.final_norm(x[:, 0]) @ self.output_t  # (B, V)

    def _start(self, enc: EncoderOutput, state: LeanState) -> None:
        """Fill the cross-attention keys/values of every layer from ``enc``."""
        if enc.control is not None or enc.gate_offset is not None:
            raise ValueError("a lean decoder runs dense models, which take no control")
        b, s, _ = enc.out.shape
        for i, w in enumerate(self.layers):
            shape = (b, s, w.n_heads, w.d_head)
            state.cross_k[i] = _linear(enc.out, w.cross_k).view(shape).transpose(1, 2)
            state.cross_v[i] = _linear(enc.out, w.cross_v).view(shape).transpose(1, 2)
        state.cross_mask = enc.attn_mask if bool(enc.pad_mask.any()) else None
        state.started = True


def lean_or_model(model: nn.Module) -> nn.Module | LeanDecoder:
    """:meth:`LeanDecoder.prepare` of ``model``, or ``model`` itself when it is not dense."""
    lean = LeanDecoder.prepare(model)
    return model if lean is None else lean


__all__ = ["LeanDecoder", "LeanState", "is_dense", "lean_or_model"]
