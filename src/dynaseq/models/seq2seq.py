"""Pre-LayerNorm Transformer encoder-decoder (Vaswani et al. 2017; "nda" layout).

The model composes blocks it is given: an :class:`Encoder` and a :class:`Decoder` each hold
an embedding, sinusoidal positions and a list of layers whose sub-layers were built
elsewhere (the translation task wires them from its config:
:func:`dynaseq.tasks.translation.model.build_seq2seq`, dense or with a technique's
sub-layers). Nothing here reads a config.

Example::

    model = build_seq2seq(ModelConfig(size="tiny"), vocab_size=8000, pad_id=0)
    out = model(src, tgt_in)          # src (B, S), tgt_in (B, T) -> out.logits (B, T, V)

A CCT model takes each row's budget as the call's ``control``: control-symbol ids, or a
:class:`~dynaseq.techniques.cct.gating.BudgetControl` that adds per-row calibrated gate offsets
(nothing about a budget is stored in the model, so rows of one batch may differ).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dynaseq.nn import (
    AuxOutputs,
    DecoderLayer,
    EncoderLayer,
    KVCache,
    SinusoidalPositions,
    padding_to_attn_mask,
)
from dynaseq.techniques.cct.gating import GATE_SUBNETWORKS, BudgetControl


class TokenEmbedding(nn.Module):
    """E[x] · sqrt(d_model); weights ~ N(0, d_model^-1/2). (B, T) long -> (B, T, d)."""

    def __init__(self, vocab_size: int, d_model: int, pad_id: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab_size, d_model) * d_model ** -0.5)
        with torch.no_grad():
            self.weight[pad_id].zero_()
        self.pad_id = pad_id
        self.scale = math.sqrt(d_model)

    @property
    def vocab_size(self) -> int:
        return self.weight.size(0)

    def forward(self, tokens: Tensor) -> Tensor:
        return nn.functional.embedding(tokens, self.weight, self.pad_id) * self.scale


Control = Tensor | int | BudgetControl | None
"""A call's control argument: (B,) control-symbol ids, one id, ids with per-row gate offsets
(:class:`BudgetControl`), or None (models without control symbols)."""


@dataclass
class EncoderOutput:
    """out: (B, S, d) encoder states; pad_mask: (B, S) bool, True at padding;
    control: (B, 1, d) control-symbol embedding the decoder adds to its inputs, or None;
    gate_offset: (B,) per-row offsets of the decoder's gates (its rows' calibrated budgets),
    or None. Row-aligned, so search keeps them with their rows (:meth:`index_select`)."""

    out: Tensor
    pad_mask: Tensor
    control: Tensor | None = None
    gate_offset: Tensor | None = None

    @property
    def attn_mask(self) -> Tensor:
        return padding_to_attn_mask(self.pad_mask)

    def index_select(self, index: Tensor) -> EncoderOutput:
        control = None if self.control is None else self.control.index_select(0, index)
        offset = None if self.gate_offset is None else self.gate_offset.index_select(0, index)
        return EncoderOutput(self.out.index_select(0, index),
                             self.pad_mask.index_select(0, index), control, offset)


@dataclass
class DecoderState:
    """Incremental decoding state: per-layer self- and cross-attention caches and the step."""

    self_caches: list[KVCache]
    cross_caches: list[KVCache]
    step: int = 0

    @classmethod
    def for_layers(cls, layers: Iterable[nn.Module]) -> DecoderState:
        """Empty caches of the kind each layer's attention sub-layers need."""
        layers = list(layers)
        return cls([layer.self_attn.new_cache(static=False) for layer in layers],
                   [layer.cross_attn.new_cache(static=True) for layer in layers])

    def reorder(self, index: Tensor) -> None:
        """Keep/reorder batch rows of every cache."""
        self.reorder_self(index)
        self.reorder_cross(index)

    def reorder_self(self, index: Tensor) -> None:
        """Keep/reorder batch rows of the self-attention caches only (beam search: the
        beams of one sentence share their cross-attention keys/values, so picking beams
        within a sentence leaves the cross-attention caches as they are)."""
        for cache in self.self_caches:
            cache.reorder(index)

    def reorder_cross(self, index: Tensor) -> None:
        """Keep/reorder batch rows of the cross-attention caches only."""
        for cache in self.cross_caches:
            cache.reorder(index)


@dataclass
class Seq2SeqOutput:
    """logits: (B, T, V); aux: auxiliary losses and traces from adaptive sub-layers."""

    logits: Tensor
    aux: AuxOutputs = field(default_factory=AuxOutputs)


class Encoder(nn.Module):
    """src (B, S) -> EncoderOutput. Embedding + positions + dropout, layers, final LayerNorm."""

    def __init__(self, embed: TokenEmbedding, positions: SinusoidalPositions,
                 layers: list[EncoderLayer], d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = embed
        self.positions = positions
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src: Tensor, aux: AuxOutputs | None = None,
                control: Tensor | None = None,
                gate_offset: Tensor | None = None) -> EncoderOutput:
        """control: (B, 1, d) added to every token's input embedding (CCT control symbol);
        gate_offset: (B,) per-row offsets of the layers' gates (CCT calibrated budget)."""
        x, pad_mask = self.embed_inputs(src, control)
        mask = padding_to_attn_mask(pad_mask)
        for layer in self.layers:
            x = layer(x, mask, aux=aux, gate_offset=gate_offset)
        return EncoderOutput(self.norm(x), pad_mask, control)


    def embed_inputs(self, src: Tensor, control: Tensor | None = None
                     ) -> tuple[Tensor, Tensor]:
        """The first layer's input (B, S, d) (embeddings, positions, control symbol,
        dropout) and the pad mask (B, S), True at padding."""
        pad_mask = src.eq(self.embed.pad_id)  # (B, S)
        x = self.embed(src) + self.positions(src.size(1))
        if control is not None:
            x = x + control
        return self.dropout(x), pad_mask


