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
import json
import sys
import time
from pathlib import Path

from cct_quality import run_dir

from _lib import learning_curve

RESULTS = Path("benchmarks/results")


def valid_curve(run: Path) -> dict[int, dict[str, float]]:
    """step -> {"loss", "bleu"} of every validation in ``run``'s log (a step validated twice,
    after a stop and resume, keeps its last entry)."""
    if not (run / "log.jsonl").exists():
        raise FileNotFoundError(f"{run / 'log.jsonl'} does not exist: train the system first")
    return {int(v["step"]): {"loss": v["valid_loss"], "bleu": v["valid_bleu"]}
            for v in learning_curve(run)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cct", default="cct_x5", help="the CCT system (default cct_x5)")
    p.add_argument("--dense", nargs="+", default=["small_x5", "width_f128_x5", "depth_1_1_x5"],
                   help="dense systems; the first is the dense model of the CCT's size")
    args = p.parse_args()
    names = [args.cct, *args.dense]
    try:
        curves = {n: valid_curve(run_dir(n)) for n in names}
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
           "command": f"python benchmarks/cct_learning_curve.py --cct {args.cct} "
                      f"--dense {' '.join(args.dense)}",
           "date": time.strftime("%Y-%m-%d"),
           "validation": "multi30k val en->fr: loss over all 1014 pairs (teacher forced); "
                         "greedy BLEU on the first 300; the CCT at budget (1, 1), raw gates",
           "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cct_learning_curve.json").write_text(json.dumps(out, indent=1))
    write_md(out, names, ref)
    plot(out, names, ref)


def write_md(out: dict, names: list[str], ref: str) -> None:
    gap = "loss_gap_to_" + ref
    lines = ["# cct_learning_curve: validation loss and BLEU by update, CCT vs dense", "",
             f"Command: `{out['command']}`  ", f"Validation: {out['validation']}  ",
             f"Read from the training logs on {out['date']}.", "",
             "| step | " + " | ".join(f"{n} loss" for n in names) + f" | CCT − {ref} loss | "
             + " | ".join(f"{n} BLEU" for n in names) + " |",
             "|---:|" + "---:|" * (2 * len(names) + 1)]
    for r in out["rows"]:
        loss = [f"{r[n]['loss']:.3f}" if n in r else "" for n in names]
        bleu = [f"{r[n]['bleu']:.2f}" if n in r else "" for n in names]
        lines.append(f"| {r['step']} | " + " | ".join(loss) + f" | {r[gap]:+.3f} | "
                     + " | ".join(bleu) + " |")
    (RESULTS / "cct_learning_curve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(out: dict, names: list[str], ref: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(10, 4))
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
    fig.tight_layout()
    fig.savefig(RESULTS / "cct_learning_curve.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
