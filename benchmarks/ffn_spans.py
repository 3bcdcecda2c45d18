"""Benchmark `ffn_spans`: the CCT feed-forward's mixed gates fused over the span of open
pieces against every piece times its gate (issue 28: lower budgets at batch 1).

A decoding step whose rows open pieces 0 and 1 of 4 (58% of the trained Multi30k CCT's
feed-forward steps at (.5, .5), batch 1) ran all four pieces' products and multiplied two
by 0; with spans (:attr:`GatedFeedForward.SPANS`) it runs the two. This times greedy
translation of ``--lines`` test sentences at each ``--budgets`` and ``--batches`` with the
switch on and off, the two taking turns in every round in one process (the machine's noise
hits them alike): the median of the per-round ratios, their range, and whether the
translations are the same.

    python benchmarks/ffn_spans.py [--run runs/bench/cct_quality_cct]
        [--src ../shared/data/multi30k/test_2016_flickr.en.gz] [--rounds 8]

Writes benchmarks/results/ffn_spans.{json,md}. Run from the repository root, alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import dynaseq
from dynaseq.data import read_lines
from dynaseq.techniques.cct.lean_step import GatedFeedForward

import _lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="runs/bench/cct_quality_cct", help="a trained CCT")
    p.add_argument("--src", default="../shared/data/multi30k/test_2016_flickr.en.gz")
    p.add_argument("--lines", type=int, default=40)
    p.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.33, 0.2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    _lib.add_results_arg(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t = dynaseq.load(args.run)
    lines = random.Random(0).sample(read_lines(args.src), args.lines)

    def decode(spans: bool, budget: float, batch: int) -> tuple[float, list[str]]:
        GatedFeedForward.SPANS = spans
        t0 = time.perf_counter()
        out = t.translate(lines, beam=1, budget=budget, batch_size=batch)
        return 1000 * (time.perf_counter() - t0) / len(lines), out

    rows = []
    try:
        for batch in args.batches:
            for budget in args.budgets:
                for spans in (True, False):  # warm-up
                    decode(spans, budget, batch)
                times: dict[bool, list[float]] = {True: [], False: []}
                same = True
                for r in range(args.rounds):
                    outs = {}
                    for spans in ((True, False) if r % 2 else (False, True)):
                        ms, outs[spans] = decode(spans, budget, batch)
                        times[spans].append(ms)
                    same = same and outs[True] == outs[False]
                ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
                rows.append({"batch": batch, "budget": budget,
                             "spans_ms": round(statistics.median(times[True]), 2),
                             "all_pieces_ms": round(statistics.median(times[False]), 2),
                             "ratio": round(statistics.median(ratios), 3),
                             "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                             "same_translations": same})
                print(rows[-1])
    finally:
        GatedFeedForward.SPANS = True
    out = {"benchmark": "ffn_spans", **_lib.provenance(),
           "machine": _lib.machine(processor=True), "run": args.run, "lines": args.lines,
           "rounds": args.rounds, "rows": rows}
    md = _lib.md_head(
        "ffn_spans: mixed feed-forward gates fused over the open span, against every piece",
        out["command"], f"Machine: {out['machine']}",
        f"Run `{args.run}`, {args.lines} test sentences, greedy, {args.rounds} rounds, the "
        "two taking turns; ratio: spans ÷ every piece, the median of the rounds' ratios.")
    md += _lib.md_table(
        ["batch", "budget", "spans ms/line", "every piece ms/line", "ratio", "range",
         "same translations"], "rrrrrrl",
        [[r["batch"], r["budget"], r["spans_ms"], r["all_pieces_ms"], r["ratio"],
          f"{r['ratio_range'][0]}-{r['ratio_range'][1]}", r["same_translations"]]
         for r in rows])
    _lib.write_results(args.results, "ffn_spans", out, md)


if __name__ == "__main__":
    main()
