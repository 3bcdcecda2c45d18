"""A lean decoding step for encoder-decoder Transformers (inference only).

Greedy and beam search (:mod:`dynaseq.models.search`) call one decoder step per token. The
general step (:meth:`Seq2SeqTransformer.decode_step`) goes through every sub-layer module, so
any technique's sub-layers fit, and it grows each key/value cache by concatenation. At batch 1
that per-step work, not the arithmetic, sets the time of a small model, and the output layer's
matrix-vector product with the tied ``(V, d)`` embedding reads memory at a third of the rate a
``(d, V)`` layout reaches. :class:`LeanDecoder` runs the same computation with what the
arithmetic needs and nothing else:

* each sub-layer through its *lean part* (:mod:`dynaseq.nn.lean_step`), built once by the
  factory its module type registered: dense attention fuses its q/k/v projections and projects
  the encoder output's keys and values once (:mod:`dynaseq.nn.lean_dense`); the CCT's gated
  sub-layers run only what their gates open and return None when every row's gate is off,
  so the residual is not even touched (:mod:`dynaseq.techniques.cct.lean_step`); DMB
  sub-layers run the branch their router picks (:mod:`dynaseq.techniques.branching.lean_step`);
* the source encoded through the lean encoder pass (:mod:`dynaseq.models.lean_encoder`)
  where every encoder layer has lean parts and no compute trace is asked for (``aux``);
* key/value caches preallocated per layer (:class:`~dynaseq.nn.lean_step.StepCache`): a step
  writes its key and value in place; a cache doubles its capacity when full;
* layer norms, residuals and projections called as functions on the model's own tensors (no
  module dispatch); projections, the output layer among them, read in the layout that
  reads them fastest on this machine at the step's number of rows
  (:class:`~dynaseq.nn.lean_step.StepLinear`: ``F.linear``, ``x`` against an ``(in, out)``
  copy, or the weight on the left, ``W xᵀ``; timed on the first calls of each size class,
  :mod:`dynaseq.nn.layouts`).

A model whose decoder layers are all :class:`DecoderLayer` of sub-layers with a lean part gets
one (:func:`is_lean`: dense, CCT and DMB models, the dense and DMB ones float or int8; MoE,
int8 CCT and relative-position models not); the others keep the general step. Outputs equal
the general step's up to float rounding (the same operations, some fused); the tests decode
with both and compare tokens and logits. ``torch.compile`` of this step was measured
(``benchmarks/batch1_latency.py``) and is not used: on 2 CPU cores it cost seconds of
compilation and saved nothing at batch 1.

The fused or folded matrices and ``Wᵀ`` are copies, made by :meth:`LeanDecoder.prepare` (the
``(in, out)`` copies of projections, made for their layout trials and kept where a size class
chose them, and the CCT feed-forward pieces' ``(d, f)`` second layers, at the first call that
reads them);
:meth:`LeanDecoder.is_current` says whether the model's weights or modules changed since
(an in-place update bumps a tensor's version), so a holder re-prepares instead of decoding
with stale copies. The other weights are the model's own tensors.

Example::

    lean = LeanDecoder.prepare(model)          # None for an MoE model
    hyps = greedy_search(lean or model, src)   # same tokens as greedy_search(model, src)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

import dynaseq.nn.lean_dense  # noqa: F401  (registers the dense sub-layers' lean parts)
from dynaseq.models.lean_encoder import layer_modules, lean_layers, run_layers, valid_tokens
from dynaseq.models.seq2seq import DecoderLayer, EncoderOutput, Seq2SeqTransformer
from dynaseq.nn.lean_step import (
    SHARE_MIN,
    CrossKeys,
    LinearFn,
    Norm,
    StepCache,
    StepLinear,
    StepTally,
    autocast_on,
    lean_part,
    linear_fn,
    linear_tensors,
    moved_rows,
    uniform_offset,
)
from dynaseq.nn.outputs import AuxOutputs
from dynaseq.nn.versions import unchanged, versions_of


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's input norms and its sub-layers' lean parts."""

    self_norm: Norm
    self_attn: object
    cross_norm: Norm
    cross_attn: object
    ffn_norm: Norm
    ffn: object

    @property
    def sources(self) -> list[Tensor]:
        return [*self.self_attn.sources, *self.cross_attn.sources, *self.ffn.sources]


