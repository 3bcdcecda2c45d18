"""serve_bound: how far a deadline can be kept at a budget, from the latency table alone.

``serve_load`` measures a server; this asks what *any* batch server at one budget could do
with the same model, machine and deadline, so that a missed SLO target can be told apart
from one no policy can reach. Two numbers per budget of the run's ``latency_table.json``,
both priced as the deadline policy prices a batch (:meth:`DeadlinePolicy.batch_ms`, each
line answered when its own decode ends: ``early_answers``):

1. **the cycle bound**: the largest arrival rate ``r`` at which a steady cycle of equal
   batches keeps every line within the deadline ``D``. Each batch holds the lines that
   arrived while the one before it ran: ``n = r T`` lines in ``T = t(n)`` ms, and a line
   that arrives as a batch starts waits ``T`` and is answered ``T`` later, so it needs
   ``2 T + window <= D`` with ``n <= --max-batch``. The lines come evenly spaced and all
   of the test set's mean source length, the predictions are exact and nothing else
   costs time: every idealisation favours the server, so above this rate no policy at
   this budget (or at a larger one) keeps every line in time.
2. **FIFO simulated**: the share of Poisson arrivals (the test set's own source lengths,
   drawn at random, seeded) answered within ``D`` by a batcher that takes up to
   ``--max-batch`` queued lines when it is free and waits ``--window-ms`` for more when it
   has fewer, as ``dynaseq serve`` at a fixed budget does; the mean over ``--repeats``
   streams of ``--seconds`` each. Beside ``serve_load``'s measured always-full and
   always-smallest rows (``--measured``), it says how much of a miss the table explains.

The table times the decode alone, on sentences of about each length; a server also spends
time on HTTP, tokenizing and its compute report, and its batches mix lengths. With
``--measured`` the full and smallest budgets get a second row each, every batch timed at
``serve_load``'s measured closed-loop saturation (the table's time x the table's
saturation over the measured one), as the server's own ``scale`` corrects its predictions.

Example (after ``serve_load`` wrote its latency table and results)::

    python benchmarks/serve_bound.py --run runs/bench/serve_load_cct51/run \
        --src runs/bench/serve_data/test_2016_flickr.en --deadline-ms 694.5 \
        --measured benchmarks/results/serve_load_session54/mean/serve_load.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import time
from pathlib import Path

from dynaseq.metrics.latency_table import LatencyTable
from dynaseq.serve.policy import DeadlinePolicy, Work

from _lib import add_results_arg, command, machine, md_head, md_table, provenance, write_results


def cycle_ms(policy: DeadlinePolicy, budget: tuple[float, ...], rate_rps: float,
             length: int, max_batch: int, scale: float = 1.0) -> float | None:
    """The batch time ``T`` (ms) of the steady cycle at ``rate_rps`` lines a second of
    ``length`` tokens, each batch ``scale`` times the table's time: the least fixed point of
    ``T = t(ceil(r T))``, found by iterating from one line's time (``t`` grows with the
    lines, so the iterates rise to it); None when the cycle needs more than ``max_batch``
    lines a batch (the arrivals outrun the server)."""
    t = scale * policy.batch_ms([Work(budget, 1, length)])
    for _ in range(10_000):
        n = max(1, -int(-rate_rps * t // 1000))  # ceil: a batch holds whole lines
        if n > max_batch:
            return None
        nxt = scale * policy.batch_ms([Work(budget, n, length)])
        if nxt <= t:
            return t
        t = nxt
    return None


def cycle_bound_rps(policy: DeadlinePolicy, budget: tuple[float, ...], length: int,
                    max_batch: int, deadline_ms: float, window_ms: float,
                    scale: float = 1.0) -> float:
    """The largest rate (lines a second, to 0.1) whose :func:`cycle_ms` ``T`` keeps
    ``2 T + window <= deadline`` (bisection: ``T`` grows with the rate); 0 when even one
    line alone cannot."""

    def ok(rate: float) -> bool:
        t = cycle_ms(policy, budget, rate, length, max_batch, scale)
        return t is not None and 2 * t + window_ms <= deadline_ms

    lo, hi = 0.0, 1.0
    if not ok(lo + 1e-9):
        return 0.0
    while ok(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 0.1:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return round(lo, 1)


def fifo_in_time(policy: DeadlinePolicy, budget: tuple[float, ...], lengths: list[int],
                 rate_rps: float, seconds: float, window_ms: float, max_batch: int,
                 deadline_ms: float, seed: int, scale: float = 1.0) -> float:
    """The share of one seeded Poisson stream answered within ``deadline_ms`` by a FIFO
    batcher at ``budget``, each batch ``scale`` times the table's time (see the module
    doc)."""
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    while True:
        now += rng.expovariate(rate_rps / 1000.0)
        if now > 1000.0 * seconds:
            break
        arrivals.append((now, rng.choice(lengths)))
    times = [came for came, _ in arrivals]  # increasing
    free, i, in_time = 0.0, 0, 0
    while i < len(arrivals):
        start = max(free, arrivals[i][0])
        if bisect.bisect_right(times, start) - i < max_batch:  # wait the window for more
            start += window_ms
        j = min(bisect.bisect_right(times, start), i + max_batch)
        batch = arrivals[i:j]
        works = [Work(budget, 1, length) for _, length in batch]
        answers = policy.answer_ms(works, [length for _, length in batch], scale)
        in_time += sum(start + ms - came <= deadline_ms
                       for (came, _), ms in zip(batch, answers, strict=True))
        free, i = start + scale * policy.batch_ms(works), j
    return in_time / max(1, len(arrivals))


def bound_row(policy: DeadlinePolicy, budget: tuple[float, ...], lengths: list[int],
              mean_length: int, base_rps: float, args: argparse.Namespace,
              scale: float = 1.0) -> dict:
    """One budget's row: its saturation at ``--max-batch`` lines of the mean length, its
    :func:`cycle_bound_rps` and its :func:`fifo_in_time` at each rate (mean over the
    streams), every batch ``scale`` times the table's time."""
    full_batch = scale * policy.batch_ms([Work(budget, args.max_batch, mean_length)])
    row = {"budget": list(budget), "scale": scale,
           "table_saturation_rps": round(1000 * args.max_batch / full_batch, 1),
           "cycle_bound_rps": cycle_bound_rps(policy, budget, mean_length, args.max_batch,
                                              args.deadline_ms, args.window_ms, scale),
           "fifo_in_time": {}}
    row["cycle_bound_x"] = round(row["cycle_bound_rps"] / base_rps, 3)
    for mult in args.rates:
        shares = [fifo_in_time(policy, budget, lengths, mult * base_rps, args.seconds,
                               args.window_ms, args.max_batch, args.deadline_ms, seed, scale)
                  for seed in range(args.repeats)]
        row["fifo_in_time"][f"{mult:g}x"] = round(statistics.fmean(shares), 3)
    return row


