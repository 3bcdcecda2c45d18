"""Plot helpers shared by the benchmark scripts (matplotlib, headless, imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    """Lay ``fig`` out tightly, save it as a 120-dpi PNG at ``path`` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def labelled_scatter(points: list[tuple[str, float, float]], xlabel: str, ylabel: str,
                     title: str, path: Path) -> None:
    """One marker per ``(label, x, y)``, each annotated with its label; saved as a PNG."""
    fig, ax = pyplot().subplots(figsize=(6.5, 4.5))
    for label, x, y in points:
        ax.plot(x, y, "o")
        ax.annotate(label, (x, y), fontsize=7, xytext=(4, -3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    save(fig, path)
