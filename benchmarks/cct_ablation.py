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
import platform
import sys
from pathlib import Path

import torch

from dynaseq.data import read_lines, write_task
from dynaseq.demo import DEMO_BUDGETS, demo_cct, demo_config, token_accuracy
from dynaseq.infer.translator import Translator, bleu
from dynaseq.train.loop import train

RESULTS = Path("benchmarks/results")
RUNS = Path("runs/bench/cct_ablation")
DATA = RUNS / "data"
# name -> (noise ramp as a fraction of the updates, FFN pieces M)
VARIANTS = {"linear, M=4": (0.3, 4), "constant, M=4": (0.0, 4), "linear, M=2": (0.3, 2),
            "linear, M=1": (0.3, 1)}


def run_dir(name: str) -> Path:
    return RUNS / name.replace(", ", "_").replace("=", "")


def cmd_train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    paths = write_task(DATA, seed=0)
    for name, (ramp, pieces) in VARIANTS.items():
        cct = demo_cct(args.steps, updates_per_minute=1.0)
        cct.ffn_pieces, cct.noise_ramp_steps = pieces, int(ramp * args.steps)
        cfg = demo_config(run_dir(name), paths, minutes=60.0, seed=0, cct=cct)
        cfg.run_dir = str(run_dir(name))
        cfg.train.max_steps = args.steps
        print(f"== training {name}", file=sys.stderr, flush=True)
        if train(cfg, progress=True).stopped_by_signal is not None:
            break


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
           "machine": {"platform": platform.platform(), "torch": torch.__version__,
                       "threads_train": 1, "threads_eval": torch.get_num_threads()},
           "updates_per_variant": args.steps, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cct_ablation.json").write_text(json.dumps(out, indent=1))
    lines = ["# cct_ablation: noise schedule (fig. 7) and FFN pieces M (fig. 8), synthetic task",
             "", f"Command: `{out['command']}`  ", f"Machine: {out['machine']}  ",
             f"Each variant: the demo's tiny CCT, {args.steps} updates.", "",
             "| variant | budget | BLEU greedy | hard-word acc | realized fraction |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {tuple(r['budget'])} | {r['bleu_greedy']} | "
              f"{r['hard_token_acc']} | {r['realized_fraction']} |" for r in rows]
    (RESULTS / "cct_ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
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
    fig.tight_layout()
    fig.savefig(RESULTS / "cct_ablation.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cmd", choices=["train", "report"])
    p.add_argument("--steps", type=int, default=1200)
    args = p.parse_args()
    {"train": cmd_train, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