def source_lengths(run: Path, src: Path) -> list[int]:
    """Each test line's source length as the server counts it: its subwords plus EOS."""
    import dynaseq

    lines = [s for s in src.read_text().splitlines() if s.strip()]
    return [len(ids) + 1 for ids in dynaseq.load(run).tokenizer.encode(lines)]


def measured_slo(measured: dict | None) -> dict[tuple[float, str], float]:
    """``(rate multiple, policy) -> SLO attained`` of a ``serve_load`` result (none: {})."""
    if measured is None:
        return {}
    return {(r["rate_x"], r["policy"]): r["slo_attainment"] for r in measured["rows"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True,
                   help="a run with latency_table.json (serve_load's copy of it)")
    p.add_argument("--src", type=Path, required=True, help="the test set's source lines")
    p.add_argument("--deadline-ms", type=float, required=True)
    p.add_argument("--measured", type=Path, default=None,
                   help="a serve_load.json: its rates, saturation and always-full / "
                        "always-smallest SLO beside the simulated ones")
    p.add_argument("--base-rps", type=float, default=None,
                   help="the rate the --rates multiply (default: --measured's full-budget "
                        "saturation)")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0])
    p.add_argument("--window-ms", type=float, default=5.0)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=20)
    add_results_arg(p)
    args = p.parse_args()
    measured = json.loads(args.measured.read_text()) if args.measured else None
    base = args.base_rps or (measured["saturation_rps"]["full"] if measured else None)
    if base is None:
        p.error("give --base-rps or --measured")
    slo = measured_slo(measured)

    table = LatencyTable.load(args.run / "latency_table.json")
    policy = DeadlinePolicy(table, table.budgets, args.max_batch, early_answers=True)
    lengths = source_lengths(args.run, args.src)
    mean_length = round(statistics.fmean(lengths))
    named = {"full": list(policy.largest), "smallest": list(policy.smallest)}
    rows = [bound_row(policy, budget, lengths, mean_length, base, args)
            for budget in policy.budgets]
    if measured is not None:  # the same two budgets at the server's measured pace
        for name, budget in named.items():
            table_rps = next(r["table_saturation_rps"] for r in rows if r["budget"] == budget)
            scale = table_rps / measured["saturation_rps"][name]
            rows.append(bound_row(policy, tuple(budget), lengths, mean_length, base, args,
                                  round(scale, 3)))
    data = {"command": command(), "made_by": provenance(), "machine": machine(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "run": str(args.run),
            "test_set": str(args.src), "lines": len(lengths), "mean_length": mean_length,
            "deadline_ms": args.deadline_ms, "base_rps": base, "window_ms": args.window_ms,
            "max_batch": args.max_batch, "seconds": args.seconds, "repeats": args.repeats,
            "measured": str(args.measured) if args.measured else None,
            "measured_slo": {f"{m:g}x {name}": slo.get((m, name)) for m in args.rates
                             for name in named},
            "rows": rows}
    md = md_head(
        "serve_bound: what a batch server at one budget could keep within the deadline",
        data["command"],
        f"Latency table of `{args.run}`, priced as the deadline policy prices a batch; "
        f"{len(lengths)} test lines of `{args.src}`, mean source length {mean_length} "
        f"tokens; deadline {args.deadline_ms} ms; rates are multiples of {base} req/s; at "
        f"most {args.max_batch} lines a batch, window {args.window_ms} ms.  ",
        "Cycle bound: the largest rate at which evenly spaced lines of the mean length, in "
        "a steady cycle of equal batches, all answer within the deadline (an upper bound "
        "for any policy at that budget). FIFO: the simulated share of Poisson arrivals "
        f"answered in time, mean of {args.repeats} streams of {args.seconds} s; measured: "
        "serve_load's SLO attained for always-full / always-smallest. Time x table: 1 "
        "for the table as measured; the last rows time the full and smallest budgets at "
        "serve_load's measured closed-loop saturation instead (each batch that many times "
        "the table's time: the server's own costs and the test set's mix of lengths).")
    md += md_table(
        ["budget", "time x table", "saturation req/s", "cycle bound req/s", "cycle bound x",
         *(f"FIFO {m:g}x" for m in args.rates)],
        "lrrrr" + "r" * len(args.rates),
        [[r["budget"], r["scale"], r["table_saturation_rps"], r["cycle_bound_rps"],
          r["cycle_bound_x"], *(_with_measured(r, m, named, slo) for m in args.rates)]
         for r in rows])
    write_results(args.results, "serve_bound", data, md)
    print("\n".join(md))


def _with_measured(row: dict, mult: float, named: dict[str, list[float]],
                   slo: dict[tuple[float, str], float]) -> str:
    """A FIFO cell, with the measured SLO of the same always-budget policy beside it."""
    cell = str(row["fifo_in_time"][f"{mult:g}x"])
    for name, budget in named.items():
        if row["budget"] == budget and (mult, name) in slo:
            cell += f" (measured {slo[(mult, name)]})"
    return cell


if __name__ == "__main__":
    main()
