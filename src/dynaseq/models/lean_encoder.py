"""A lean forward pass for Transformer encoders (inference only): what classification runs.

:class:`~dynaseq.models.encoder.TransformerEncoder` goes through every sub-layer module, so
any technique fits; at batch 1 the per-operation overhead, not the arithmetic, sets the
time of a small encoder, and a CCT-BERT's gated sub-layers (two control nets, three
LayerNorms and four projections per attention, M pieces each with two LayerNorms per
feed-forward) made the full-budget CCT take 2.4x the dense encoder's time at batch 1
(``benchmarks/results/cct_bert.md``). :class:`LeanEncoder` runs the same computation
through each sub-layer's *lean part* (:mod:`dynaseq.nn.lean_step`, role ``"encoder"`` for
the self-attention, ``"ffn"`` for the feed-forward):

* dense attention fuses its q/k/v projections (:mod:`dynaseq.nn.lean_dense`); the CCT's
  gated attention runs both control nets as one product, projects keys/values and queries
  of the open tokens only, fused when every token is open
  (:mod:`dynaseq.techniques.cct.lean_step`); DMB attention runs each token's fused q/k/v
  through the branch its router picks (:mod:`dynaseq.techniques.branching.lean_step`);
* feed-forward parts read rows: they run on the valid tokens only (padding is not
  computed), each token a row with its row's gate offset; the CCT's M pieces run as fused
  products with their input LayerNorms folded into the first layer;
* a gated sub-layer whose gates are all off returns None: the residual is left as it is;
* realized compute without a second pass: given ``counts``, each layer application's gated
  parts count every row's open gates (:class:`~dynaseq.nn.lean_step.StepTally`), and
  :meth:`LeanEncoder.row_macs` forms each row's MACs from them with the sub-layers' own
  ``row_macs``/``pieces_row_macs`` and, for every gate open, ``all_on_row_macs`` of the
  row's length: the numbers the model's traces give per row (over the row's own tokens).

* dense attention with relative positions adds the module's position scores (ALBERTa);
* early exits (adaptive depth's structure predictor, per-layer exit rules) and LayerDrop's
  layer subsets run the model's own pass -- the regrouping by depth, the dropping of
  finished rows -- with each layer application through the lean parts
  (:meth:`LeanEncoder.output`, :meth:`LeanEncoder.apply_layer`, each row's keep
  probability scaling its residual branches).

Outputs at valid positions equal the module's forward pass up to float rounding (the tests
compare logits and labels for dense and CCT encoders, with padding, at single, per-row and
fixed budgets, and the early exits' outputs and depths).

Example::

    lean = LeanEncoder.prepare(model)              # None: the model's own forward
    logits = lean(tokens, segments, control)       # == model(tokens, segments, control).logits
    out = lean.output(tokens, exit=DepthExit(gamma=0.5))   # == model(tokens, exit=...)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import dynaseq.nn.lean_dense  # noqa: F401  (registers the dense sub-layers' lean parts)
from dynaseq.models.encoder import Control, EncoderModel, EncoderModelOutput
from dynaseq.nn import AuxOutputs, EncoderLayer
from dynaseq.nn.lean_step import Norm, StepTally, autocast_on, lean_part, uniform_offset
from dynaseq.nn.versions import unchanged, versions_of

Counts = dict[str, Tensor]
"""One layer application's per-row counts of open gates: ``NAME.q``, ``NAME.kv`` ``(B,)``
(attention), ``NAME.pieces`` ``(B, M)`` (feed-forward), keyed by the sub-layer's name."""


@dataclass(frozen=True)
class _Layer:
    """One encoder layer's input norms and its sub-layers' lean parts."""

    attn_norm: Norm
    attn: object  # LeanEncoderAttention
    ffn_norm: Norm
    ffn: object  # LeanFeedForward

    @property
    def sources(self) -> list[Tensor]:
        return [*self.attn.sources, *self.ffn.sources]


