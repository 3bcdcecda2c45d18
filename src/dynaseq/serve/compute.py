"""Each line's realized compute as ``dynaseq serve`` reports it (and as a latency table
times it after each decode, :class:`ServedCompute`): the MACs per token its gated
sub-layers ran and their fraction of every gate open, what the line costs alone whatever
batch it ran in. Translation counts what a greedy decode ran (:func:`counted_per_row`,
:class:`CountedRows`) or runs the line's source and output teacher forced once
(:func:`realized_per_row`); classification reads the batch's own counts
(:func:`encoder_compute_per_row`).

No web framework here: ``dynaseq profile --latency-table`` imports it on an install
without the ``serve`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dynaseq.data import collate_source
from dynaseq.metrics.encoder_profile import encoder_macs
from dynaseq.metrics.macs import count_macs
from dynaseq.models.search import Counted
from dynaseq.nn.outputs import AuxOutputs
from dynaseq.tasks.classify.data import Row
from dynaseq.tasks.classify.predictor import RealizedCompute
from dynaseq.techniques.cct.gating import GATE_SUBNETWORKS, BudgetControl, every_gate_open
from dynaseq.techniques.cct.layers import realized_macs_by_row

LengthsT = int | torch.Tensor
"""A token count, or ``(B,)`` long counts, one per line."""


@torch.inference_mode()
def realized_per_row(model: torch.nn.Module, src_ids: list[list[int]], hyps: list[list[int]],
                     control: Any) -> list[dict]:
    """Each line's realized compute: its source and its own output run teacher forced once
    at the line's budget (the same gates fire as in the decode, which fed the same
    prefixes; the output layer does not run); per-row MACs of the gated sub-layers over the
    line's own tokens (:func:`realized_macs_by_row`: what the line costs alone, whatever it
    was batched with), and what every gate open would have run, per token and as a
    fraction. A line whose every gate is open (a budget of 1 in both sub-networks: offsets
    :data:`~dynaseq.techniques.cct.gating.ALL_GATES_ON`) ran what every gate open runs:
    :func:`all_on_macs`, without a pass. Dense models: the analytic count, fraction 1."""
    max_pos = model.encoder.positions.max_positions
    device = next(model.parameters()).device
    src = collate_source([s[: max_pos - 1] for s in src_ids], model.pad_id,
                         model.eos_id).to(device)
    rows = [[model.bos_id, *h[: max_pos - 1]] for h in hyps]
    tgt = torch.full((len(rows), max(len(r) for r in rows)), model.pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tgt[i, : len(r)] = torch.tensor(r)
    tgt = tgt.to(device)
    n_src = src.ne(model.pad_id).sum(1).tolist()
    n_tgt = [len(r) for r in rows]
    if model.n_controls == 0:
        out = []
        for s, n in zip(n_src, n_tgt, strict=True):
            per = {k: float(v) for k, v in count_macs(model, s, n).per_token().items()}
            out.append({"fraction": {"encoder": 1.0, "decoder": 1.0, "total": 1.0},
                        "macs_per_token": per})
        return out
    b = len(rows)
    opened = control.all_open(b) if isinstance(control, BudgetControl) else [False] * b
    ran = {sub: [0] * b for sub in GATE_SUBNETWORKS}
    full = {sub: [0] * b for sub in GATE_SUBNETWORKS}
    open_rows = [i for i in range(b) if opened[i]]
    if open_rows:  # every gate open: nothing to measure
        counts = all_on_macs(model, torch.tensor([n_src[i] for i in open_rows]),
                             torch.tensor([n_tgt[i] for i in open_rows]))
        for sub, per_row in counts.items():
            for i, n in zip(open_rows, per_row.tolist(), strict=True):
                ran[sub][i] = full[sub][i] = n
    gated = [i for i in range(b) if not opened[i]]
    if gated:
        index = torch.tensor(gated, device=device)
        if isinstance(control, BudgetControl):
            control = control.select(index)
        elif isinstance(control, torch.Tensor) and control.dim() == 1:
            control = control.index_select(0, index)
        src = src.index_select(0, index)[:, : max(n_src[i] for i in gated)]
        tgt = tgt.index_select(0, index)[:, : max(n_tgt[i] for i in gated)]
        aux = AuxOutputs()
        model.decoder(tgt, model.encode(src, control, aux), aux=aux, project=False)
        valid = {"encoder": src.ne(model.pad_id), "decoder": tgt.ne(model.pad_id)}
        for all_on, into in ((False, ran), (True, full)):
            for layer, per_row in realized_macs_by_row(aux, all_on, valid).items():
                for i, n in zip(gated, per_row.tolist(), strict=True):
                    into[layer.split(".")[0]][i] += n
    return _reports(ran, full, n_src, n_tgt)


def _reports(ran: dict[str, list[int]], full: dict[str, list[int]], n_src: list[int],
             n_tgt: list[int]) -> list[dict]:
    """Per line, ``{"fraction", "macs_per_token"}`` from the MACs its sub-networks ran
    (``ran``) and would run with every gate open (``full``), over its ``n_src`` source and
    ``n_tgt`` target tokens."""
    out = []
    for i, (s, t) in enumerate(zip(n_src, n_tgt, strict=True)):
        per = {"encoder": ran["encoder"][i] / s, "decoder": ran["decoder"][i] / t}
        mx = {"encoder": full["encoder"][i] / s, "decoder": full["decoder"][i] / t}
        frac = {k: per[k] / mx[k] if mx[k] else 1.0 for k in per}
        frac["total"] = sum(per.values()) / max(sum(mx.values()), 1e-12)
        per["total"] = per["encoder"] + per["decoder"]
        out.append({"fraction": frac, "macs_per_token": per})
    return out


def counted_per_row(model: torch.nn.Module, src: torch.Tensor, aux: AuxOutputs,
                    counts: dict[str, torch.Tensor]) -> list[dict]:
    """Each line's realized compute, as :func:`realized_per_row` reports it, from what its
    greedy decode ran (:class:`CountedRows`), for every line of ``src``."""
    return CountedRows(model, src, aux).reports(counts)


def all_open_reports(model: torch.nn.Module, src_ids: list[list[int]], hyps: list[list[int]],
                     all_on: dict[tuple[int, int], dict[str, int]] | None = None
                     ) -> list[dict]:
    """:func:`realized_per_row` of lines whose every gate was open: what every gate open
    runs over their lengths (:func:`all_on_macs`, looked up in ``all_on`` by (source,
    target) length and filled as lines need it), without tensors."""
    cache = {} if all_on is None else all_on
    max_pos = model.encoder.positions.max_positions
    n_src = [len(s[: max_pos - 1]) + 1 for s in src_ids]  # + eos
    n_tgt = [len(h[: max_pos - 1]) + 1 for h in hyps]  # + bos
    full: dict[str, list[int]] = {"encoder": [], "decoder": []}
    for key in zip(n_src, n_tgt, strict=True):
        if key not in cache:
            cache[key] = all_on_macs(model, *key)
        for part, n in cache[key].items():
            full[part].append(n)
    return _reports(full, full, n_src, n_tgt)


class CountedRows:
    """The realized compute of a batch's lines from what its greedy decode ran, line by
    line as they finish: the encoder's records (``aux``, over each line's own tokens of
    ``src`` ``(B, S)``; summed once, here) and the decoding steps' per-row counts of open
    gates (:class:`~dynaseq.nn.lean_step.StepTally`), each gated decoder sub-layer's row
    MACs formed from them as the teacher-forced pass counts them (a row's keys count only if
    one of its queries was open); every gate open: :func:`all_on_macs`. No second pass.
    The per-line sums run on numbers: a call reports a few lines, where tensor operations
    would cost ~3 ms a call in overhead. ``all_on``: :func:`all_on_macs` by (source, target)
    length, filled as lines need it; a server passes one for all its batches (its model does
    not change), which spares ~0.5 ms a line."""

    def __init__(self, model: torch.nn.Module, src: torch.Tensor, aux: AuxOutputs,
                 all_on: dict[tuple[int, int], dict[str, int]] | None = None) -> None:
        self.model = model
        self.all_on = {} if all_on is None else all_on
        n_src = src.ne(model.pad_id).sum(1)
        ran = {"encoder": torch.zeros_like(n_src), "decoder": torch.zeros_like(n_src)}
        for layer, per_row in realized_macs_by_row(aux, False,
                                                   {"encoder": src.ne(model.pad_id)}).items():
            part = layer.split(".")[0]
            ran[part] = ran[part] + per_row
        self.n_src = n_src.tolist()
        self.ran = {k: v.tolist() for k, v in ran.items()}
        self.attention = [(m, key) for layer in model.decoder.layers
                          for m, key in ((layer.self_attn, "kv"), (layer.cross_attn, "keys"))
                          if hasattr(m, "row_macs")]
        self.ffns = [layer.ffn for layer in model.decoder.layers
                     if hasattr(layer.ffn, "pieces_row_macs")]

    def reports(self, counts: dict[str, torch.Tensor], rows: list[int] | None = None,
                at: list[int] | None = None) -> list[dict]:
        """As :func:`realized_per_row` reports them, for the lines ``rows`` (indices into
        ``src``; None: all) from ``counts`` (final for those lines; their rows ``at`` of
        it, default ``rows``)."""
        rows = list(range(len(self.n_src))) if rows is None else rows
        index = torch.tensor(rows if at is None else at, dtype=torch.long,
                             device=counts["steps"].device)
        keys = ["steps", *(f"{m.name}.{k}" for m, key in self.attention for k in ("q", key)),
                *(f"{f.name}.pieces" for f in self.ffns)]
        got = {k: counts[k].index_select(0, index).tolist() for k in keys}
        ran: dict[str, list[int]] = {"encoder": [], "decoder": []}
        full: dict[str, list[int]] = {"encoder": [], "decoder": []}
        n_src = [self.n_src[r] for r in rows]
        for i, r in enumerate(rows):
            steps, dec = got["steps"][i], self.ran["decoder"][r]
            for m, key in self.attention:
                n_q = got[f"{m.name}.q"][i]
                kv = got[f"{m.name}.{key}"][i] if n_q > 0 else 0
                dec += m.row_macs(n_q, kv, kv, steps, steps if key == "kv" else n_src[i])
            for f in self.ffns:
                dec += f.pieces_row_macs(got[f"{f.name}.pieces"][i], steps)
            ran["encoder"].append(self.ran["encoder"][r])
            ran["decoder"].append(dec)
            key = (n_src[i], steps)
            if key not in self.all_on:
                self.all_on[key] = all_on_macs(self.model, *key)
            for part, n in self.all_on[key].items():
                full[part].append(n)
        return _reports(ran, full, n_src, got["steps"])


def all_on_macs(model: torch.nn.Module, n_src: LengthsT, n_tgt: LengthsT
                ) -> dict[str, LengthsT]:
    """``{"encoder": MACs, "decoder": MACs}`` that a line of ``n_src`` source and ``n_tgt``
    target tokens (numbers, or ``(B,)`` tensors: one per line) runs in the gated sub-layers
    of an encoder-decoder CCT with every gate open, from the lengths alone (each
    sub-layer's ``all_on_row_macs``; sub-layers without gates are not counted, as
    :func:`realized_macs_by_row` counts none of them)."""
    def macs(m: torch.nn.Module, *lengths: LengthsT) -> LengthsT:
        count = getattr(m, "all_on_row_macs", None)
        return 0 if count is None else count(*lengths)

    return {"encoder": sum(macs(layer.self_attn, n_src, n_src) + macs(layer.ffn, n_src)
                           for layer in model.encoder.layers),
            "decoder": sum(macs(layer.self_attn, n_tgt, n_tgt)
                           + macs(layer.cross_attn, n_tgt, n_src) + macs(layer.ffn, n_tgt)
                           for layer in model.decoder.layers)}


def counts_while_decoding(model: torch.nn.Module, control: Any, n_rows: int) -> bool:
    """Whether a batch's greedy decode counts what it runs for its compute report
    (:func:`counted_per_row`): a CCT, unless every gate of every row is open anyway (then
    the lengths tell, :func:`realized_per_row`, and counting would cost more)."""
    return model.n_controls > 0 and not every_gate_open(control, n_rows)


@dataclass(frozen=True)
class ServedCompute:
    """Each line's realized compute as ``dynaseq serve`` reports it, in the shape a latency
    table times after each decode (:class:`~dynaseq.metrics.latency.AfterDecode`), so the
    table holds what the server runs per batch."""

    model: torch.nn.Module

    def counts(self, control: Any, n_rows: int) -> bool:
        return counts_while_decoding(self.model, control, n_rows)

    def __call__(self, src: torch.Tensor, hyps: list[list[int]], control: Any,
                 counted: Counted | None) -> list[dict]:
        if counted is not None:
            return counted_per_row(self.model, src, *counted)
        m = self.model
        rows = [r[r.ne(m.pad_id)][:-1].tolist() for r in src]  # no padding, no eos
        return realized_per_row(m, rows, hyps, control)



def encoder_compute_per_row(model: torch.nn.Module, rows: list[Row],
                            realized: RealizedCompute | None,
                            row_layers: torch.Tensor | None = None) -> list[dict]:
    """Each row's compute in the shape of translation's (:func:`realized_per_row`): for a
    CCT encoder, the MACs its gated sub-layers ran per token of the row and their fraction
    of every gate on (``realized``, from the batch that classified the rows, over the
    row's own tokens: what it costs alone); for a dense encoder (``realized`` None) the
    analytic count (:func:`encoder_macs`), fraction 1, or with ``row_layers`` ((N,) layers
    each row ran: adaptive depth's early exit) the count of those first layers and its
    fraction of every layer."""
    out = []
    for i, (ids, _) in enumerate(rows):
        if realized is None:
            full = sum(encoder_macs(model, len(ids)).values())
            ran = full if row_layers is None else sum(
                encoder_macs(model, len(ids), range(int(row_layers[i]))).values())
            per, frac = ran / len(ids), ran / full
        else:
            ran, full = int(realized.row_ran[i]), int(realized.row_full[i])
            per, frac = ran / int(realized.row_tokens[i]), ran / full if full else 1.0
        out.append({"fraction": {"encoder": frac, "total": frac},
                    "macs_per_token": {"encoder": per, "total": per}})
    return out
