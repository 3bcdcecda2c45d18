"""Benchmark `continuous_batching`: greedy translation with the rows of finished sentences
refilled by new ones (continuous batching) against batches that run until their longest
output is done (issue 30: a server's throughput when outputs differ in length).

A batch of :func:`~dynaseq.models.search.greedy_search` drops its finished sentences, so
it runs fewer and fewer rows for as many steps as its longest output needs, and each step
costs a fixed part (per-op overhead, the control networks, reading the weights) plus a part
per row. :func:`~dynaseq.models.search.refilled_greedy_search` fills a finished sentence's
row with the next sentence (its encoder pass, its cross-attention keys put in the row), so
every step runs about ``--rows`` rows. This decodes ``--lines`` test sentences in two
orders: as they come (``arrival``: a server's queue, batches of consecutive sentences of any
length) and sorted by source length (``sorted``: what ``dynaseq translate`` batches), at
each ``--budgets``, as batches of ``--rows`` and refilled (new sentences taken once
``--min-free`` rows are free), the systems taking turns in every round in one process.
Reported: lines per second, each system's time ÷ the batches', decoding steps and rows per
step (counted in one more untimed pass), and whether every sentence got the same tokens.

    python benchmarks/continuous_batching.py [--run runs/bench/cct_quality_cct]
        [--src ../shared/data/multi30k/test_2016_flickr.en.gz] [--lines 512] [--rounds 5]

Writes benchmarks/results/continuous_batching.{json,md}. Run from the repository root,
alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

import dynaseq
from dynaseq.data import collate_source, read_lines
from dynaseq.models.search import Sentences, greedy_search, refilled_greedy_search

import _lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="runs/bench/cct_quality_cct", help="a trained model")
    p.add_argument("--src", default="../shared/data/multi30k/test_2016_flickr.en.gz")
    p.add_argument("--lines", type=int, default=512)
    p.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.2])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--min-free", type=int, nargs="+", default=[1, 8])
    p.add_argument("--orders", nargs="+", choices=["arrival", "sorted"],
                   default=["arrival", "sorted"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    _lib.add_results_arg(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t = dynaseq.load(args.run)
    lines = random.Random(0).sample(read_lines(args.src), args.lines)
    _, ids = t.tokenizer.encode_kept(lines)
    lean = t.lean_decoder()
    d = t.config.decode
    kw = {"max_len_a": d.max_len_a, "max_len_b": d.max_len_b}
    budgets = args.budgets if t.config.model.cct is not None else [None]
    rows_out = []
    for order_name in args.orders:
        order = list(range(len(ids)))
        if order_name == "sorted":
            order.sort(key=lambda i: len(ids[i]))
        for budget in budgets:
            systems: dict[str, Callable[[], dict[int, list[int]]]] = {
                "batches": batches(t, lean, ids, order, budget, args.rows, kw)}
            for k in args.min_free:
                systems[f"refilled, min_free {k}"] = refilled(t, lean, ids, order, budget,
                                                              args.rows, k, kw)
            outs = {name: fn() for name, fn in systems.items()}  # warm-up, and the tokens
            steps = {name: counted_steps(lean, fn) for name, fn in systems.items()}
            times: dict[str, list[float]] = {name: [] for name in systems}
            names = list(systems)
            for r in range(args.rounds):  # each round starts with another system
                for name in names[r % len(names):] + names[: r % len(names)]:
                    t0 = time.perf_counter()
                    systems[name]()
                    times[name].append(time.perf_counter() - t0)
            base = times["batches"]
            for name in names:
                ratios = [a / b for a, b in zip(times[name], base, strict=True)]
                n_steps, n_rows = steps[name]
                rows_out.append({
                    "order": order_name, "budget": budget, "system": name,
                    "seconds": round(statistics.median(times[name]), 3),
                    "lines_per_s": round(len(ids) / statistics.median(times[name]), 1),
                    "vs_batches": round(statistics.median(ratios), 3),
                    "vs_batches_range": [round(min(ratios), 3), round(max(ratios), 3)],
                    "steps": n_steps, "rows_per_step": round(n_rows / n_steps, 1),
                    "same_tokens": outs[name] == outs["batches"]})
                print(rows_out[-1], flush=True)
    out = {"benchmark": "continuous_batching", **_lib.provenance(),
           "machine": _lib.machine(processor=True), "run": args.run, "src": args.src,
           "lines": len(ids), "rows": args.rows, "rounds": args.rounds, "results": rows_out}
    md = _lib.md_head(
        "continuous_batching: refilled greedy decoding against batches that run to their "
        "longest output", out["command"], f"Machine: {out['machine']}",
        f"Run `{args.run}`, {len(ids)} sentences of `{args.src}` (drawn with seed 0), "
        f"greedy, {args.rows} rows, {args.rounds} interleaved rounds in one process; ÷ "
        "batches: the median of the rounds' ratios (range beside it).")
    md += _lib.md_table(
        ["order", "budget", "system", "s", "lines/s", "÷ batches", "range", "steps",
         "rows/step", "same tokens"], "lrlrrrrrrl",
        [[r["order"], "–" if r["budget"] is None else r["budget"], r["system"], r["seconds"],
          r["lines_per_s"], r["vs_batches"],
          f"{r['vs_batches_range'][0]}-{r['vs_batches_range'][1]}", r["steps"],
          r["rows_per_step"], r["same_tokens"]] for r in rows_out])
    _lib.write_results(args.results, "continuous_batching", out, md)


def _control(t, budget: float | None, n: int):
    return t.control_for(budget, n) if budget is not None else t.control_for(None, n)


def _src(model, ids: list[list[int]], idx: list[int]) -> torch.Tensor:
    return collate_source([ids[i] for i in idx], model.pad_id, model.eos_id)


def batches(t, lean, ids, order, budget, rows, kw) -> Callable[[], dict[int, list[int]]]:
    """Greedy search of consecutive ``rows`` sentences of ``order`` at a time."""
    def run() -> dict[int, list[int]]:
        out = {}
        for k in range(0, len(order), rows):
            idx = order[k: k + rows]
            hyps = greedy_search(lean, _src(t.model, ids, idx),
                                 control=_control(t, budget, len(idx)), **kw)
            out.update(zip(idx, hyps, strict=True))
        return out
    return run


def refilled(t, lean, ids, order, budget, rows, min_free, kw
             ) -> Callable[[], dict[int, list[int]]]:
    """The sentences of ``order`` through one refilled decode of ``rows`` rows."""
    def run() -> dict[int, list[int]]:
        queue, out = list(order), {}

        def refill(free: int) -> Sentences | None:
            take, queue[:free] = queue[:free], []
            return (Sentences(take, _src(t.model, ids, take), _control(t, budget, len(take)))
                    if take else None)

        refilled_greedy_search(lean, refill, out.__setitem__, max_rows=rows,
                               min_free=min_free, **kw)
        return out
    return run


def counted_steps(lean, fn: Callable[[], object]) -> tuple[int, int]:
    """Decoding steps one call of ``fn`` runs through ``lean``, and their rows in all."""
    step, seen = lean.decode_step, [0, 0]

    def counting(tokens, enc, state):
        seen[0] += 1
        seen[1] += tokens.size(0)
        return step(tokens, enc, state)

    lean.decode_step = counting
    try:
        fn()
    finally:
        del lean.decode_step  # the class's method again
    return seen[0], seen[1]


if __name__ == "__main__":
    main()