class Decoder(nn.Module):
    """tgt_in (B, T) + EncoderOutput -> logits (B, T, V), optionally one step at a time."""

    def __init__(self, embed: TokenEmbedding, positions: SinusoidalPositions,
                 layers: list[DecoderLayer], d_model: int, output_proj: nn.Linear,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = embed
        self.positions = positions
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(d_model)
        self.output_proj = output_proj
        self.dropout = nn.Dropout(dropout)

    def forward(self, tgt_in: Tensor, enc: EncoderOutput, state: DecoderState | None = None,
                aux: AuxOutputs | None = None, project: bool = True) -> Tensor:
        """tgt_in (B, T) -> logits (B, T, V); ``project=False``: the last layer's output
        (B, T, d) instead, before the final norm and the output layer (for a caller that
        wants only what ``aux`` records)."""
        offset = 0 if state is None else state.step
        x = self.embed(tgt_in) + self.positions(tgt_in.size(1), offset)
        if enc.control is not None:
            x = x + enc.control
        x = self.dropout(x)
        mask = enc.attn_mask
        for i, layer in enumerate(self.layers):
            x = layer(x, enc.out, mask,
                      self_cache=None if state is None else state.self_caches[i],
                      cross_cache=None if state is None else state.cross_caches[i], aux=aux,
                      gate_offset=enc.gate_offset)
        if state is not None:
            state.step += tgt_in.size(1)
        return self.output_proj(self.norm(x)) if project else x


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder translation model.

    ``forward(src, tgt_in)`` is teacher-forced: src (B, S), tgt_in (B, T) -> Seq2SeqOutput with
    logits (B, T, V). ``encode`` + ``decode_step`` give incremental decoding over cached
    keys/values: each step costs O(t) attention instead of recomputing the prefix.
    """

    def __init__(self, encoder: Encoder, decoder: Decoder, pad_id: int, bos_id: int,
                 eos_id: int, control_embed: nn.Embedding | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.control_embed = control_embed
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id

    @property
    def n_controls(self) -> int:
        """Number of control symbols (trained budgets); 0 for a model without them."""
        return 0 if self.control_embed is None else self.control_embed.num_embeddings

    def control_inputs(self, control: Control, batch: int,
                 device: torch.device) -> tuple[Tensor | None, dict[str, Tensor]]:
        """Control-symbol embeddings (B, 1, d) and per-row gate offsets {sub-network: (B,)}.

        ``control``: an int gives every sequence that symbol; a (B,) tensor one per
        sequence; a :class:`BudgetControl` adds the gate offsets of each row.
        """
        offsets: dict[str, Tensor] = {}
        if isinstance(control, BudgetControl):
            offsets = control.row_offsets(batch, device, GATE_SUBNETWORKS)
            control = control.ids
        if self.control_embed is None:
            if control is not None:
                raise ValueError("this model has no control symbols")
            if offsets:
                raise ValueError("this model has no gates to offset")
            return None, offsets
        if control is None:
            raise ValueError(f"this model needs a control symbol id in [0, {self.n_controls}) "
                             "per sequence")
        weight = self.control_embed.weight
        if isinstance(control, int):
            if not 0 <= control < self.n_controls:
                raise ValueError(f"control symbol {control} is not in [0, {self.n_controls})")
            return weight[control].expand(batch, 1, -1), offsets  # (B, 1, d)
        if control.shape != (batch,):
            raise ValueError(f"control ids must be one per sequence, shape ({batch},), got "
                             f"{tuple(control.shape)}")
        return self.control_embed(control.to(device)).unsqueeze(1), offsets  # (B, 1, d)

    def forward(self, src: Tensor, tgt_in: Tensor, control: Control = None) -> Seq2SeqOutput:
        """control: for models built with control symbols, (B,) control-symbol ids, one id
        for the whole batch, or a :class:`BudgetControl` (ids plus per-row gate offsets)."""
        aux = AuxOutputs()
        enc = self.encode(src, control, aux)
        return Seq2SeqOutput(self.decoder(tgt_in, enc, aux=aux), aux)

    def encode(self, src: Tensor, control: Control = None,
               aux: AuxOutputs | None = None) -> EncoderOutput:
        """src (B, S) -> EncoderOutput, which carries the rows' control embeddings and
        decoder gate offsets to every later decoder call (``control`` as in :meth:`forward`).
        """
        embedding, offsets = self.control_inputs(control, src.size(0), src.device)
        enc = self.encoder(src, aux=aux, control=embedding, gate_offset=offsets.get("encoder"))
        enc.gate_offset = offsets.get("decoder")
        return enc

    def init_state(self) -> DecoderState:
        return DecoderState.for_layers(self.decoder.layers)

    def decode_step(self, tokens: Tensor, enc: EncoderOutput, state: DecoderState) -> Tensor:
        """tokens (B, 1) at position ``state.step`` -> next-token logits (B, V)."""
        return self.decoder(tokens, enc, state)[:, -1]
