"""Pre-LayerNorm Transformer encoder (BERT-style) with ALBERT options, and its two heads.

The model composes blocks it is given (the encoder tasks wire them from their config:
:func:`dynaseq.tasks.encoder.model.build_encoder_model`); nothing here reads a config.

* :class:`EncoderEmbeddings`: token + learned position + segment embeddings of width E,
  LayerNorm, and, when E < d (ALBERT's factorized embedding, Lan et al. 2020 sec. 3.1),
  a projection E -> d. Parameters ``V·E + E·d`` instead of ``V·d``.
* :class:`TransformerEncoder`: the embeddings, a stack of pre-LN
  :class:`~dynaseq.nn.EncoderLayer` s whose sub-layers were built elsewhere (dense, or the
  CCT's gated ones), and a final LayerNorm. Cross-layer parameter sharing (ALBERT sec. 3.1)
  is a ``plan``: position i of the ``depth`` applications runs layer module ``plan[i]``, so
  ``plan = [0] * L`` shares one layer across all positions, ``[0, 0, 1, 1]`` two groups.
* :class:`MLMHead`: ``LN(GELU(h W_t)) E_tok^T + b`` at the masked positions, the output
  matrix tied to the token embedding (width E, so factorized models stay tied);
* :class:`ClassificationHead`: the BERT pooler ``tanh(h_[CLS] W_p)`` (first token), dropout
  and a linear layer to the task's labels (1 output for a regression).

:class:`EncoderModel` joins an encoder, one head and, for a CCT, the control-symbol
embedding: each row's budget is an argument of the call (control ids, or a
:class:`~dynaseq.techniques.cct.gating.BudgetControl` with per-row gate offsets), added to
every token's input like the seq2seq encoder's control symbol; nothing is stored.

Example::

    out = model(tokens, segments)              # tokens, segments (B, S) long
    out.logits                                  # classification (B, n_out) / MLM (N, V)
    model(tokens, segments, control=2)          # a CCT at its third trained budget
    model(tokens, segments, layers=(0, 2))      # LayerDrop: plan positions 0 and 2 only
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from dynaseq.nn import AuxOutputs, EncoderLayer, padding_to_attn_mask
from dynaseq.techniques.cct.gating import BudgetControl
from dynaseq.techniques.depth.exits import DEPTH_PROBS, DEPTH_RUN, LAYER_ROWS, DepthExit
from dynaseq.techniques.depth.predictor import StructurePredictor

LAYERDROP_UNUSED = "layerdrop_unused"
"""``AuxOutputs.losses`` key: 0 · the parameters of the layers LayerDrop skipped (DDP)."""

ENCODER_SUBNETWORKS = ("encoder",)
"""The gated sub-network of an encoder-only CCT (the first component of its gates' paths)."""

Control = Tensor | int | BudgetControl | None
"""A call's budget: (B,) control-symbol ids, one id, a :class:`BudgetControl`, or None."""

LayerRun = Callable[..., Tensor]
"""How a forward pass applies layer module ``i``: ``run(i, x, attn_mask, aux=, gate_offset=,
scale=)`` with x ``(R, S, d)``, ``attn_mask`` ``(R, 1, 1, S)`` allowed keys or None, the rows'
gate offsets ``(R,)`` and keep probabilities ``scale`` ``(R, 1, 1)`` (or None) -> ``(R, S, d)``
(:meth:`TransformerEncoder.apply_layer`, the module; or
:meth:`dynaseq.models.lean_encoder.LeanEncoder.apply_layer`, its lean parts)."""


class EncoderEmbeddings(nn.Module):
    """tokens, segments (B, S) long -> (B, S, d): ``proj(LN(E_tok[x] + E_pos[t] + E_seg[s]))``.

    ``embedding_dim`` E < ``d_model`` adds the projection E -> d (ALBERT's factorization);
    E == d has none. Weights ~ N(0, 0.02²) as in BERT; the pad row is zero.
    ``absolute_positions=False`` drops ``E_pos`` (for models with relative positions only).
    """

    def __init__(self, vocab_size: int, embedding_dim: int, d_model: int, max_positions: int,
                 n_segments: int, pad_id: int, absolute_positions: bool = True) -> None:
        super().__init__()
        if embedding_dim > d_model:
            raise ValueError(f"embedding_dim={embedding_dim} must be <= d_model={d_model}")
        self.tokens = nn.Embedding(vocab_size, embedding_dim, padding_idx=pad_id)
        # absolute_positions=False (relative positions only, an ablation): no table
        self.positions = nn.Embedding(max_positions, embedding_dim) if absolute_positions else None
        self.segments = nn.Embedding(n_segments, embedding_dim)
        for emb in (self.tokens, self.positions, self.segments):
            if emb is not None:
                nn.init.normal_(emb.weight, std=0.02)
        with torch.no_grad():
            self.tokens.weight[pad_id].zero_()
        self.norm = nn.LayerNorm(embedding_dim)
        self.proj = nn.Linear(embedding_dim, d_model) if embedding_dim < d_model else None
        self.pad_id = pad_id
        self.max_positions = max_positions

    @property
    def vocab_size(self) -> int:
        return self.tokens.num_embeddings

    def forward(self, tokens: Tensor, segments: Tensor | None = None) -> Tensor:
        s = tokens.size(1)
        if s > self.max_positions:
            raise ValueError(f"{s} tokens exceed max_positions={self.max_positions}")
        x = self.tokens(tokens)  # (B, S, E)
        if self.positions is not None:
            x = x + self.positions.weight[:s]
        if segments is not None:
            x = x + self.segments(segments)
        else:
            x = x + self.segments.weight[0]
        x = self.norm(x)
        return x if self.proj is None else self.proj(x)  # (B, S, d)

    def macs(self, n_tokens: int) -> dict[str, int]:
        """Look-ups are free; the factorization's projection costs ``E·d`` per token."""
        if self.proj is None:
            return {"embedding": 0}
        return {"embedding": 0,
                "embedding_proj": n_tokens * self.proj.in_features * self.proj.out_features}


def _attn_mask(pad_mask: Tensor) -> Tensor | None:
    """(B, 1, 1, S) allowed keys; None without padding, so attention can take its fused
    kernel."""
    return padding_to_attn_mask(pad_mask) if bool(pad_mask.any()) else None


class TransformerEncoder(nn.Module):
    """tokens (B, S) -> hidden states (B, S, d): embeddings, ``len(plan)`` layer applications,
    final LayerNorm (pre-LN).

    ``layers``: the distinct layer modules; ``plan[i]``: which one runs at depth i (default
    one each, no sharing). A shared layer's parameters count once and its gated sub-layers
    report one trace per application.

    ``predictor`` (adaptive depth, ALBERTa): a :class:`~dynaseq.techniques.depth.predictor.
    StructurePredictor` read after its ``first_group`` layers; the K = depth − first_group
    layers after it scale their residual branches by its keep probabilities p (B, K)
    (``H~ = H + p_i·MHA(LN(H))``, ``H' = H~ + p_i·FFN(LN(H~))``). With an ``exit``
    (:class:`~dynaseq.techniques.depth.exits.DepthExit`) each row stops at its depth and is
    not computed after it (see :meth:`_run_exits`).

    ``layers`` (a call argument; LayerDrop, Fan et al. 2019): the positions of ``plan`` to
    run, increasing; the others are skipped (not entered). Training draws them per
    micro-batch (:func:`~dynaseq.techniques.depth.layerdrop.sample_layers`), inference
    prunes to a fixed depth (:func:`~dynaseq.techniques.depth.layerdrop.every_other`).
    """

    def __init__(self, embeddings: EncoderEmbeddings, layers: list[EncoderLayer],
                 d_model: int, plan: list[int] | None = None, dropout: float = 0.0,
                 predictor: StructurePredictor | None = None) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.layers = nn.ModuleList(layers)
        self.plan = list(range(len(layers))) if plan is None else list(plan)
        if not self.plan or sorted(set(self.plan)) != list(range(len(layers))):
            raise ValueError(f"plan {self.plan} must use each of the {len(layers)} layers")
        if predictor is not None and (
                predictor.first_group + predictor.n_adaptive != len(self.plan)):
            raise ValueError(f"the structure predictor covers {predictor.first_group} + "
                             f"{predictor.n_adaptive} layers, the encoder has {len(self.plan)}")
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.predictor = predictor

    @property
    def depth(self) -> int:
        return len(self.plan)

    def embed(self, tokens: Tensor, segments: Tensor | None = None,
              control: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The first layer's input (B, S, d) (embeddings, control symbol, dropout) and the
        pad mask (B, S), True at padding."""
        pad_mask = tokens.eq(self.embeddings.pad_id)
        x = self.embeddings(tokens, segments)
        if control is not None:
            x = x + control
        return self.dropout(x), pad_mask

    def forward(self, tokens: Tensor, segments: Tensor | None = None,
                control: Tensor | None = None, gate_offset: Tensor | None = None,
                aux: AuxOutputs | None = None,
                exit: DepthExit | None = None,
                layers: Sequence[int] | None = None,
                run: LayerRun | None = None) -> tuple[Tensor, Tensor]:
        """Returns (hidden (B, S, d), pad_mask (B, S) bool, True at padding).

        control: (B, 1, d) control-symbol embedding added to every token's input (CCT);
        gate_offset: (B,) per-row offsets of the gates (a calibrated budget); exit: early
        exit (adaptive depth; the hidden states of a row's padding are then zero);
        layers: the positions of ``plan`` to run (LayerDrop; None: all); run: how each
        layer application runs (default :meth:`apply_layer`, the module)."""
        run = self.apply_layer if run is None else run
        x, pad_mask = self.embed(tokens, segments, control)
        mask = _attn_mask(pad_mask)
        if layers is not None:
            return self._run_subset(x, mask, layers, gate_offset, aux, exit, run), pad_mask
        first = self.depth if self.predictor is None else self.predictor.first_group
        for i in self.plan[:first]:
            x = run(i, x, mask, aux=aux, gate_offset=gate_offset)
        if self.predictor is None:
            if exit is not None:
                raise ValueError("this encoder has no structure predictor (no adaptive depth) "
                                 "to exit early with")
            return self.norm(x), pad_mask
        p = self.predictor(x)  # (B, K) keep probabilities
        if aux is not None:
            aux.add_trace(DEPTH_PROBS, p)
        if exit is not None:
            depths = exit.depths(p, self.predictor.n_adaptive)
            return self._run_exits(x, pad_mask, p, depths, gate_offset, aux, run), pad_mask
        for k, i in enumerate(self.plan[first:]):
            x = run(i, x, mask, aux=aux, gate_offset=gate_offset, scale=p[:, k, None, None])
        return self.norm(x), pad_mask

    def apply_layer(self, i: int, x: Tensor, attn_mask: Tensor | None,
                    **kw: Tensor | AuxOutputs | None) -> Tensor:
        """Layer module ``i`` on x (the default :data:`LayerRun`)."""
        return self.layers[i](x, attn_mask, **kw)

    def _run_subset(self, x: Tensor, mask: Tensor | None, layers: Sequence[int],
                    gate_offset: Tensor | None, aux: AuxOutputs | None,
                    exit: DepthExit | None, run: LayerRun) -> Tensor:
        """LayerDrop: x (B, S, d) after the embeddings -> final hidden (B, S, d), running the
        plan positions ``layers`` only. In training, a layer module none of them runs adds
        ``0 · Σ its parameters`` to ``aux``'s losses, so that every parameter still takes part
        in the step (DDP without ``find_unused_parameters``); the module is not entered."""
        if self.predictor is not None or exit is not None:
            raise ValueError("layers (LayerDrop) is for encoders without a structure predictor "
                             "(adaptive depth has its own exit)")
        positions = list(layers)
        if any(not 0 <= j < self.depth for j in positions) or positions != sorted(set(positions)):
            raise ValueError(f"layers must be increasing positions in [0, {self.depth}), got "
                             f"{positions}")
        for j in positions:
            x = run(self.plan[j], x, mask, aux=aux, gate_offset=gate_offset)
        if self.training and aux is not None:
            ran = {self.plan[j] for j in positions}
            unused = [p for i, m in enumerate(self.layers) if i not in ran
                      for p in m.parameters() if p.requires_grad]
            if unused:
                aux.add_loss(LAYERDROP_UNUSED, sum(p.sum() for p in unused) * 0.0)
        return self.norm(x)

    def _run_exits(self, x: Tensor, pad_mask: Tensor, p: Tensor, depths: Tensor,
                   gate_offset: Tensor | None, aux: AuxOutputs | None, run: LayerRun) -> Tensor:
        """Batched early exit: x (B, S, d) after the first group, depths (B,) -> final
        hidden (B, S, d).

        The rows are ordered by depth (deepest first), so the rows still running at adaptive
        layer k are a prefix of that order: layer k runs on that prefix only, cut to the
        longest of its rows (right padding beyond it is not computed). A row leaving after
        layer k gets the final LayerNorm of its state then, which is exactly its output of the
        model truncated at k. Writes ``DEPTH_RUN`` and ``LAYER_ROWS`` traces."""
        if x.size(0) == 1:  # one row: no order, no cut, no scatter (the same arithmetic)
            first, k = self.predictor.first_group, int(depths[0])
            mask = _attn_mask(pad_mask)
            for j, i in enumerate(self.plan[first:first + k]):
                x = run(i, x, mask, aux=aux, gate_offset=gate_offset, scale=p[:, j, None, None])
            if aux is not None:
                aux.add_trace(DEPTH_RUN, depths)
                aux.add_trace(LAYER_ROWS, [1] * k)
            return self.norm(x).masked_fill_(pad_mask[..., None], 0.0)
        order = torch.argsort(depths, descending=True, stable=True)
        lengths = (~pad_mask).sum(-1)[order].tolist()
        running = [int(n) for n in (depths[order][None, :] > torch.arange(
            p.size(1) + 1, device=depths.device)[:, None]).sum(-1).tolist()]  # (K+1,)
        x, pm_sorted, p = x[order], pad_mask[order], p[order]
        offset = None if gate_offset is None else gate_offset[order]
        out = torch.zeros_like(x)
        first = self.predictor.first_group
        n_prev = x.size(0)
        layer_rows = []
        for k, n in enumerate([*running[:-1], 0]):
            if n < n_prev:  # rows n .. n_prev leave before adaptive layer k
                width = max(lengths[n:n_prev])
                out[order[n:n_prev], :width] = self.norm(x[n:n_prev, :width])
            if n == 0:
                break
            width = max(lengths[:n])
            x, pm = x[:n, :width], pm_sorted[:n, :width]
            x = run(self.plan[first + k], x, _attn_mask(pm), aux=aux,
                    gate_offset=None if offset is None else offset[:n], scale=p[:n, k, None, None])
            layer_rows.append(n)
            n_prev = n
        if aux is not None:
            aux.add_trace(DEPTH_RUN, depths)
            aux.add_trace(LAYER_ROWS, layer_rows)
        return out.masked_fill_(pad_mask[..., None], 0.0)  # (B, S, d), padding zero


class MLMHead(nn.Module):
    """h (N, d) -> logits (N, V) = ``LN(GELU(h W_t + b_t)) E_tok^T + b`` (BERT's MLM head;
    the output matrix is the token embedding ``E_tok`` (V, E), tied)."""

    def __init__(self, d_model: int, token_embedding: nn.Embedding) -> None:
        super().__init__()
        e = token_embedding.embedding_dim
        self.transform = nn.Linear(d_model, e)
        self.norm = nn.LayerNorm(e)
        self.decoder_weight = token_embedding.weight  # tied: the same Parameter
        self.bias = nn.Parameter(torch.zeros(token_embedding.num_embeddings))

    def forward(self, hidden: Tensor, select: Tensor | None = None) -> Tensor:
        """hidden (B, S, d), select (B, S) bool (default all) -> (N, V), N selected."""
        h = hidden[select] if select is not None else hidden.reshape(-1, hidden.size(-1))
        h = self.norm(nn.functional.gelu(self.transform(h)))
        return nn.functional.linear(h, self.decoder_weight, self.bias)

    def macs(self, n_tokens: int) -> dict[str, int]:
        v, e = self.decoder_weight.shape
        return {"mlm_transform": n_tokens * self.transform.in_features * e,
                "mlm_output": n_tokens * e * v}


class ClassificationHead(nn.Module):
    """hidden (B, S, d) -> logits (B, n_out): pooler ``tanh(h_0 W_p + b_p)`` on the first
    ([CLS]) token, dropout, ``W_o`` (BERT sec. 4.1). ``n_out`` = 1 for a regression.
    ``reads_first_token``: it reads ``hidden[:, 0]`` alone (so a (B, 1, d) ``hidden``
    will do: the lean pass computes no more)."""

    reads_first_token: ClassVar[bool] = True

    def __init__(self, d_model: int, n_out: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.pooler = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(d_model, n_out)
        nn.init.normal_(self.out.weight, std=0.02)
        nn.init.zeros_(self.out.bias)

    @property
    def n_out(self) -> int:
        return self.out.out_features

    def forward(self, hidden: Tensor, select: Tensor | None = None) -> Tensor:
        """``select`` is ignored (every row is classified)."""
        pooled = torch.tanh(self.pooler(hidden[:, 0]))  # (B, d)
        return self.out(self.dropout(pooled))

    def macs(self, n_tokens: int = 1) -> dict[str, int]:
        """Per sequence, whatever its ``n_tokens`` (the pooler runs on the first token)."""
        d = self.pooler.in_features
        return {"pooler": d * d, "classifier": d * self.n_out}


@dataclass
class EncoderModelOutput:
    """hidden: (B, S, d) final states; pad_mask: (B, S) True at padding; logits: the head's
    output (MLM: (N, V) at the ``select`` positions; classification: (B, n_out));
    aux: auxiliary losses and traces (CCT gates, realized MACs)."""

    hidden: Tensor
    pad_mask: Tensor
    logits: Tensor
    aux: AuxOutputs = field(default_factory=AuxOutputs)


class EncoderModel(nn.Module):
    """An encoder with one head (:class:`MLMHead` or :class:`ClassificationHead`) and, for a
    CCT, ``control_embed`` (one row per trained budget).

    ``forward(tokens, segments=None, control=None, select=None)``: tokens, segments (B, S);
    ``select`` (B, S) bool: the positions the MLM head scores (default all).
    """

    def __init__(self, encoder: TransformerEncoder, head: nn.Module,
                 control_embed: nn.Embedding | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.control_embed = control_embed

    @property
    def pad_id(self) -> int:
        return self.encoder.embeddings.pad_id

    @property
    def n_controls(self) -> int:
        return 0 if self.control_embed is None else self.control_embed.num_embeddings

    def control_inputs(self, control: Control, batch: int,
                 device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """(B, 1, d) control embeddings and (B,) gate offsets (or None) of a call."""
        offsets: dict[str, Tensor] = {}
        if isinstance(control, BudgetControl):
            offsets = control.row_offsets(batch, device, ENCODER_SUBNETWORKS)
            control = control.ids
        if self.control_embed is None:
            if control is not None or offsets:
                raise ValueError("this model has no control symbols (no compute budget)")
            return None, None
        if control is None:
            raise ValueError(f"this model needs a control symbol id in [0, {self.n_controls})")
        if isinstance(control, int):
            if not 0 <= control < self.n_controls:
                raise ValueError(f"control symbol {control} is not in [0, {self.n_controls})")
            control = torch.full((batch,), control, dtype=torch.long, device=device)
            # a look-up, not a view of the weight (a view made under no_grad would still
            # require grad, which FlopCounterMode's module hooks refuse)
            emb = self.control_embed(control).unsqueeze(1)
        else:
            if control.shape != (batch,):
                raise ValueError(f"control ids must be one per row, shape ({batch},), got "
                                 f"{tuple(control.shape)}")
            emb = self.control_embed(control.to(device)).unsqueeze(1)  # (B, 1, d)
        return emb, offsets.get("encoder")

    def encode(self, tokens: Tensor, segments: Tensor | None = None, control: Control = None,
               aux: AuxOutputs | None = None,
               exit: DepthExit | None = None,
               layers: Sequence[int] | None = None,
               run: LayerRun | None = None) -> tuple[Tensor, Tensor]:
        """(hidden (B, S, d), pad_mask (B, S))."""
        emb, offset = self.control_inputs(control, tokens.size(0), tokens.device)
        return self.encoder(tokens, segments, emb, offset, aux, exit, layers, run)

    def forward(self, tokens: Tensor, segments: Tensor | None = None, control: Control = None,
                select: Tensor | None = None,
                exit: DepthExit | None = None,
                layers: Sequence[int] | None = None,
                run: LayerRun | None = None) -> EncoderModelOutput:
        """``exit``: early exit of an adaptive-depth encoder (its depth per row is then in
        ``aux.traces[DEPTH_RUN]``); ``layers``: the layer applications (positions of the
        encoder's plan) to run, the others skipped (LayerDrop; None: all); ``run``: how
        each layer application runs (:data:`LayerRun`; default the module)."""
        aux = AuxOutputs()
        hidden, pad_mask = self.encode(tokens, segments, control, aux, exit, layers, run)
        return EncoderModelOutput(hidden, pad_mask, self.head(hidden, select), aux)
