"""Conditional Computation Transformer (CCT; Bapna, Arivazhagan, Firat 2020): one import.

The pieces live in small modules, re-exported here:

* :mod:`~dynaseq.techniques.cct.gating` — control networks (eq. 4), noisy/hard gates (eq. 2-3),
  the noise schedule, gate traces;
* :mod:`~dynaseq.techniques.cct.conditional_attention` — gated attention (eq. 12-13) and its cache;
* :mod:`~dynaseq.techniques.cct.conditional_ffn` — M gated feed-forward pieces (eq. 15);
* :mod:`~dynaseq.techniques.cct.budget` — the two-sided multi-task budget loss (eq. 5-9).

Wiring a model (sketch)::

    layer = EncoderLayer(d, conditional_attention(d, heads), conditional_feedforward(d, ffn))
    name_conditional_sublayers(model)             # trace names "encoder.layers.0.ffn", ...
    set_gate_step(model, step)                    # each training step: noise scale α(step)
    out = model(src, tgt_in)                      # out.aux holds the gate traces
    terms = budget_terms(gate_traces(out.aux), {"encoder": ~src_pad, "decoder": ~tgt_pad,
                                                "decoder.memory": ~src_pad})
    loss = ce + budget_loss(terms, group, budgets, weight=lam).loss
    model.eval(); realized_macs_by_layer(aux)     # MACs that actually ran, per sub-layer
    model(src, tgt_in, BudgetControl(ids, {"decoder": offsets}))  # per-row budgets (B,)
    realized_macs_by_row(aux)                     # what each row's tokens ran, per sub-layer
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from dynaseq.nn.modes import evaluating
from dynaseq.nn.outputs import AuxOutputs
from dynaseq.techniques.cct.budget import BudgetLoss, BudgetTerm, budget_loss, budget_terms
from dynaseq.techniques.cct.conditional_attention import (
    ConditionalAttention,
    GatedKVCache,
    conditional_attention,
)
from dynaseq.techniques.cct.conditional_ffn import (
    ConditionalFeedForward,
    FeedForwardPiece,
    conditional_feedforward,
)
from dynaseq.techniques.cct.gating import (
    ALL_GATES_ON,
    GATE_SUBNETWORKS,
    GATE_TRACE,
    MACS_TRACE,
    BudgetControl,
    ControlNet,
    Gate,
    GateTrace,
    MacsRecord,
    NoiseSchedule,
    force_gates,
    set_gate_step,
)

__all__ = [
    "ALL_GATES_ON",
    "GATE_SUBNETWORKS",
    "GATE_TRACE",
    "MACS_TRACE",
    "BudgetControl",
    "BudgetLoss",
    "BudgetTerm",
    "ConditionalAttention",
    "ConditionalFeedForward",
    "ControlNet",
    "FeedForwardPiece",
    "Gate",
    "GateTrace",
    "GatedKVCache",
    "MacsRecord",
    "NoiseSchedule",
    "budget_loss",
    "budget_terms",
    "conditional_attention",
    "conditional_feedforward",
    "force_gates",
    "gate_traces",
    "name_conditional_sublayers",
    "realized_macs_by_layer",
    "realized_macs_by_row",
    "realized_fraction",
    "seq2seq_budget_loss",
    "set_gate_step",
]


def name_conditional_sublayers(model: nn.Module) -> int:
    """Name every CCT sub-layer after its path in ``model`` (``"decoder.layers.1.cross_attn"``).

    Its gate traces carry that name; :func:`budget_terms` reads the sub-network (encoder /
    decoder) from the first component. Returns how many sub-layers were named.
    """
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, (ConditionalAttention, ConditionalFeedForward)):
            m.name = name
            n += 1
    return n


def gate_traces(aux: AuxOutputs) -> list[GateTrace]:
    """The gate traces that the CCT sub-layers recorded into ``aux`` during one call."""
    return list(aux.traces.get(GATE_TRACE, []))


def realized_macs_by_layer(aux: AuxOutputs) -> dict[str, dict[str, int]]:
    """Sum the inference-time :class:`MacsRecord` entries of ``aux`` per sub-layer name.

    Over a whole decode (many calls sharing one ``aux``), this is the compute that ran.
    """
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for rec in aux.traces.get(MACS_TRACE, []):
        for k, v in rec.macs.items():
            out[rec.layer][k] += v
    return {layer: dict(counts) for layer, counts in out.items()}


def realized_macs_by_row(aux: AuxOutputs, all_on: bool = False,
                         valid: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Sum the per-row counts of the :class:`MacsRecord` entries of ``aux`` per sub-layer
    name: ``{layer: (B,) long}``, the MACs each row's tokens ran in that sub-layer, whatever
    budgets the other rows ran at; ``all_on``: what they would have run with every gate open
    (``per_row_full``).

    ``valid``: each stack's own positions, ``{"encoder": (B, S) bool, "decoder": (B, T)
    bool}`` (False at padding): the counts are then of each row's own tokens only, what the
    row costs run alone (:attr:`MacsRecord.rows`), whatever lengths the other rows had; a
    sub-layer's stack is the first part of its name. None: the padded positions the row had
    in its batch count too, as they ran.

    For one teacher-forced call (a decode reorders and drops rows between calls).
    """
    out: dict[str, Tensor] = {}
    for rec in aux.traces.get(MACS_TRACE, []):
        if valid is not None and rec.rows is not None:
            q_valid = valid[rec.layer.split(".")[0]]
            per_row = rec.rows(q_valid, valid["encoder"] if rec.keys_from_memory else q_valid,
                               all_on)
        else:
            per_row = rec.per_row_full if all_on else rec.per_row
        if per_row is None or (valid is not None and rec.rows is None):
            raise ValueError(f"sub-layer {rec.layer!r} does not count its MACs per row"
                             + (" with every gate open" if all_on else "")
                             + (" over given positions" if valid is not None else ""))
        out[rec.layer] = out[rec.layer] + per_row if rec.layer in out else per_row
    return out