def lean_layers(layers: Sequence[nn.Module]) -> list[_Layer] | None:
    """The lean parts of ``layers`` (copies of fused or folded weights), or None unless every
    one is an :class:`EncoderLayer` with LayerNorms and sub-layers that have a lean part."""
    out = []
    for layer in layers:
        if type(layer) is not EncoderLayer:
            return None
        norms = [Norm.of(layer.self_attn_norm), Norm.of(layer.ffn_norm)]
        parts = [lean_part(layer.self_attn, "encoder"), lean_part(layer.ffn, "ffn")]
        if any(p is None for p in (*norms, *parts)):
            return None
        out.append(_Layer(norms[0], parts[0], norms[1], parts[1]))
    return out


def layer_modules(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules whose replacement makes lean parts of ``layers`` stale."""
    return [m for layer in layers
            for m in (layer, layer.self_attn_norm, layer.self_attn, layer.ffn_norm, layer.ffn)]


def _lean_layers(model: nn.Module) -> list[_Layer] | None:
    """:func:`lean_layers` of an :class:`EncoderModel`; None for anything else."""
    if not isinstance(model, EncoderModel):
        return None
    return lean_layers(model.encoder.layers)


def run_layers(layers: list[_Layer], plan: Sequence[int], x: Tensor, valid: Tensor | None,
               offsets: Tensor | None, counts: list[Counts] | None = None,
               scale: Tensor | None = None, first_only: bool = False) -> Tensor:
    """The layer applications ``plan`` (indices into ``layers``) on ``x`` ``(B, S, d)``
    (the first layer's input), ``valid`` ``(B, S)`` True at the tokens (None: no padding),
    ``offsets`` the rows' gate offsets ``(B,)`` (or None) -> the last layer's output
    ``(B, S, d)`` at the valid positions (padding positions are not computed past ``x``:
    nothing reads them); ``counts``: receives one :data:`Counts` per application (see the
    module docstring); ``scale`` ``(B,)``: every residual branch of each row multiplied by
    it (adaptive depth's keep probability, ``H + p·F(H)``; None: unscaled).

    ``first_only`` (what a first-token head reads): the last application runs for each
    row's first token alone (:func:`_first_token_layer`: its query over every key and
    value, its feed-forward), and the output is that token's, ``(B, 1, d)``. Not with
    ``counts``: the gated sub-layers would count one token."""
    assert not (first_only and counts is not None), "first_only counts no gates"
    b, s, d = x.shape
    idx = None if valid is None else valid.reshape(-1).nonzero().squeeze(1)  # (N,) tokens
    offset = uniform_offset(offsets)
    token_offset = offset  # the feed-forward's rows are tokens: each its row's offset
    if isinstance(offset, Tensor):
        token_offset = _per_token(offset, s, idx)
    token_scale = None if scale is None else _per_token(scale, s, idx)[:, None, None]
    row_scale = None if scale is None else scale[:, None, None]
    row_of = None  # the row of each feed-forward row (token), for its counts
    if counts is not None:
        row_of = _per_token(torch.arange(b, device=x.device), s, idx)
    for n, i in enumerate(plan):
        w = layers[i]
        if first_only and n == len(plan) - 1:
            return _first_token_layer(w, x, valid, offset, row_scale)
        attn_tally = None if counts is None else StepTally(b, x.device)
        h = w.attn.encode(w.attn_norm(x), valid, offset, attn_tally)
        if h is not None:  # None: the sub-layer's output is 0 for every token
            x = x + (h if row_scale is None else row_scale * h)
        rows = w.ffn_norm(x).reshape(b * s, 1, d)
        if idx is not None:
            rows = rows.index_select(0, idx)
        ffn_tally = None if counts is None else StepTally(rows.size(0), x.device)
        h = w.ffn.step(rows, token_offset, ffn_tally)
        if h is not None:
            if token_scale is not None:
                h = token_scale * h
            x = (x + h.view(b, s, d) if idx is None
                 else x.reshape(b * s, d).index_add(0, idx, h[:, 0]).view(b, s, d))
        if counts is not None:
            got = {k: v for k, v in attn_tally.counts().items() if k != "steps"}
            for key, v in ffn_tally.counts().items():  # per token -> per row
                if key != "steps":
                    got[key] = v.new_zeros(b, *v.shape[1:]).index_add_(0, row_of, v)
            counts.append(got)
    return x


def _first_token_layer(w: _Layer, x: Tensor, valid: Tensor | None,
                       offset: Tensor | float | None, row_scale: Tensor | None) -> Tensor:
    """Layer ``w`` on ``x`` ``(B, S, d)`` -> its output at each row's first token alone,
    ``(B, 1, d)``: :func:`run_layers`' ``first_only``. The self-attention reads every key
    and value for the first query (``encode_first``); the feed-forward runs the first tokens
    alone (one row each, with its row's gate offset)."""
    h = w.attn.encode_first(w.attn_norm(x), valid, offset)
    x = x[:, :1]
    if h is not None:  # None: the sub-layer's output is 0 for every first token
        x = x + (h if row_scale is None else row_scale * h)
    h = w.ffn.step(w.ffn_norm(x), offset, None)
    if h is None:  # every gate closed: the residual as it is
        return x
    return x + (h if row_scale is None else row_scale * h)


def valid_tokens(pad_mask: Tensor) -> Tensor | None:
    """(B, S) True at padding -> :func:`run_layers`'s ``valid`` (None without padding)."""
    return ~pad_mask if bool(pad_mask.any()) else None


def _per_token(row_values: Tensor, s: int, idx: Tensor | None) -> Tensor:
    """(B,) one value per row -> (N,) one per token (B·S, or the ``idx`` tokens)."""
    out = row_values.repeat_interleave(s)
    return out if idx is None else out.index_select(0, idx)


class LeanEncoder:
    """The lean forward pass of an :class:`EncoderModel` (see the module docstring). Build it
    with :meth:`prepare`; :meth:`is_current` says whether the model's weights or modules
    changed since (then prepare anew)."""

    def __init__(self, model: EncoderModel, layers: list[_Layer]) -> None:
        self.model = model
        self.layers = layers
        self._sources = [t for layer in layers for t in layer.sources]
        self._versions = versions_of(self._sources)
        self._modules = layer_modules(model.encoder.layers)

    @classmethod
    def prepare(cls, model: nn.Module) -> LeanEncoder | None:
        """The lean encoder of ``model``, or None where it has none (MoE sub-layers, int8
        CCT: the model's own forward runs) or inside the caller's ``torch.autocast``
        (:func:`~dynaseq.nn.lean_step.autocast_on`)."""
        if autocast_on(model):
            return None
        with torch.no_grad():
            layers = _lean_layers(model)
        return None if layers is None else cls(model, layers)

    def is_current(self) -> bool:
        """False once a copied weight changed in place or was given new storage or dtype
        (:func:`~dynaseq.nn.versions.version_of`) or a layer module was replaced."""
        return (self._modules == layer_modules(self.model.encoder.layers)
                and unchanged(self._sources, self._versions))

    @torch.inference_mode()
    def encode(self, tokens: Tensor, segments: Tensor | None = None, control: Control = None,
               counts: list[Counts] | None = None, first_only: bool = False
               ) -> tuple[Tensor, Tensor]:
        """tokens, segments ``(B, S)``; ``control``: as the model's -> (hidden ``(B, S, d)``,
        pad_mask ``(B, S)``, True at padding). Hidden states at padding positions are not
        computed past the embeddings (nothing reads them). ``counts``: receives one
        :data:`Counts` per layer application, in the encoder's plan order (not for an
        adaptive-depth encoder, whose full depth runs through the model's pass with
        :meth:`apply_layer`). ``first_only``: the first token's hidden state alone,
        ``(B, 1, d)`` (:func:`run_layers`), for an encoder without a structure predictor
        and without ``counts``."""
        self._check_eval()
        model, enc = self.model, self.model.encoder
        if enc.predictor is not None:
            if counts is not None:
                raise ValueError("gate counts are for encoders without a structure predictor")
            assert not first_only, "an adaptive-depth encoder runs the model's pass"
            return model.encode(tokens, segments, control, run=self.apply_layer)
        emb, offsets = model.control_inputs(control, tokens.size(0), tokens.device)
        x, pad_mask = enc.embed(tokens, segments, emb)  # (B, S, d)
        x = run_layers(self.layers, enc.plan, x, valid_tokens(pad_mask), offsets, counts,
                       first_only=first_only)
        return enc.norm(x), pad_mask

    def __call__(self, tokens: Tensor, segments: Tensor | None = None,
                 control: Control = None, counts: list[Counts] | None = None) -> Tensor:
        """The head's output (classification: ``(B, n_out)``), as the model's ``logits``;
        ``counts``: as :meth:`encode`. A head that reads the first token alone
        (``reads_first_token``: classification's pooler) gets only that token's hidden
        state: the last layer's feed-forward runs on it alone, unless gates are counted."""
        first_only = (counts is None and self.model.encoder.predictor is None
                      and getattr(self.model.head, "reads_first_token", False))
        hidden, _ = self.encode(tokens, segments, control, counts, first_only=first_only)
        with torch.inference_mode():
            return self.model.head(hidden)

    @torch.inference_mode()
    def output(self, tokens: Tensor, segments: Tensor | None = None, control: Control = None,
               **kw: object) -> EncoderModelOutput:
        """The model's forward pass with every layer application through its lean part
        (:meth:`apply_layer`): ``kw`` as the model's (an early ``exit``, a ``layers``
        subset), its traces (the depths rows ran) in ``aux``; the gated sub-layers record
        no gate traces here (count them with :meth:`encode`)."""
        self._check_eval()
        return self.model(tokens, segments, control, run=self.apply_layer, **kw)

    def apply_layer(self, i: int, x: Tensor, attn_mask: Tensor | None,
                    aux: AuxOutputs | None = None, gate_offset: Tensor | None = None,
                    scale: Tensor | None = None) -> Tensor:
        """Layer module ``i``'s lean parts on x ``(R, S, d)`` (a
        :data:`~dynaseq.models.encoder.LayerRun`: what the model's pass calls for each
        layer application, early exits included); ``aux`` is not written."""
        valid = None if attn_mask is None else attn_mask[:, 0, 0, :]
        return run_layers(self.layers, [i], x, valid, gate_offset,
                          scale=None if scale is None else scale.reshape(-1))

    def _check_eval(self) -> None:
        if self.model.training:
            raise ValueError("LeanEncoder runs inference only: put the model in eval mode")

    def row_macs(self, counts: list[Counts], n_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's MACs in the gated sub-layers, ``(ran, every gate open)``, ``(B,)`` long
        each, from the ``counts`` of a pass (:meth:`encode`) over rows of ``n_tokens``
        ``(B,)`` tokens: what the model's traces count per row over its own tokens
        (``realized_macs_by_row`` with the padding left out). Sub-layers without gates
        (no ``row_macs``) count nothing, as there."""
        enc = self.model.encoder
        ran = torch.zeros_like(n_tokens)
        full = torch.zeros_like(n_tokens)
        for i, got in zip(enc.plan, counts, strict=True):
            attn, ffn = enc.layers[i].self_attn, enc.layers[i].ffn
            if hasattr(attn, "row_macs"):
                kv = got[f"{attn.name}.kv"]
                ran += attn.row_macs(got[f"{attn.name}.q"], kv, kv, n_tokens, n_tokens)
                full += attn.all_on_row_macs(n_tokens, n_tokens)
            if hasattr(ffn, "pieces_row_macs"):
                ran += ffn.pieces_row_macs(got[f"{ffn.name}.pieces"], n_tokens)
                full += ffn.all_on_row_macs(n_tokens)
        return ran, full


__all__ = ["Counts", "LeanEncoder", "layer_modules", "lean_layers", "run_layers",
           "valid_tokens"]