def _lean_layer(layer: nn.Module) -> _Layer | None:
    """The lean parts of ``layer``, or None when it or one of its sub-layers has none."""
    if type(layer) is not DecoderLayer:
        return None
    norms = [Norm.of(n) for n in (layer.self_attn_norm, layer.cross_attn_norm, layer.ffn_norm)]
    parts = [lean_part(layer.self_attn, "self"), lean_part(layer.cross_attn, "cross"),
             lean_part(layer.ffn, "ffn")]
    if any(p is None for p in (*norms, *parts)):
        return None
    return _Layer(norms[0], parts[0], norms[1], parts[1], norms[2], parts[2])


def _lean_layers(model: nn.Module) -> list[_Layer] | None:
    if not isinstance(model, Seq2SeqTransformer):
        return None
    proj = model.decoder.output_proj
    if getattr(proj, "bias", None) is not None or linear_fn(proj, bias=False) is None:
        return None
    layers = [_lean_layer(layer) for layer in model.decoder.layers]
    return None if any(la is None for la in layers) else layers


def _output_layer(proj: nn.Module) -> LinearFn:
    """The output layer as a function: a float one (no bias) as a :class:`StepLinear`, an
    int8 one through its kernel."""
    if type(proj) is nn.Linear:
        return StepLinear(proj.weight, None)
    fn = linear_fn(proj, bias=False)
    assert fn is not None, "checked by _lean_layers"
    return fn


def is_lean(model: nn.Module) -> bool:
    """Whether :class:`LeanDecoder` can run ``model``: a :class:`Seq2SeqTransformer` whose
    decoder layers are :class:`DecoderLayer` with LayerNorms and sub-layers that have a lean
    part (:func:`~dynaseq.nn.lean_step.lean_part`), and an output layer without bias, float
    ``nn.Linear`` or int8. Building the parts copies weights; :meth:`LeanDecoder.prepare`
    keeps them."""
    return _lean_layers(model) is not None


