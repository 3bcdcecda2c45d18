"""Plot helpers shared by the benchmark scripts (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def labelled_scatter(points: list[tuple[str, float, float]], xlabel: str, ylabel: str,
                     title: str, path: Path) -> None:
    """One marker per ``(label, x, y)``, each annotated with its label; saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, x, y in points:
        ax.plot(x, y, "o")
        ax.annotate(label, (x, y), fontsize=7, xytext=(4, -3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
