"""A classification encoder with an internal classifier after every layer (BranchyNet,
Shallow-Deep, PABEE; the baselines of adaptive depth) and batched per-layer early exit.

Layer k's classifier reads the final LayerNorm of the layer's output, ``head_k(LN(h_k))``
(:class:`~dynaseq.models.encoder.ClassificationHead`: pooler on the first token, dropout,
linear); the last layer's is the model's ``head``, so the full-depth output is the plain
model's. A row leaving after layer k gets exactly that: its logits are ``head_k``'s and its
hidden states ``LN(h_k)``.

Example::

    model = MultiExitEncoderModel(encoder, head, exit_heads)    # len(exit_heads) = L - 1
    out = model(tokens, segments)            # every layer; aux.traces[EXIT_LOGITS]: L logits
    out = model(tokens, segments, exit=LayerExit("pabee", patience=2))
    out.aux.traces[EXIT_LAYER][0]            # (B,) layers each row ran
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dynaseq.models.encoder import (
    ClassificationHead,
    Control,
    EncoderModel,
    EncoderModelOutput,
    LayerRun,
    TransformerEncoder,
    _attn_mask,
)
from dynaseq.nn import AuxOutputs
from dynaseq.techniques.depth.exits import LAYER_ROWS
from dynaseq.techniques.depth.multi_exit import EXIT_LAYER, EXIT_LOGITS, LayerExit


class MultiExitEncoderModel(EncoderModel):
    """An encoder (without a structure predictor) whose every layer application has a
    classifier: ``exit_heads[k]`` after layer k < L − 1, ``head`` after the last.

    ``forward(tokens, segments=None, control=None, select=None, exit=None)``: without an
    exit every layer runs and ``aux.traces[EXIT_LOGITS]`` holds the L classifiers' logits
    (B, C) in layer order (training's loss weighs them); with a
    :class:`~dynaseq.techniques.depth.multi_exit.LayerExit` each row stops at the first
    layer its rule accepts (:meth:`_run_exits`)."""

    def __init__(self, encoder: TransformerEncoder, head: ClassificationHead,
                 exit_heads: list[ClassificationHead],
                 control_embed: nn.Embedding | None = None) -> None:
        super().__init__(encoder, head, control_embed)
        if encoder.predictor is not None:
            raise ValueError("internal classifiers and a structure predictor do not combine")
        if len(exit_heads) != encoder.depth - 1:
            raise ValueError(f"{len(exit_heads)} internal classifiers for an encoder of depth "
                             f"{encoder.depth} (one per layer but the last, whose is head)")
        self.exit_heads = nn.ModuleList(exit_heads)

    def classifier(self, k: int) -> nn.Module:
        """The classifier after layer application k (0-based)."""
        return self.exit_heads[k] if k < len(self.exit_heads) else self.head

    def forward(self, tokens: Tensor, segments: Tensor | None = None, control: Control = None,
                select: Tensor | None = None, exit: LayerExit | None = None,
                layers: tuple[int, ...] | None = None,
                run: LayerRun | None = None) -> EncoderModelOutput:
        """As :meth:`EncoderModel.forward`; ``layers`` (a fixed subset of the plan) must be
        None: every internal classifier reads its own layer."""
        if layers is not None:
            raise ValueError("a multi-exit model runs its layers in order (no layer subset)")
        if exit is not None and not isinstance(exit, LayerExit):
            raise ValueError("a multi-exit model exits by a per-layer rule (LayerExit); it has "
                             "no structure predictor")
        aux = AuxOutputs()
        run = self.encoder.apply_layer if run is None else run
        emb, offset = self.control_inputs(control, tokens.size(0), tokens.device)
        x, pad_mask = self.encoder.embed(tokens, segments, emb)
        if exit is not None:
            return self._run_exits(x, pad_mask, offset, exit, aux, run)
        enc = self.encoder
        mask = _attn_mask(pad_mask)
        for k, i in enumerate(enc.plan[:-1]):
            x = run(i, x, mask, aux=aux, gate_offset=offset)
            aux.add_trace(EXIT_LOGITS, self.exit_heads[k](enc.norm(x[:, :1])))  # (B, C)
        x = run(enc.plan[-1], x, mask, aux=aux, gate_offset=offset)
        hidden = enc.norm(x)
        logits = self.head(hidden)
        aux.add_trace(EXIT_LOGITS, logits)
        return EncoderModelOutput(hidden, pad_mask, logits, aux)

    def _run_exits(self, x: Tensor, pad_mask: Tensor, offset: Tensor | None, exit: LayerExit,
                   aux: AuxOutputs, run: LayerRun) -> EncoderModelOutput:
        """Batched per-layer exit: x (B, S, d) the first layer's input.

        After each layer the rows still running go through that layer's classifier; the
        rule decides from their logits so far which finish (they keep those logits and
        ``LN`` of their state), and the next layer runs on the others only, index-selected
        and cut to the longest of them (no row waits for the slowest; padding beyond the
        longest survivor is not computed). Writes ``EXIT_LAYER`` and ``LAYER_ROWS`` traces."""
        enc = self.encoder
        b, n_out, device = x.size(0), self.head.n_out, x.device
        if n_out < 2:
            raise ValueError("per-layer exit rules read class probabilities; a regression "
                             "head (one output) has none")
        rule = exit.exit_rule
        value = exit.values(b, device)  # (R,) the rule's parameter per running row
        lengths = (~pad_mask).sum(-1)  # (B,)
        rows = torch.arange(b, device=device)  # the running rows' places in the batch
        hidden = torch.zeros_like(x)
        logits = x.new_empty(b, n_out)
        ran = torch.full((b,), enc.depth, dtype=torch.long, device=device)
        history = x.new_empty(b, 0, n_out)  # (R, k, C) logits of the layers run so far
        layer_rows = []
        width = int(lengths.max())
        x, pm = x[:, :width], pad_mask[:, :width]
        for k, i in enumerate(enc.plan):
            layer_rows.append(len(rows))
            x = run(i, x, _attn_mask(pm), aux=aux, gate_offset=offset)
            z = self.classifier(k)(enc.norm(x[:, :1]))  # (R, C)
            history = torch.cat([history, z[:, None]], 1)
            if k == enc.depth - 1:  # the last layer: every row still running finishes
                done = torch.ones(len(rows), dtype=torch.bool, device=device)
            else:
                done = rule.done(history, value)
            if not bool(done.any()):
                continue
            left = done.nonzero().squeeze(1)
            ids = rows[left]
            logits[ids] = z[left]
            hidden[ids, :x.size(1)] = enc.norm(x[left])
            ran[ids] = k + 1
            stay = (~done).nonzero().squeeze(1)
            if len(stay) == 0:
                break
            rows, history, value = rows[stay], history[stay], value[stay]
            offset = None if offset is None else offset[stay]
            width = int(lengths[rows].max())
            x, pm = x.index_select(0, stay)[:, :width], pad_mask[rows, :width]
        aux.add_trace(EXIT_LAYER, ran)
        aux.add_trace(LAYER_ROWS, layer_rows)
        hidden = hidden.masked_fill_(pad_mask[..., None], 0.0)  # (B, S, d), padding zero
        return EncoderModelOutput(hidden, pad_mask, logits, aux)