class LeanState:
    """Key/value caches of a :class:`LeanDecoder`: one :class:`StepCache` per layer and, from
    the first step on, each layer's :class:`CrossKeys`. Row-aligned like
    :class:`~dynaseq.models.seq2seq.DecoderState`, with the same ``reorder`` methods, so the
    searches keep, drop and copy rows of both alike."""

    def __init__(self, n_layers: int, capacity: int = 32, share_keys: bool = False) -> None:
        self.caches = [StepCache(capacity) for _ in range(n_layers)]
        self.share_keys = share_keys  # every layer's cross part attends shared keys
        self.cross: list[CrossKeys] = []
        self.length = 0
        self.offset: Tensor | float | None = None  # the rows' gate offsets (see _uniform)
        self.tally: StepTally | None = None  # set by a caller that wants per-row counts
        self.starts: Tensor | None = None
        """``(B,)`` long: the slot at which each row's first step wrote (rows that joined a
        running decode, :meth:`join`), or None: slot 0 for every row."""

    @property
    def step(self) -> int:
        """The position of the next step (as :attr:`DecoderState.step`)."""
        return self.length

    @property
    def started(self) -> bool:
        return bool(self.cross)

    def reorder(self, index: Tensor) -> None:
        """Keep/reorder batch rows of every cache (and of the :attr:`tally`, whose rows
        only leave: greedy search). Where few rows move (greedy search drops finished rows
        by swapping the last ones into their places), the caches copy only those, in place
        (:func:`~dynaseq.nn.lean_step.in_place`)."""
        moved = self._moved(index)  # once for both kinds of cache
        self._reorder_self(index, moved)
        self._reorder_cross(index, moved)
        if self.tally is not None:
            self.tally.reorder(index)
        if self.starts is not None:
            self.starts = self.starts.index_select(0, index)

    def positions(self) -> Tensor | None:
        """``(B,)`` each row's position at the next step, or None where every row is at
        :attr:`step`."""
        return None if self.starts is None else self.length - self.starts

    def join(self, other: LeanState) -> None:
        """Append the rows of ``other``, a state started for new sentences
        (:meth:`LeanDecoder.start`) that ran no step, after this state's rows: their first
        step writes this state's next slot, and until then the attention leaves their
        slots out (:meth:`prepare_step`). Greedy decoding: one row per sentence."""
        assert other.started and other.length == 0 and self.started, "two started states"
        assert (self.tally is None) == (other.tally is None), "both counted, or neither"
        assert all(k.group == 1 for k in self.cross), "rows of their own (greedy search)"
        if self.tally is not None:
            self.tally.join(other.tally)
        rows, more = self.cross[0].k.size(0), other.cross[0].k.size(0)
        for cache in self.caches:
            cache.join(more)
        self.cross = [CrossKeys.cat([a, b]) for a, b in zip(self.cross, other.cross,
                                                             strict=True)]
        if self.length:
            device = self.cross[0].k.device
            starts = (torch.zeros(rows, dtype=torch.long, device=device)
                      if self.starts is None else self.starts)
            self.starts = torch.cat([starts, torch.full((more,), self.length,
                                                        dtype=torch.long, device=device)])

    def put(self, rows: Tensor, other: LeanState) -> None:
        """Rows ``rows`` ``(n,)`` (of sentences that finished) taken over by the ``n`` rows of
        ``other``, started as for :meth:`join`: nothing of the other rows moves. The old
        rows' slots stay in the caches, left out of the new rows' attention (their first
        step writes this state's next slot)."""
        assert other.started and other.length == 0 and self.started, "two started states"
        assert (self.tally is None) == (other.tally is None), "both counted, or neither"
        if self.tally is not None:
            self.tally.put(rows, other.tally)
        self.cross = [a.put(rows, b) for a, b in zip(self.cross, other.cross, strict=True)]
        if self.length:
            if self.starts is None:
                self.starts = torch.zeros(self.cross[0].k.size(0), dtype=torch.long,
                                          device=rows.device)
            self.starts = self.starts.index_fill(0, rows, self.length)

    def prepare_step(self) -> None:
        """Before a step of rows that began at different slots: a full cache drops the
        slots no row reads any more (every row began after them) instead of doubling, and
        each cache gets the step's mask (:attr:`StepCache.mask`)."""
        if self.starts is None:
            return
        full = any(c.k is not None and self.length >= c.k.size(2) for c in self.caches)
        if full:
            low = int(self.starts.min())
            if low:
                for cache in self.caches:
                    cache.compact(low)
                self.starts = self.starts - low
                self.length -= low
            if int(self.starts.max()) == 0:  # every row from slot 0: no mask
                self.starts = None
                for cache in self.caches:
                    cache.mask = None
                return
        slots = torch.arange(self.length + 1, device=self.starts.device)
        mask = (slots >= self.starts[:, None])[:, None, None, :]  # (B, 1, 1, length + 1)
        for cache in self.caches:
            cache.mask = mask

    def reorder_self(self, index: Tensor) -> None:
        """Keep/reorder batch rows of the self-attention caches (filled positions only; an
        index that keeps the row count copies only the rows it moves)."""
        self._reorder_self(index, self._moved(index))

    def _moved(self, index: Tensor) -> Tensor | None:
        """:func:`~dynaseq.nn.lean_step.moved_rows` of ``index`` over the rows decoding now
        (None before any cache holds a row)."""
        rows = next((c.k.size(0) for c in self.caches if c.k is not None), None)
        if rows is None and self.cross:
            rows = self.cross[0].k.size(0) * self.cross[0].group
        return None if rows is None else moved_rows(index, rows)

    def _reorder_self(self, index: Tensor, moved: Tensor | None) -> None:
        for cache in self.caches:
            cache.reorder(index, moved)

    def reorder_cross(self, index: Tensor) -> None:
        """Keep/reorder batch rows of the cross-attention keys, values and masks (while
        beams share keys, ``index`` keeps or drops whole sentences' groups of rows, as beam
        search's does: :meth:`CrossKeys.index_select`)."""
        self._reorder_cross(index, self._moved(index))

    def _reorder_cross(self, index: Tensor, moved: Tensor | None) -> None:
        """:meth:`reorder_cross` with ``moved``, the query rows' (keys shared by groups of
        rows do not read it)."""
        self.cross = [keys.index_select(index, moved if keys.group == 1 else None)
                      for keys in self.cross]

    def expand_beams(self, index: Tensor, beams: int) -> None:
        """:meth:`reorder` by ``index``, which repeats each row ``beams`` times (beam
        search after its first step), except that from :data:`SHARE_MIN` sentences on a
        CPU the beams of a sentence share its cross-attention keys instead of a copy each
        (where every layer's cross part attends shared keys)."""
        assert self.starts is None, "beams of rows that began together"
        sentences = index.numel() // beams
        if not (self.share_keys and beams > 1 and sentences >= SHARE_MIN and self.cross
                and index.device.type == "cpu"):  # measured on CPUs only
            self.reorder(index)
            return
        self.reorder_self(index)
        self.cross = [keys.shared(beams) for keys in self.cross]
        if self.tally is not None:
            self.tally.reorder(index)


