"""Per-token gate statistics of a CCT model (Bapna, Arivazhagan, Firat 2020, section 7).

Sentence pairs run one at a time (batch 1, so no padding enters any statistic), teacher
forced, in eval mode: the hard 0/1 gates of one control symbol (budget). From the
:class:`~dynaseq.techniques.cct.gating.GateTrace` entries of each pass this module keeps

* per token, the MACs its gates let run and the MACs they control
  (:func:`token_compute`): ``Σ_layers Σ_gates g·cost / Σ_layers Σ_gates cost``;
* every gate's 0/1 values, per (sub-layer, gate), token after token (:class:`GateStats`);

and reduces them to the paper's analysis figures:

==========  ==============================================  ==============================
figure      what                                            function
==========  ==============================================  ==============================
fig. 9      spread of per-token compute fractions           :func:`compute_histogram`
fig. 10     per-subword compute vs. its frequency rank      :func:`compute_by_subword`,
                                                            :func:`compute_by_rank`
fig. 11     activation rate of each SA / CA / FF sub-layer  :func:`activation_rates`
fig. 12-13  SA / CA query-gate use by decoding step         :func:`usage_by_step`
==========  ==============================================  ==============================

Choices the paper leaves open, made here:

* The always-on control networks (gate ``"control"``) are not gated work and are left out.
* Encoder tokens are the source ids with their eos; a decoder position is attributed to the
  token it *predicts* (``tgt_out``: the target tokens, then eos), so "the end-of-sentence
  token in the decoder" is the last position, as in the paper's fig. 10 discussion.
* A decoder token's compute counts the gates on that token: self-attention query and
  key/value, cross-attention query, feed-forward pieces. Cross-attention key/value gates
  act on source tokens (the memory stream); they enter the layer activation rates
  (``"kv"``) but not the per-token fractions.
* Activation rates are what *ran*: at inference a self-attention key/value projection is
  skipped in a sentence where no query of that sub-layer is open (nobody reads it), so its
  ``kv`` gate counts as off there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dynaseq.nn.modes import evaluating
from dynaseq.techniques.cct.gating import GateTrace
from dynaseq.techniques.cct.layers import gate_traces

Part = str
"""``"encoder"`` or ``"decoder"``: the first component of a sub-layer name."""


@dataclass
class TokenCompute:
    """MACs per token of one sentence side: ``used`` ran, ``full`` with every gate on.

    used, full: ``(T,)`` float. ``fraction = used / full`` (fig. 9-10's per-token value).
    """

    used: Tensor
    full: Tensor

    @property
    def fraction(self) -> Tensor:
        return self.used / self.full.clamp_min(torch.finfo(self.full.dtype).tiny)


@dataclass
class GateStats:
    """Gate statistics of one control symbol over a corpus, token after token.

    src_ids, src_used, src_full: ``(Ns,)`` every source token (eos included) of every
        sentence, in order; MACs its encoder gates ran / control (:func:`token_compute`).
    tgt_ids, tgt_step, tgt_used, tgt_full: ``(Nt,)`` every decoder position: the token it
        predicts, its decoding step (0 = first target token), MACs ran / controlled.
    gates: ``(layer, gate) -> (N, G)`` float 0/1 values; ``N`` runs over the tokens of the
        gate's stream: source tokens for encoder gates and cross-attention ``kv`` gates
        (rows aligned with ``src_ids``), decoder positions for the other decoder gates (rows
        aligned with ``tgt_step``). ``G`` is 1 for attention gates, M for ``"ffn"``.
    """

    src_ids: Tensor
    src_used: Tensor
    src_full: Tensor
    tgt_ids: Tensor
    tgt_step: Tensor
    tgt_used: Tensor
    tgt_full: Tensor
    gates: dict[tuple[str, str], Tensor] = field(default_factory=dict)
    n_sentences: int = 0

    @property
    def src_fraction(self) -> Tensor:
        """``(Ns,)`` fraction of its gated encoder MACs each source token ran."""
        return TokenCompute(self.src_used, self.src_full).fraction

    @property
    def tgt_fraction(self) -> Tensor:
        """``(Nt,)`` fraction of its gated decoder MACs each decoder position ran."""
        return TokenCompute(self.tgt_used, self.tgt_full).fraction

    def total_fraction(self, part: Part) -> float:
        """All MACs that ran over all MACs the gates control, in ``part``, over the corpus."""
        used, full = ((self.src_used, self.src_full) if part == "encoder"
                      else (self.tgt_used, self.tgt_full))
        return float(used.sum() / full.sum().clamp_min(1e-30))


def analyzed_traces(traces: Iterable[GateTrace]) -> list[GateTrace]:
    """The traces of gated work (``"control"`` dropped), checked to be batch 1."""
    out = []
    for t in traces:
        if t.gate == "control":
            continue
        if t.values.dim() != 3 or t.values.size(0) != 1:
            raise ValueError(f"{t.layer}: gate statistics need batch-1 traces (1, T, G), "
                             f"got {tuple(t.values.shape)}")
        out.append(t)
    return out


def token_compute(traces: Iterable[GateTrace], part: Part, n_tokens: int) -> TokenCompute:
    """Per-token MACs of ``part``'s gates on its own tokens (stream ``"input"``), fig. 9-10.

    traces: batch-1 traces of one pass (see :func:`analyzed_traces`); n_tokens: the
    sequence length ``T`` of ``part``. ``used[t] = Σ g·cost``, ``full[t] = Σ cost`` over
    the sub-layers and gates of ``part`` (and the M pieces of each FFN).
    """
    used = torch.zeros(n_tokens, dtype=torch.float64)
    full = torch.zeros(n_tokens, dtype=torch.float64)
    for t in traces:
        if t.layer.split(".")[0] != part or t.stream != "input":
            continue
        values = t.values.detach()[0].double()  # (T, G)
        cost = t.cost.detach().double().expand(t.values.shape)[0]  # (T, G)
        if values.size(0) != n_tokens:
            raise ValueError(f"{t.layer}: {values.size(0)} tokens, expected {n_tokens}")
        used += (values * cost).sum(-1).cpu()
        full += cost.sum(-1).cpu()
    return TokenCompute(used, full)


@torch.inference_mode()
def sentence_traces(model: nn.Module, src: Tensor, tgt_in: Tensor,
                    control: int) -> list[GateTrace]:
    """The gated-work traces of one teacher-forced pass in eval mode (hard 0/1 gates).

    src ``(1, S)`` (eos included), tgt_in ``(1, T)`` (bos first); ``control``: the
    control-symbol id. The model's train/eval mode is restored afterwards.
    """
    if src.size(0) != 1 or tgt_in.size(0) != 1:
        raise ValueError("sentence_traces runs one sentence pair at a time (batch 1)")
    with evaluating(model):
        out = model(src, tgt_in, control)
    return analyzed_traces(gate_traces(out.aux))


def collect_gate_stats(model: nn.Module, pairs: Iterable[tuple[Tensor, Tensor, Tensor]],
                       control: int) -> GateStats:
    """Run every pair at ``control`` and gather per-token statistics (:class:`GateStats`).

    pairs: ``(src (1, S), tgt_in (1, T), tgt_out (1, T))`` long tensors on the model's
    device, one sentence pair each (``tgt_out`` gives the token each position predicts).
    """
    src_ids, tgt_ids, steps = [], [], []
    src_used, src_full, tgt_used, tgt_full = [], [], [], []
    gates: dict[tuple[str, str], list[Tensor]] = {}
    n = 0
    for src, tgt_in, tgt_out in pairs:
        traces = sentence_traces(model, src, tgt_in, control)
        enc = token_compute(traces, "encoder", src.size(1))
        dec = token_compute(traces, "decoder", tgt_in.size(1))
        src_ids.append(src[0].cpu())
        tgt_ids.append(tgt_out[0].cpu())
        steps.append(torch.arange(tgt_in.size(1)))
        src_used.append(enc.used)
        src_full.append(enc.full)
        tgt_used.append(dec.used)
        tgt_full.append(dec.full)
        for t in traces:
            gates.setdefault((t.layer, t.gate), []).append(t.values.detach()[0].float().cpu())
        n += 1
    if n == 0:
        raise ValueError("collect_gate_stats needs at least one sentence pair")
    return GateStats(
        src_ids=torch.cat(src_ids), src_used=torch.cat(src_used), src_full=torch.cat(src_full),
        tgt_ids=torch.cat(tgt_ids), tgt_step=torch.cat(steps), tgt_used=torch.cat(tgt_used),
        tgt_full=torch.cat(tgt_full), gates={k: torch.cat(v) for k, v in gates.items()},
        n_sentences=n)


# -- fig. 9: spread of per-token compute ----------------------------------------------------------


def compute_histogram(fraction: Tensor, bins: int = 10) -> list[float]:
    """Fig. 9: share of tokens whose compute fraction falls in each of ``bins`` equal
    buckets of [0, 1] (the last bucket is closed: 1.0 falls in it). ``fraction`` ``(N,)``.

    Returns ``bins`` shares summing to 1 (all 0 for no tokens).
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if fraction.numel() == 0:
        return [0.0] * bins
    idx = (fraction.double() * bins).floor().long().clamp(0, bins - 1)
    counts = torch.bincount(idx, minlength=bins).double()
    return (counts / fraction.numel()).tolist()


# -- fig. 10: compute vs. subword frequency -------------------------------------------------------


@dataclass
class SubwordCompute:
    """Mean compute fraction of each distinct subword, most frequent first (fig. 10).

    ids, counts: ``(V',)`` long, the subwords present and their occurrences (ties in count
    broken by smaller id); rank of ``ids[i]`` is ``i + 1``. mean_fraction: ``(V',)`` float,
    the compute fraction averaged over the subword's occurrences.
    """

    ids: Tensor
    counts: Tensor
    mean_fraction: Tensor


def compute_by_subword(ids: Tensor, fraction: Tensor) -> SubwordCompute:
    """Average ``fraction`` ``(N,)`` over the occurrences of each id in ``ids`` ``(N,)``,
    ordered by decreasing frequency in ``ids`` itself (the analyzed text)."""
    uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse,
                                                                      fraction.double())
    order = torch.sort(-counts, stable=True).indices  # unique ids are sorted: ties by id
    return SubwordCompute(uniq[order], counts[order], (sums / counts)[order])


