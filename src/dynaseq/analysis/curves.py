"""Training and validation curves of one or several runs, drawn from their ``log.jsonl``.

One panel per metric that any of the runs logged: the training loss (``train`` events) and
each validation metric (``valid`` events: loss, ppl, BLEU, ...), against the update step;
one line per run. Drawn with matplotlib's object API on the Agg canvas (no pyplot, no global
backend change), written atomically.

Example::

    curves = read_curves(["runs/a", "runs/b"])
    plot_curves(curves, "curves.png")
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import atomic_write

#: (event, metric) panels drawn when logged, in this order; other numeric valid metrics follow.
TRAIN_METRICS = ("loss",)
SKIP = {"event", "time", "step", "epoch", "elapsed_s", "tokens_per_s", "lr"}


@dataclass
class RunCurves:
    """One run's curves: ``series[(event, metric)] = (steps, values)``."""

    name: str
    series: dict[tuple[str, str], tuple[list[int], list[float]]] = field(default_factory=dict)


def read_curves(run_dirs: list[str | Path]) -> list[RunCurves]:
    """The ``train`` loss and every numeric ``valid`` metric of each run's ``log.jsonl``.

    A last line without its newline is one a killed run was writing, and is left out.

    Raises:
        DynaseqError: a run directory without a readable ``log.jsonl``, a (whole) line that
            is not JSON, or a run that logged no training or validation step.
    """
    runs = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "log.jsonl"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DynaseqError(f"{run_dir} has no log.jsonl (not a run directory?)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise DynaseqError(f"cannot read {path}: {e}") from None
        curves = RunCurves(str(run_dir))
        lines = text.split("\n")[:-1]  # an unterminated last line is not a record yet
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise DynaseqError(f"{path}: line {n} is not JSON") from None
            if not isinstance(rec, dict):
                raise DynaseqError(f"{path}: line {n} is not a log record (a JSON object)")
            event, step = rec.get("event"), rec.get("step")
            if event not in ("train", "valid") or not isinstance(step, int):
                continue
            for key, value in rec.items():
                wanted = key in TRAIN_METRICS if event == "train" else key not in SKIP
                if wanted and isinstance(value, (int, float)) and not isinstance(value, bool):
                    try:  # a plot reads both as floats
                        float(step)
                        y = float(value)
                    except OverflowError:
                        raise DynaseqError(f"{path}: line {n}: the step or {key} is too large "
                                           "for a float") from None
                    steps, values = curves.series.setdefault((event, key), ([], []))
                    steps.append(step)
                    values.append(y)
        if not curves.series:
            raise DynaseqError(f"{path} records no training or validation step")
        runs.append(curves)
    return runs


def plot_curves(runs: list[RunCurves], out: str | Path) -> Path:
    """Draw one panel per (event, metric) of ``runs`` into the PNG ``out`` (written to a
    temporary file in its folder, then renamed over it). Returns ``out``."""
    keys: list[tuple[str, str]] = []
    for run in runs:
        keys += [k for k in run.series if k not in keys]
    keys.sort(key=lambda k: (k[0] != "train", k[1]))
    cols = min(len(keys), 3)
    rows = -(-len(keys) // cols)
    fig = Figure(figsize=(4.8 * cols, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes, keys, strict=False):
        for run in runs:
            if key in run.series:
                steps, values = run.series[key]
                ax.plot(steps, values, label=run.name, marker="." if len(steps) < 30 else None)
        ax.set_title(f"{key[0]} {key[1]}")
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write(out, buf.getvalue())
    return Path(out)
