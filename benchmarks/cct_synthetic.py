"""A first CCT measurement on the built-in synthetic task (not the Multi30k benchmark yet).

Trains one CCT model (the demo's tiny 2+2-layer size, M=4 FFN pieces) for several
(encoder, decoder) budgets, then evaluates each budget on the test split: BLEU (greedy),
the realized fraction of gated-sub-layer MACs (teacher forced, batch 1), and the wall time of
teacher-forced scoring as a ratio to budget 1 (interleaved repeats in one process).

    python benchmarks/cct_synthetic.py [--minutes 4] [--lines 300]

Writes benchmarks/results/cct_synthetic.{json,md}. Run from the repository root; reuses
runs/demo/data (written by `make demo`) or writes it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import dynaseq
from dynaseq.config import CCTConfig
from dynaseq.data import read_lines, write_task
from dynaseq.demo import demo_config
from dynaseq.train.loop import train

BUDGETS = [(1.0, 1.0), (0.5, 0.5), (0.33, 0.33)]
RESULTS = Path("benchmarks/results")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--lines", type=int, default=300, help="test lines to evaluate")
    p.add_argument("--out", default="runs/cct_try")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    data = Path("runs/demo/data")
    if not (data / "test.tgt").exists():
        write_task(data, seed=0)
    paths = {f"{s}.{x}": data / f"{s}.{x}" for s in ("train", "valid", "test")
             for x in ("src", "tgt")}
    cfg = demo_config(Path(args.out), paths, minutes=args.minutes, seed=0)
    cfg.model.cct = CCTConfig(ffn_pieces=4, control_hidden=64, noise_ramp_steps=1500,
                              budgets=BUDGETS)
    result = train(cfg, progress=True)
    t = dynaseq.load(cfg.run_dir)
    src = read_lines(paths["test.src"])[: args.lines]
    ref = read_lines(paths["test.tgt"])[: args.lines]
    rows = []
    for enc, dec in BUDGETS[:1] + BUDGETS[1:]:
        r = t.evaluate(src, ref, beam=1, budget=(enc, dec))
        rows.append({"budget": [enc, dec], "bleu": round(r["bleu"], 2),
                     "realized_fraction": {k: round(v, 3)
                                           for k, v in r["realized_fraction"].items()}})
    # teacher-forced scoring time per budget, interleaved
    times = {i: [] for i in range(len(rows))}
    for _ in range(args.repeats):
        for i, row in enumerate(rows):
            t0 = time.perf_counter()
            t.score(src, ref, budget=tuple(row["budget"]))
            times[i].append(time.perf_counter() - t0)
    base = statistics.median(times[0])
    for i, row in enumerate(rows):
        row["scoring_time_ratio_vs_budget_1"] = round(statistics.median(times[i]) / base, 3)
    out = {"benchmark": "cct_synthetic",
           "command": f"python benchmarks/cct_synthetic.py --minutes {args.minutes:g} "
                      f"--lines {args.lines}",
           "machine": {"platform": platform.platform(), "torch": torch.__version__,
                       "threads": torch.get_num_threads()},
           "train": {"steps": result.state.step, "minutes": round(result.state.elapsed / 60, 2)},
           "test_lines": len(src), "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cct_synthetic.json").write_text(json.dumps(out, indent=1))
    lines = ["# CCT on the synthetic task: one model, three budgets", "",
             f"Command: `{out['command']}`  ", f"Machine: {out['machine']}  ",
             f"Training: {out['train']}", "",
             "| budget (enc, dec) | BLEU greedy | realized enc | realized dec | realized total |"
             " scoring time ÷ budget 1 |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = r["realized_fraction"]
        lines.append(f"| {tuple(r['budget'])} | {r['bleu']} | {f['encoder']} | {f['decoder']} |"
                     f" {f['total']} | {r['scoring_time_ratio_vs_budget_1']} |")
    lines += ["", "Realized fraction: MACs that ran in the gated sub-layers (attention, FFN "
              "pieces, control nets) over the same teacher-forced pass with every gate on."]
    (RESULTS / "cct_synthetic.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