def _decoder_modules(model: Seq2SeqTransformer) -> list[nn.Module]:
    """The decoder modules a :class:`LeanDecoder` reads: its layers', the final norm and the
    output layer."""
    return [*model.decoder.layers.modules(), model.decoder.norm, model.decoder.output_proj]


class LeanDecoder:
    """Decodes for a :class:`Seq2SeqTransformer` (:func:`is_lean`), through the search
    protocol (``encode``, ``init_state``, ``decode_step``, ``pad_id``/``bos_id``/``eos_id``):
    pass it to :func:`~dynaseq.models.search.greedy_search` or ``beam_search`` in place of
    the model. Build it with :meth:`prepare`; inference only (``decode_step`` runs without
    autograd and ignores dropout)."""

    def __init__(self, model: Seq2SeqTransformer, layers: list[_Layer], output: LinearFn,
                 sources: list[Tensor]) -> None:
        self.model = model
        self.layers = layers
        with torch.no_grad():  # None: the model's own encoder pass
            self.encoder_layers = lean_layers(model.encoder.layers)
        self.output = output  # (B, d) -> (B, V)
        self.final_norm = Norm(model.decoder.norm.weight, model.decoder.norm.bias,
                               model.decoder.norm.eps)
        self._sources = sources
        self._versions = versions_of(sources)
        self._enc_sources = [t for la in self.encoder_layers or () for t in la.sources]
        self._enc_versions = versions_of(self._enc_sources)
        self._modules = _decoder_modules(model) + layer_modules(model.encoder.layers)
        self.pad_id, self.bos_id, self.eos_id = model.pad_id, model.bos_id, model.eos_id

    @classmethod
    def prepare(cls, model: nn.Module) -> LeanDecoder | None:
        """The lean decoder of ``model``, or None when :func:`is_lean` is False (MoE, int8 CCT,
        relative-position and head-pruned-to-nothing models keep the general step) or inside
        the caller's ``torch.autocast`` (:func:`~dynaseq.nn.lean_step.autocast_on`)."""
        if autocast_on(model):
            return None
        with torch.no_grad():
            layers = _lean_layers(model)
            if layers is None:
                return None
        proj = model.decoder.output_proj
        sources = [t for layer in layers for t in layer.sources]
        return cls(model, layers, _output_layer(proj), [*sources, *linear_tensors(proj)])

    def is_current(self) -> bool:
        """False once a copied weight was changed in place (training, ``load_state_dict``:
        each tensor's version counter, ``Tensor._version``, moves) or given new storage or
        dtype (``param.data = ...``, ``model.to(torch.bfloat16)``:
        :func:`~dynaseq.nn.versions.version_of`), or a decoder module was replaced (e.g. by
        int8 quantization): prepare anew then."""
        model = self.model
        output = linear_tensors(model.decoder.output_proj)
        return (self._modules == _decoder_modules(model) + layer_modules(model.encoder.layers)
                and all(a is b for a, b in zip(output, self._sources[-len(output):],
                                               strict=True))
                and unchanged(self._sources + self._enc_sources,
                              self._versions + self._enc_versions))

    def encode(self, src: Tensor, control: object = None,
               aux: AuxOutputs | None = None) -> EncoderOutput:
        """src (B, S) -> the model's :class:`EncoderOutput` (``control``, ``aux``: as the
        model's): through the lean encoder pass unless ``aux`` asks for compute traces, the
        encoder has no lean parts or the model is training (then the model's own pass).
        The states at padding positions are then not computed (every reader masks them)."""
        model = self.model
        if aux is not None or self.encoder_layers is None or model.training:
            return model.encode(src, control, aux)
        with torch.inference_mode():
            embedding, offsets = model.control_inputs(control, src.size(0), src.device)
            x, pad_mask = model.encoder.embed_inputs(src, embedding)
            x = run_layers(self.encoder_layers, range(len(self.encoder_layers)), x,
                           valid_tokens(pad_mask), offsets.get("encoder"))
            return EncoderOutput(model.encoder.norm(x), pad_mask, embedding,
                                 offsets.get("decoder"))

    def init_state(self, capacity: int = 32) -> LeanState:
        """Empty caches (``capacity`` steps before the first doubling)."""
        share = all(getattr(w.cross_attn, "shares_keys", False) for w in self.layers)
        return LeanState(len(self.layers), capacity, share_keys=share)

    @torch.inference_mode()
    def start(self, enc: EncoderOutput, state: LeanState) -> None:
        """Project the encoder output's keys and values into ``state``, once for every
        later step (the first :meth:`decode_step` does it where this was not called)."""
        state.offset = uniform_offset(enc.gate_offset)
        state.cross = [w.cross_attn.start(enc.out, enc.pad_mask, state.offset, state.tally)
                       for w in self.layers]

    @torch.inference_mode()
    def begin(self, enc: EncoderOutput, tally: StepTally | None = None
              ) -> tuple[LeanState, EncoderOutput]:
        """A started state for the sentences of ``enc`` and their :func:`spent` encoder
        output: what :meth:`join` adds more sentences to (a refilled greedy decode,
        :func:`~dynaseq.models.search.refilled_greedy_search`); ``tally``: counts its rows
        (one per sentence, ``keep=False``), their cross-attention keys from here."""
        state = self.init_state()
        state.tally = tally
        self.start(enc, state)
        return state, spent(enc)

    @torch.inference_mode()
    def join(self, state: LeanState, enc: EncoderOutput, fresh: LeanState,
             new: EncoderOutput) -> EncoderOutput:
        """Add new sentences to a running greedy decode: ``state`` and ``enc``, the encoder
        output of its rows (:func:`spent`), take the rows of ``fresh`` and ``new``
        (:meth:`begin` of the new sentences) after their own. Returns the encoder output of
        the joined rows; the new rows' first step reads bos at position 0
        (:meth:`LeanState.positions`)."""
        state.join(fresh)
        joined = cat_rows(enc, new)
        state.offset = uniform_offset(joined.gate_offset)
        return joined

    @torch.inference_mode()
    def put(self, state: LeanState, enc: EncoderOutput, rows: Tensor, fresh: LeanState,
            new: EncoderOutput) -> EncoderOutput:
        """As :meth:`join`, the new sentences taking over rows ``rows`` (finished ones)
        instead: the other rows' caches are not copied."""
        state.put(rows, fresh)
        joined = put_rows(enc, rows, new)
        state.offset = uniform_offset(joined.gate_offset)
        return joined

    @torch.inference_mode()
    def decode_step(self, tokens: Tensor, enc: EncoderOutput, state: LeanState) -> Tensor:
        """tokens (B, 1) at position ``state.step`` (each row at its own where rows joined
        later: :meth:`LeanState.positions`) -> next-token logits (B, V)."""
        if not state.started:  # project the encoder output once for every later step
            self.start(enc, state)
        # one offset for every row stays one as rows are dropped or copied (beam search)
        offset = state.offset if not isinstance(state.offset, Tensor) else enc.gate_offset
        dec = self.model.decoder
        state.prepare_step()
        rows = state.positions()
        x = dec.embed(tokens) + (dec.positions(1, state.length) if rows is None
                                 else dec.positions.at(rows)[:, None])  # (B, 1, d)
        if enc.control is not None:
            x = x + enc.control
        tally = state.tally
        for w, cache, keys in zip(self.layers, state.caches, state.cross, strict=True):
            h = w.self_attn.step(w.self_norm(x), cache, offset, tally)
            if h is not None:  # None: the sub-layer's output is 0 for every row
                x = x + h
            h = w.cross_attn.step(w.cross_norm(x), keys, offset, tally)
            if h is not None:
                x = x + h
            h = w.ffn.step(w.ffn_norm(x), offset, tally)
            if h is not None:
                x = x + h
        state.length += 1
        if tally is not None:
            tally.step()
        return self.output(self.final_norm(x[:, 0]))  # (B, V)