def rank_buckets(n_ranks: int) -> list[tuple[int, int]]:
    """Log-spaced rank buckets ``[1, 1], [2, 3], [4, 7], ...`` covering ranks 1..n_ranks."""
    out, lo = [], 1
    while lo <= n_ranks:
        out.append((lo, min(2 * lo - 1, n_ranks)))
        lo *= 2
    return out


def compute_by_rank(sub: SubwordCompute) -> list[dict[str, float | int | list[int]]]:
    """Fig. 10 in buckets: per log-spaced rank bucket (:func:`rank_buckets`), the mean over
    its subwords of their mean compute fraction, and how many subwords / tokens it holds."""
    out: list[dict[str, float | int | list[int]]] = []
    for lo, hi in rank_buckets(sub.ids.numel()):
        mean = sub.mean_fraction[lo - 1: hi]
        out.append({"ranks": [lo, hi], "n_subwords": hi - lo + 1,
                    "n_tokens": int(sub.counts[lo - 1: hi].sum()),
                    "mean_fraction": float(mean.mean())})
    return out


# -- fig. 11: activation rate per sub-layer -------------------------------------------------------


def activation_rates(stats: GateStats) -> dict[str, dict[str, float | list[float]]]:
    """Fig. 11: the fraction of tokens for which each gate was on, per sub-layer.

    Returns ``layer -> {gate: rate}`` in model order: ``"q"`` (the paper's SA / CA rate),
    ``"kv"`` for attention, ``"ffn"`` (FF: the mean over the M pieces) and
    ``"ffn_pieces"`` (each piece's rate) for feed-forward sub-layers.
    """
    out: dict[str, dict[str, float | list[float]]] = {}
    for (layer, gate), values in stats.gates.items():
        rates = out.setdefault(layer, {})
        if values.numel() == 0:
            continue
        rates[gate] = float(values.double().mean())
        if gate == "ffn":
            rates["ffn_pieces"] = values.double().mean(0).tolist()
    return out


