"""Benchmark `cct_ablation` (CCT paper fig. 7-8) at small scale, on the synthetic task.

Trains the demo's tiny CCT (2+2 layers, d=128, budgets (1,1) x2, (.5,.5), (.33,.33), (.2,.2))
in four variants for the same number of updates, one thread, with the demo's budget
curriculum (full budget for the first 35% of the updates, then all budgets, ramping in over
10%):

* ``linear, M=4``: noise scale α rising linearly to 5 over the first 30% of the updates;
* ``constant, M=4``: α = 5 from the first update (fig. 7's "discrete from the start");
* ``linear, M=2`` and ``linear, M=1``: the FFN split into fewer gated pieces (fig. 8).

Each is evaluated at every budget: BLEU (greedy, 1000 test lines), accuracy on the hard
(sum-result) target words, and the realized fraction of gated MACs (200 lines, teacher
forced).

    python benchmarks/cct_ablation.py train [--steps 1200]
    python benchmarks/cct_ablation.py report

Writes benchmarks/results/cct_ablation.{json,md,png}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dynaseq.data import read_lines, write_task
from dynaseq.tasks.translation.predictor import Translator, bleu
from dynaseq.workflows.demo import DEMO_BUDGETS, demo_cct, demo_config, token_accuracy

import _lib
import _plot

RUNS = _lib.RUNS / "cct_ablation"
DATA = RUNS / "data"
# name -> {"noise_ramp": a fraction of the updates, "ffn_pieces": M}
VARIANTS = _lib.registry("cct_ablation", "variants", ("noise_ramp", "ffn_pieces"))


def run_dir(name: str) -> Path:
    """Where variant ``name`` trains."""
    return RUNS / name.replace(", ", "_").replace("=", "")


def config(name: str, paths, steps: int):
    """The demo's tiny CCT config for variant ``name``, ``steps`` updates."""
    v = VARIANTS[name]
    cct = demo_cct(steps, updates_per_minute=1.0)
    cct.ffn_pieces, cct.noise_ramp_steps = v["ffn_pieces"], int(v["noise_ramp"] * steps)
    cfg = demo_config(run_dir(name), paths, minutes=60.0, seed=0, cct=cct)
    cfg.run_dir = str(run_dir(name))
    cfg.train.max_steps = steps
    return cfg


def cmd_train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    paths = write_task(DATA, seed=0)
    _lib.train_each(config(name, paths, args.steps) for name in VARIANTS)


def cmd_report(args: argparse.Namespace) -> None:
    src, ref = read_lines(DATA / "test.src")[:1000], read_lines(DATA / "test.tgt")[:1000]
    rows = []
    for name in VARIANTS:
        t = Translator.load(run_dir(name))
        for budget in DEMO_BUDGETS:
            hyps = t.translate(src, beam=1, budget=budget)
            frac = t.realized_compute(src[:200], ref[:200], budget)["fraction"]
            rows.append({"variant": name, "budget": list(budget),
                         "bleu_greedy": round(bleu(hyps, ref)[0], 2),
                         "hard_token_acc": round(token_accuracy(hyps, ref, src)[
                             "hard_token_acc"], 4),
                         "realized_fraction": round(frac["total"], 3)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = {"benchmark": "cct_ablation",
           "command": f"python benchmarks/cct_ablation.py train --steps {args.steps} && "
                      "python benchmarks/cct_ablation.py report",
           "machine": _lib.machine(torch_threads=False, threads_train=1,
                                   threads_eval=torch.get_num_threads()),
           "updates_per_variant": args.steps, "rows": rows}
    lines = markdown(out)
    _lib.write_results(args.results, "cct_ablation", out, lines)
    print("\n".join(lines))
    plot(rows, args.results / "cct_ablation.png")


def markdown(out: dict) -> list[str]:
    """The lines of cct_ablation.md for the results ``out``."""
    lines = _lib.md_head(
        "cct_ablation: noise schedule (fig. 7) and FFN pieces M (fig. 8), synthetic task",
        out["command"], f"Machine: {out['machine']}",
        f"Each variant: the demo's tiny CCT, {out['updates_per_variant']} updates.")
    return lines + _lib.md_table(
        ["variant", "budget", "BLEU greedy", "hard-word acc", "realized fraction"], "llrrr",
        ([r["variant"], tuple(r["budget"]), r["bleu_greedy"], r["hard_token_acc"],
          r["realized_fraction"]] for r in out["rows"]))


def plot(rows: list[dict], path: Path) -> None:
    """BLEU against the realized fraction: the noise schedules, and the FFN pieces."""
    fig, axes = _plot.pyplot().subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, names, title in ((axes[0], ["linear, M=4", "constant, M=4"], "noise (fig. 7)"),
                             (axes[1], ["linear, M=4", "linear, M=2", "linear, M=1"],
                              "FFN pieces M (fig. 8)")):
        for name in names:
            pts = sorted((r["realized_fraction"], r["bleu_greedy"]) for r in rows
                         if r["variant"] == name)
            ax.plot(*zip(*pts, strict=True), "o-", label=name)
        ax.set_title(title)
        ax.set_xlabel("realized fraction of gated MACs")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("BLEU (greedy), synthetic test")
    _plot.save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cmd", choices=["train", "report"])
    p.add_argument("--steps", type=int, default=1200)
    _lib.add_results_arg(p)
    args = p.parse_args()
    {"train": cmd_train, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