def spent(enc: EncoderOutput) -> EncoderOutput:
    """``enc`` once a lean decode started from it: what its steps read (the control
    embeddings and gate offsets of its rows), with no encoder states (zero width)."""
    return EncoderOutput(enc.out[:, :0], enc.pad_mask[:, :0], enc.control, enc.gate_offset)


def cat_rows(a: EncoderOutput, b: EncoderOutput) -> EncoderOutput:
    """The rows of two :func:`spent` encoder outputs, ``a``'s then ``b``'s; rows without
    gate offsets where the others have them get 0 (what no offset means to a gate)."""
    assert a.out.size(1) == b.out.size(1) == 0, "spent encoder outputs"
    assert (a.control is None) == (b.control is None), "rows of one model"
    control = None if a.control is None else torch.cat([a.control, b.control])
    offset = (None if a.gate_offset is None and b.gate_offset is None
              else torch.cat([_row_offsets(a), _row_offsets(b)]))
    return EncoderOutput(torch.cat([a.out, b.out]), torch.cat([a.pad_mask, b.pad_mask]),
                         control, offset)


def put_rows(a: EncoderOutput, rows: Tensor, b: EncoderOutput) -> EncoderOutput:
    """:func:`spent` encoder output ``a`` with rows ``rows`` replaced by ``b``'s (offsets as
    :func:`cat_rows` fills them)."""
    assert a.out.size(1) == b.out.size(1) == 0, "spent encoder outputs"
    assert (a.control is None) == (b.control is None), "rows of one model"
    control = None if a.control is None else a.control.index_copy(0, rows, b.control)
    offset = (None if a.gate_offset is None and b.gate_offset is None
              else _row_offsets(a).index_copy(0, rows, _row_offsets(b)))
    return EncoderOutput(a.out, a.pad_mask, control, offset)


def _row_offsets(e: EncoderOutput) -> Tensor:
    """``e``'s gate offsets ``(B,)`` float32, 0 for each row where it has none."""
    if e.gate_offset is None:
        return torch.zeros(e.out.size(0), device=e.out.device)
    return e.gate_offset.float()


def lean_or_model(model: nn.Module) -> nn.Module | LeanDecoder:
    """:meth:`LeanDecoder.prepare` of ``model``, or ``model`` itself when it has none."""
    lean = LeanDecoder.prepare(model)
    return model if lean is None else lean


__all__ = ["LeanDecoder", "LeanState", "is_lean", "lean_or_model"]