def seq2seq_budget_loss(aux: AuxOutputs, src: Tensor, tgt_in: Tensor, pad_id: int,
                        control: Tensor, budgets: Tensor, weight: float,
                        reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Budget loss (eq. 5-9) of one encoder-decoder forward pass.

    src (B, S), tgt_in (B, T): the batch (padding excluded from the costs); control (B,):
    each sequence's control symbol; budgets (N, 2): (encoder, decoder) budget per symbol;
    ``reduce``: see :func:`~dynaseq.techniques.cct.budget.budget_loss` (DDP).
    """
    src_valid, tgt_valid = src.ne(pad_id), tgt_in.ne(pad_id)
    valid = {"encoder": src_valid, "decoder": tgt_valid, "decoder.memory": src_valid}
    return budget_loss(budget_terms(gate_traces(aux), valid), control, budgets, weight,
                       reduce).loss


def encoder_budget_loss(aux: AuxOutputs, valid: Tensor, control: Tensor,
                        budgets: Tensor) -> Tensor:
    """Budget loss (eq. 5-9, λ = 1) of one encoder-only forward pass (CCT-BERT).

    valid (B, S): False at padding; control (B,): each row's control symbol; budgets (N,):
    the budget of each symbol (one sub-network, the encoder)."""
    terms = budget_terms(gate_traces(aux), {"encoder": valid}, ("encoder",))
    return budget_loss(terms, control, budgets.reshape(-1, 1), 1.0).loss


@torch.no_grad()
def realized_fraction(model: nn.Module, pairs: Iterable[tuple[Tensor, Tensor]],
                      control: int | BudgetControl | Sequence[int | BudgetControl]
                      ) -> dict[str, object]:
    """MACs that ran in the gated sub-layers at a budget, as a fraction of all gates on.

    pairs: ``(src (1, S), tgt_in (1, T))`` sentence pairs, run one at a time and teacher
    forced (batch 1, so no packing padding is counted). Each pair runs twice in eval mode:
    with the hard gates of ``control`` (a control-symbol id, or a :class:`BudgetControl`
    with calibrated gate offsets; a list: one per pair, each pair at its own budget), and
    with every gate opened (offsets :data:`ALL_GATES_ON`; the model is not modified, and a
    model pinned by :func:`force_gates` stays pinned in both passes). The
    fractions cover the gated sub-layers (attention, FFN, their control nets), the part the
    budget governs; embeddings and the output layer always run and are not included.
    Returns per-token MACs (encoder per source token, decoder per target token) and the
    ``fraction`` object with ``encoder``, ``decoder`` and ``total``.
    """
    ran = {"encoder": 0, "decoder": 0}
    full = {"encoder": 0, "decoder": 0}
    n_src = n_tgt = 0
    per_pair = isinstance(control, Sequence)
    if per_pair:
        pairs = list(pairs)
        if len(pairs) != len(control):
            raise ValueError(f"{len(pairs)} sentence pairs but {len(control)} controls")
    with evaluating(model):
        for i, (src, tgt_in) in enumerate(pairs):
            own = control[i] if per_pair else control
            ids = own.ids if isinstance(own, BudgetControl) else own
            opened = BudgetControl(ids, dict.fromkeys(GATE_SUBNETWORKS, ALL_GATES_ON))
            for totals, setting in ((ran, own), (full, opened)):
                out = model(src, tgt_in, setting)
                for layer, counts in realized_macs_by_layer(out.aux).items():
                    totals[layer.split(".")[0]] += sum(counts.values())
            n_src += src.numel()
            n_tgt += tgt_in.numel()
    if n_src == 0:
        raise ValueError("realized_fraction needs at least one sentence pair")
    return fraction_report(ran, full, n_src, n_tgt)


def fraction_report(ran: dict[str, int], full: dict[str, int], n_src: int,
                    n_tgt: int) -> dict[str, object]:
    """:func:`realized_fraction`'s answer from its counts: MACs the gated sub-layers ran
    and would run with every gate on, by sub-network, over ``n_src`` source and ``n_tgt``
    target tokens."""
    per_token = {"encoder": ran["encoder"] / n_src, "decoder": ran["decoder"] / n_tgt}
    max_per_token = {"encoder": full["encoder"] / n_src, "decoder": full["decoder"] / n_tgt}
    fraction = {k: per_token[k] / max_per_token[k] for k in per_token}
    fraction["total"] = sum(per_token.values()) / sum(max_per_token.values())
    return {"fraction": fraction, "macs_per_token": per_token,
            "max_macs_per_token": max_per_token}
