"""PNG plots of a ``dynaseq analyze`` result (the CCT paper's fig. 9-13).

Every function takes the JSON-ready dict of :func:`dynaseq.workflows.analyze.analyze` (or
``analysis.json`` read back), so plots can be redrawn without the model. Figures are drawn
with matplotlib's object API on the Agg canvas: no pyplot, no global backend change.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dynaseq.analysis.gates import sublayer_kind

Result = dict[str, Any]

MIN_STEP_SHARE = 0.05
"""Fig. 12-13 show the decoding steps that at least this share of the sentences reach
(later steps rest on a handful of long sentences)."""

def budget_label(budget: list[float]) -> str:
    """``"p=0.5"`` for equal encoder/decoder budgets, else ``"enc 1 / dec 0.33"``."""
    enc, dec = budget
    return f"p={enc:g}" if enc == dec else f"enc {enc:g} / dec {dec:g}"


MAX_COLUMNS = 4


def _new_figure(n_panels: int, width: float = 5.0,
                height: float = 3.8) -> tuple[Figure, list[Axes]]:
    """A figure on the Agg canvas with ``n_panels`` axes, at most MAX_COLUMNS per row (extra
    axes of the last row are hidden)."""
    cols = min(n_panels, MAX_COLUMNS)
    rows = -(-n_panels // cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def _target_note(result: Result) -> str:
    return "references" if result.get("target") == "reference" else "model translations"


def plot_compute_distribution(result: Result) -> Figure:
    """Fig. 9: share of tokens per bucket of used compute fraction, encoder | decoder."""
    fig, axes = _new_figure(2)
    edges = result["bins"]
    centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
    width = edges[1] - edges[0]
    for ax, part in zip(axes, ("encoder", "decoder"), strict=True):
        for rec in result["budgets"]:
            ax.plot(centers, rec[part]["histogram"], marker="o", label=budget_label(rec["budget"]))
        ax.set_xlim(0, 1)
        ax.set_xticks(edges[:: max(1, round(0.2 / width))])
        ax.set_xlabel(f"fraction of {part} compute used by a token")
        ax.set_ylabel("fraction of tokens")
        ax.set_title(f"{part} ({_target_note(result)})")
        ax.legend(fontsize="small")
    return fig


def plot_compute_vs_frequency(result: Result) -> Figure:
    """Fig. 10: per-subword mean compute fraction vs. frequency rank (dots), with the mean
    of each log-spaced rank bucket (line); source tokens | target tokens."""
    fig, axes = _new_figure(2)
    for ax, part in zip(axes, ("encoder", "decoder"), strict=True):
        for rec in result["budgets"]:
            side = rec[part]
            means = side["by_subword"]["mean_fraction"]
            line = ax.plot([math.sqrt(b["ranks"][0] * b["ranks"][1]) for b in side["by_rank"]],
                           [b["mean_fraction"] for b in side["by_rank"]], marker="o",
                           label=budget_label(rec["budget"]))[0]
            ax.scatter(range(1, len(means) + 1), means, s=6, alpha=0.3,
                       color=line.get_color())
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel(f"{'source' if part == 'encoder' else 'target'} subword frequency rank")
        ax.set_ylabel(f"fraction of {part} compute used")
        ax.set_title(f"{part} ({_target_note(result)})")
        ax.legend(fontsize="small")
    return fig


def _layer_label(layer: str) -> str:
    """``"decoder.layers.1.cross_attn"`` -> ``"2 CA"`` (layers counted from 1)."""
    parts = layer.split(".")
    index = next((p for p in parts if p.isdigit()), None)
    kind = sublayer_kind(layer)
    return kind if index is None else f"{int(index) + 1} {kind}"


def plot_layer_activation(result: Result) -> Figure:
    """Fig. 11: activation rate (query gate; FF: mean over the M pieces) of every encoder |
    decoder sub-layer, one bar per budget."""
    fig, axes = _new_figure(2, width=6.0)
    records = result["budgets"]
    n = max(1, len(records))
    for ax, part in zip(axes, ("encoder", "decoder"), strict=True):
        layers = [name for name in records[0]["layers"] if name.startswith(part + ".")]
        for j, rec in enumerate(records):
            rates = [rec["layers"][name].get("ffn" if sublayer_kind(name) == "FF" else "q", 0.0)
                     for name in layers]
            xs = [i + (j - (n - 1) / 2) * 0.8 / n for i in range(len(layers))]
            ax.bar(xs, rates, width=0.8 / n, label=budget_label(rec["budget"]))
        ax.set_xticks(range(len(layers)), [_layer_label(name) for name in layers],
                      rotation=90 if len(layers) > 12 else 0, fontsize="small")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("fraction of tokens active")
        ax.set_title(f"{part} sub-layers (SA self-attn, CA cross-attn, FF feed-forward)")
        ax.legend(fontsize="small")
    return fig


def _shown_steps(rec: Result) -> int:
    """Number of leading decoding steps reached by >= MIN_STEP_SHARE of the sentences."""
    need = max(1, math.ceil(MIN_STEP_SHARE * rec["n_sentences"]))
    counts = rec["by_step"]["n_tokens"]
    return next((i for i, c in enumerate(counts) if c < need), len(counts))


def plot_attention_by_step(result: Result) -> Figure:
    """Fig. 12: self- (dashed) vs. cross-attention (solid) query-gate use by decoding step,
    averaged over the decoder layers, one color per budget."""
    fig, axes = _new_figure(1, width=6.5)
    ax = axes[0]
    for rec in result["budgets"]:
        k = _shown_steps(rec)
        steps = list(range(1, k + 1))
        line = ax.plot(steps, rec["by_step"]["cross_attn"]["mean"][:k],
                       label=f"CA {budget_label(rec['budget'])}")[0]
        ax.plot(steps, rec["by_step"]["self_attn"]["mean"][:k], linestyle="--",
                color=line.get_color(), label=f"SA {budget_label(rec['budget'])}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("decoding step (target position)")
    ax.set_ylabel("fraction of tokens active (mean over layers)")
    ax.set_title(f"self- vs cross-attention use ({_target_note(result)})")
    ax.legend(fontsize="small", ncol=2)
    return fig


def plot_cross_attention_by_layer(result: Result) -> Figure:
    """Fig. 13: cross-attention query-gate use by decoding step for every decoder layer,
    one panel per budget."""
    records = result["budgets"]
    fig, axes = _new_figure(len(records), width=4.5)
    for ax, rec in zip(axes, records, strict=True):
        k = _shown_steps(rec)
        for name, rates in rec["by_step"]["cross_attn"]["layers"].items():
            ax.plot(range(1, k + 1), rates[:k], label=_layer_label(name))
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("decoding step")
        ax.set_ylabel("fraction of tokens active")
        ax.set_title(f"cross-attention, {budget_label(rec['budget'])}")
        ax.legend(fontsize="small")
    return fig


PLOTTERS: dict[str, Callable[[Result], Figure]] = {
    "fig9_compute_distribution.png": plot_compute_distribution,
    "fig10_compute_vs_frequency.png": plot_compute_vs_frequency,
    "fig11_layer_activation.png": plot_layer_activation,
    "fig12_attention_by_step.png": plot_attention_by_step,
    "fig13_cross_attention_by_layer.png": plot_cross_attention_by_layer,
}
"""The PNG file of each figure and the function drawing it."""


def plot_all(result: Result, out_dir: str | Path) -> list[Path]:
    """Draw fig. 9-13 of ``result`` into ``out_dir`` as PNGs; return the paths written."""
    out = Path(out_dir)
    paths = []
    for name, plot in PLOTTERS.items():
        fig = plot(result)
        fig.savefig(out / name, dpi=120)
        paths.append(out / name)
    return paths
