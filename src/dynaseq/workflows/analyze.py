"""``dynaseq analyze``: gate statistics of a trained CCT model at its budgets, as JSON + plots.

For each budget the sentence pairs run teacher forced, one at a time, at that budget's
control symbol (:mod:`dynaseq.analysis.gates`): on the references when they are given, else
on the model's own translations at that budget (greedy or beam search), as the paper does
for its decoded-output analysis (section 7, fig. 12).

Example::

    t = dynaseq.load("runs/cct")
    result = analyze(t, src_lines, ref_lines=None, budgets=[0.5, (1.0, 0.33)])
    write_analysis(result, "runs/cct/analysis")   # analysis.json + fig9..fig13 PNGs
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dynaseq.analysis.gates import (
    GateStats,
    activation_rates,
    collect_gate_stats,
    compute_by_rank,
    compute_by_subword,
    compute_histogram,
    usage_by_step,
)
from dynaseq.core.errors import DynaseqError
from dynaseq.core.progress import progress_bar
from dynaseq.tasks.translation.predictor import (
    Budget,
    Translator,
    budget_pair,
    decode_corpus,
    model_kind,
)

HISTOGRAM_BINS = 10
JSON_NAME = "analysis.json"

Pair = tuple[list[int], list[int]]


def budget_pairs(translator: Translator, budgets: list[Budget] | None
                 ) -> list[tuple[float, float]]:
    """The ``(encoder, decoder)`` budgets to analyze (duplicates dropped, order kept); None:
    every trained budget. Raises :class:`DynaseqError` for a dense model, or a budget that
    was neither trained nor calibrated."""
    cfg = translator.config.model
    if cfg.cct is None:
        raise DynaseqError(f"analyze needs a CCT model, but this is {model_kind(cfg)} (its "
                           "config has no model.cct section, so it has no gates)")
    if not budgets:
        return list(cfg.cct.controls)
    pairs = list(dict.fromkeys(budget_pair(b) for b in budgets))
    for pair in pairs:
        translator.budget_setting(pair)  # refuses an unknown budget before any work
    return pairs


def encode_pairs(translator: Translator, src_lines: list[str],
                 ref_lines: list[str] | None) -> tuple[list[list[int]], list[list[int]] | None]:
    """Token ids of the non-empty source lines (and their references), cut to the model's
    positions (``max_positions - 1`` tokens, leaving room for eos / bos)."""
    if ref_lines is not None and len(ref_lines) != len(src_lines):
        raise DynaseqError(f"source has {len(src_lines)} lines but reference has "
                           f"{len(ref_lines)}")
    tok = translator.tokenizer
    keep, src = tok.encode_kept(src_lines)
    if not keep:
        raise DynaseqError("nothing to analyze: every source line is empty")
    limit = translator.model.encoder.positions.max_positions - 1
    src = [s[:limit] for s in src]
    if ref_lines is None:
        return src, None
    return src, [r[:limit] for r in tok.encode([ref_lines[i] for i in keep])]


def translate_ids(translator: Translator, src: list[list[int]], control: int,
                  beam: int) -> list[list[int]]:
    """The model's translations (ids, no eos) at ``control``, with the run's decode
    settings (length penalty, maximum length) and ``beam`` (1 = greedy)."""
    d = translator.config.decode
    return decode_corpus(translator.model, src, beam=beam, length_penalty=d.length_penalty,
                         max_len_a=d.max_len_a, max_len_b=d.max_len_b,
                         batch_size=d.batch_size, device=translator.device, control=control)


def pair_tensors(translator: Translator, src: list[int], tgt: list[int]):
    """``(src (1, S), tgt_in (1, T), tgt_out (1, T))`` of one pair: eos after the source,
    bos before the target input, eos after the target output."""
    m, dev = translator.model, translator.device
    return (torch.tensor([src + [m.eos_id]], device=dev),
            torch.tensor([[m.bos_id] + tgt], device=dev),
            torch.tensor([tgt + [m.eos_id]], device=dev))


def _rounded(values: list[float], digits: int = 6) -> list[float]:
    return [round(float(v), digits) for v in values]


def _side(translator: Translator, ids: torch.Tensor, fraction: torch.Tensor,
          bins: int) -> dict[str, object]:
    """Fig. 9 and 10 of one side: histogram, rank buckets and per-subword means."""
    sub = compute_by_subword(ids, fraction)
    tok = translator.tokenizer
    return {
        "n_tokens": int(ids.numel()),
        "mean_fraction": float(fraction.double().mean()),
        "histogram": _rounded(compute_histogram(fraction, bins)),
        "by_rank": compute_by_rank(sub),
        "by_subword": {  # most frequent first: rank i + 1
            "ids": sub.ids.tolist(),
            "pieces": [tok.id_to_piece(int(i)) for i in sub.ids],
            "counts": sub.counts.tolist(),
            "mean_fraction": _rounded(sub.mean_fraction.tolist()),
        },
    }


def summarize(translator: Translator, stats: GateStats, budget: tuple[float, float],
              bins: int = HISTOGRAM_BINS) -> dict[str, object]:
    """The JSON record of one budget (see :func:`analyze` for the keys)."""
    control, _ = translator.budget_setting(budget)
    steps: dict[str, object] = {}
    for kind in ("self_attn", "cross_attn"):
        u = usage_by_step(stats, kind)
        steps["n_tokens"] = u.n_tokens.tolist()  # the same for both kinds
        steps[kind] = {"mean": _rounded(u.mean.tolist()),
                       "layers": {k: _rounded(v.tolist()) for k, v in u.layers.items()}}
    return {
        "budget": list(budget),
        "control": control,
        "gate_offsets": translator.budget_report(budget)[1],
        "n_sentences": stats.n_sentences,
        "gated_fraction": {"encoder": stats.total_fraction("encoder"),
                           "decoder": stats.total_fraction("decoder")},
        "encoder": _side(translator, stats.src_ids, stats.src_fraction, bins),
        "decoder": _side(translator, stats.tgt_ids, stats.tgt_fraction, bins),
        "layers": activation_rates(stats),
        "by_step": steps,
    }


def analyze(translator: Translator, src_lines: list[str], ref_lines: list[str] | None = None,
            budgets: list[Budget] | None = None, beam: int = 1,
            max_lines: int | None = None, bins: int = HISTOGRAM_BINS,
            progress: bool = False) -> dict[str, object]:
    """Gate statistics of ``translator``'s CCT model at each budget (paper fig. 9-13).

    src_lines / ref_lines: raw sentences (the first ``max_lines``; empty sources skipped);
    without references, each budget analyzes its own translations (``beam`` 1 = greedy).
    budgets: trained or calibrated budgets (``0.5`` or ``(enc, dec)``), each run as
    :meth:`Translator.at_budget` sets it (calibrated gate offsets included); None: all the
    model was trained for.

    Returns a JSON-ready dict: ``target`` ("reference" / "hypothesis"), ``bins`` (histogram
    edges) and ``budgets``, one record per budget with ``budget`` [enc, dec], ``control``,
    ``gated_fraction`` (encoder / decoder MACs the gates ran over the MACs they control;
    unlike ``evaluate``'s realized fraction, which ``calibrate`` aims at, it leaves out the
    control networks, which run whatever the gates decide: on a small model at a low
    budget they are much of what ran, e.g. the demo model at (.2, .2): 0.098 against 0.212),
    ``encoder`` and ``decoder`` (fig. 9 ``histogram``, fig. 10 ``by_rank`` buckets and
    ``by_subword`` means), ``layers`` (fig. 11: sub-layer -> gate -> activation rate) and
    ``by_step`` (fig. 12-13: q-gate rate per decoding step, per layer and averaged).
    ``progress``: a bar of budgets on a terminal.
    """
    pairs = budget_pairs(translator, budgets)
    if ref_lines is not None and len(ref_lines) != len(src_lines):
        raise DynaseqError(f"source has {len(src_lines)} lines but reference has "
                           f"{len(ref_lines)}")
    if max_lines is not None:
        src_lines = src_lines[:max_lines]
        ref_lines = None if ref_lines is None else ref_lines[:max_lines]
    src, ref = encode_pairs(translator, src_lines, ref_lines)
    records = []
    with progress_bar(len(pairs), "budget", "analyze", progress) as bar:
        for budget in pairs:
            with translator.at_budget(budget) as control:  # with its calibration, if any
                tgt = ref if ref is not None else translate_ids(translator, src, control, beam)
                stats = collect_gate_stats(translator.model, (
                    pair_tensors(translator, s, t) for s, t in zip(src, tgt, strict=True)),
                    control)
            records.append(summarize(translator, stats, budget, bins))
            bar.update(1)
    return {
        "checkpoint": str(translator.checkpoint),
        "target": "reference" if ref is not None else "hypothesis",
        "beam": None if ref is not None else beam,
        "n_sentences": len(src),
        "bins": [i / bins for i in range(bins + 1)],
        "budgets": records,
    }


def output_names() -> list[str]:
    """The files :func:`write_analysis` writes into its folder."""
    from dynaseq.analysis.plots import PLOTTERS

    return [JSON_NAME, *PLOTTERS]


def write_analysis(result: dict[str, object], out_dir: str | Path) -> list[Path]:
    """Write ``analysis.json`` and the fig. 9-13 PNGs into ``out_dir``; return the paths."""
    from dynaseq.analysis.plots import plot_all

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DynaseqError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = out / JSON_NAME
        path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    except OSError as e:
        raise DynaseqError(f"cannot write to {out}: {e.strerror or e}") from None
    return [path, *plot_all(result, out)]
