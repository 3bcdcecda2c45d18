"""Benchmark `cct_learning_curve`: does the CCT's gap to dense close as training goes on?

Reads the validation events that training wrote to each run's ``log.jsonl`` (every
``train.valid_every`` updates: teacher-forced loss over Multi30k val en->fr and greedy BLEU on
its first ``train.valid_bleu_lines`` lines) and puts the CCT next to the dense models step by
step, over the updates the CCT and the first dense model both ran (a shorter dense run's
later cells stay empty). The CCT validates at its largest trained budget, (1, 1), with its raw
gates (no calibration), so its curve is the full-budget one. A run continued from a copy of a
shorter run's directory (``cct_quality.py`` ``*_long`` / ``*_x3`` / ...) holds the whole
history in its log.

    python benchmarks/cct_learning_curve.py [--cct cct_x5] [--dense small_x5 width_f128_x5 ...]

Names are systems of benchmarks/cct_quality.py (run directories runs/bench/cct_quality_NAME).
Writes benchmarks/results/cct_learning_curve.{json,md,png}; costs nothing but reading logs.
Run from the repository root.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _lib
import _plot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cct", default="cct_x5", help="the CCT system (default cct_x5)")
    p.add_argument("--dense", nargs="+", default=["small_x5", "width_f128_x5", "depth_1_1_x5"],
                   help="dense systems; the first is the dense model of the CCT's size")
    _lib.add_results_arg(p)
    args = p.parse_args()
    names = [args.cct, *args.dense]
    try:
        curves = {n: _lib.valid_curve(_lib.cct_quality_run(n)) for n in names}
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    ref = args.dense[0]
    # every step the CCT and the first dense model both validated; a shorter dense run
    # leaves its later cells empty
    steps = sorted(set(curves[args.cct]) & set(curves[ref]))
    if not steps:
        sys.exit(f"error: {args.cct} and {ref} share no validated step")
    rows = [{"step": s, **{n: curves[n][s] for n in names if s in curves[n]},
             "loss_gap_to_" + ref: round(curves[args.cct][s]["loss"] - curves[ref][s]["loss"], 4)}
            for s in steps]
    out = {"benchmark": "cct_learning_curve",
           "command": _lib.command(),
           "date": time.strftime("%Y-%m-%d"),
           "validation": "multi30k val en->fr: loss over all 1014 pairs (teacher forced); "
                         "greedy BLEU on the first 300; the CCT at budget (1, 1), raw gates",
           "rows": rows}
    lines = markdown(out, names, ref)
    _lib.write_results(args.results, "cct_learning_curve", out, lines)
    print("\n".join(lines))
    plot(out, names, ref, args.results / "cct_learning_curve.png")


def markdown(out: dict, names: list[str], ref: str) -> list[str]:
    """The lines of cct_learning_curve.md for the results ``out`` of systems ``names`` (the
    CCT first), against dense system ``ref``."""
    gap = "loss_gap_to_" + ref
    lines = _lib.md_head("cct_learning_curve: validation loss and BLEU by update, CCT vs dense",
                         out["command"], f"Validation: {out['validation']}",
                         f"Read from the training logs on {out['date']}.")
    return lines + _lib.md_table(
        ["step", *(f"{n} loss" for n in names), f"CCT − {ref} loss",
         *(f"{n} BLEU" for n in names)], "r" * (2 * len(names) + 2),
        ([r["step"], *(f"{r[n]['loss']:.3f}" if n in r else "" for n in names),
          f"{r[gap]:+.3f}", *(f"{r[n]['bleu']:.2f}" if n in r else "" for n in names)]
         for r in out["rows"]))


def plot(out: dict, names: list[str], ref: str, path: Path) -> None:
    """Validation loss by update of every system, and the CCT's gap to ``ref``."""
    fig, (ax_loss, ax_gap) = _plot.pyplot().subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in out["rows"]]
    for n in names:
        ax_loss.plot([r["step"] for r in out["rows"] if n in r],
                     [r[n]["loss"] for r in out["rows"] if n in r], "o-", ms=3, label=n)
    ax_loss.set_ylim(top=min(3.0, ax_loss.get_ylim()[1]))
    ax_loss.set_xlabel("update")
    ax_loss.set_ylabel("validation loss (CCT at budget (1, 1))")
    ax_loss.legend(fontsize=8)
    ax_gap.plot(steps, [r["loss_gap_to_" + ref] for r in out["rows"]], "o-", ms=3)
    ax_gap.axhline(0, color="0.5", lw=0.8)
    ax_gap.set_xlabel("update")
    ax_gap.set_ylabel(f"CCT − {ref}: validation loss")
    for ax in (ax_loss, ax_gap):
        ax.grid(alpha=0.3)
    fig.suptitle("Multi30k en→fr: the CCT's full budget against dense, by update")
    _plot.save(fig, path)


if __name__ == "__main__":
    main()