def sublayer_kind(layer: str) -> str:
    """``"SA"``, ``"CA"`` or ``"FF"`` for a sub-layer name (the last component)."""
    last = layer.rsplit(".", 1)[-1]
    return {"self_attn": "SA", "cross_attn": "CA", "ffn": "FF"}.get(last, last)


# -- fig. 12-13: attention use by decoding step ---------------------------------------------------


@dataclass
class StepUsage:
    """Query-gate use by decoding step of one decoder sub-layer type (fig. 12-13).

    n_tokens: ``(T_max,)`` decoder positions at each step over the corpus;
    layers: ``layer name -> (T_max,)`` activation rate of its ``q`` gate at each step;
    mean: ``(T_max,)`` the rate averaged over those layers (fig. 12).
    """

    n_tokens: Tensor
    layers: dict[str, Tensor]
    mean: Tensor


def usage_by_step(stats: GateStats, sublayer: str = "cross_attn") -> StepUsage:
    """Fig. 12-13: q-gate activation rate of every decoder ``sublayer`` (``"self_attn"`` or
    ``"cross_attn"``) at each decoding step."""
    steps = stats.tgt_step
    n_steps = int(steps.max()) + 1 if steps.numel() else 0
    counts = torch.bincount(steps, minlength=n_steps).double()
    layers = {}
    for (layer, gate), values in stats.gates.items():
        if gate != "q" or not layer.startswith("decoder.") or not layer.endswith(sublayer):
            continue
        sums = torch.bincount(steps, weights=values[:, 0].double(), minlength=n_steps)
        layers[layer] = sums / counts.clamp_min(1)
    mean = (torch.stack(list(layers.values())).mean(0) if layers
            else torch.zeros(n_steps, dtype=torch.float64))
    return StepUsage(counts.long(), layers, mean)
