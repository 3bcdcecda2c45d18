"""serve_plan: what planning one deadline request costs the server's event loop.

``dynaseq serve`` plans every request on arrival against the queue (``DeadlinePolicy.
plan``, and ``predicted`` for the access log), on the event loop, which shares its core
with the decoding batches. This times those two calls per request behind queues of
``--queues`` lines, as a server sees them: the requests come one after another, each
behind the queue the one before it saw plus that request's own line (so the full batches
ahead stay the same while the last one fills). Two policies take turns in each round:
``priced`` (as served: each batch's price per budget computed once, line costs cached)
and ``every line`` (nothing kept from one request to the next: every queued line priced
again, as before the cache). Lines carry a deadline, budgets and source lengths drawn
(seeded) from the run's budgets and ``--src``'s tokenized lines.

Example::

    python benchmarks/serve_plan.py --run runs/bench/serve_load_cct55/run \\
        --src runs/bench/serve_data/test_2016_flickr.en
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from dynaseq.metrics.latency_table import LatencyTable
from dynaseq.serve.batcher import Load
from dynaseq.serve.policy import DeadlinePolicy, Work

import _lib


def policy(table: LatencyTable, max_batch: int, cached: bool) -> DeadlinePolicy:
    """The run's deadline policy; ``cached`` False: one that keeps no price between calls."""
    p = DeadlinePolicy(table, [tuple(b) for b in table.budgets], max_batch_rows=max_batch,
                       window_ms=5.0, slack=0.9, early_answers=True)
    if not cached:
        p._priced = p._summary  # every batch priced on every call

        class Forgetful(dict):  # line costs are not kept either
            def __setitem__(self, key, value) -> None:
                pass

        p._line_costs = Forgetful()
    return p


def time_requests(p: DeadlinePolicy, queue: list[Work], arrivals: list[Work],
                  deadline_ms: float) -> float:
    """Mean ms of ``plan`` + ``predicted`` per request, each of ``arrivals`` planned behind
    ``queue`` and the arrivals before it."""
    ahead = list(queue)
    t0 = time.perf_counter()
    for w in arrivals:
        load = Load(list(ahead), 20.0, 1.3, 10.0, 10.0, 100.0)
        d = p.plan(load, deadline_ms, w.rows, w.length)
        p.predicted(load, d.budget or p.smallest, w.rows, w.length)
        ahead.append(w)
    return 1000 * (time.perf_counter() - t0) / len(arrivals)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a run with latency_table.json")
    ap.add_argument("--src", type=Path, required=True, help="source lines (for lengths)")
    ap.add_argument("--queues", type=int, nargs="+", default=[10, 30, 100, 300, 1000])
    ap.add_argument("--requests", type=int, default=100, help="requests timed per queue")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--deadline-ms", type=float, default=312.0)
    _lib.add_results_arg(ap)
    args = ap.parse_args(argv)
    table_path = args.run / "latency_table.json"
    if not table_path.is_file():
        print(f"serve_plan: no latency table at {table_path}", file=sys.stderr)
        return 2
    table = LatencyTable.load(table_path)
    from dynaseq.tasks.registry import load as load_run

    tokenizer = load_run(args.run).tokenizer
    lines = [x for x in args.src.read_text(encoding="utf-8").splitlines() if x.strip()]
    lengths = [len(ids) + 1 for ids in tokenizer.encode(lines[:1000])]
    budgets = [tuple(b) for b in table.budgets]
    rng = random.Random(0)

    def works(n: int) -> list[Work]:
        return [Work(rng.choice(budgets), 1, rng.choice(lengths), True) for _ in range(n)]

    rows = []
    for n in args.queues:
        queue, arrivals = works(n), works(args.requests)
        times: dict[str, list[float]] = {"priced": [], "every line": []}
        for _ in range(args.rounds):
            for name in times:  # a fresh policy each round: the first request pays in full
                p = policy(table, args.max_batch, name == "priced")
                times[name].append(time_requests(p, queue, arrivals, args.deadline_ms))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"queue_lines": n, "priced_ms": round(med["priced"], 4),
                     "every_line_ms": round(med["every line"], 4),
                     "ratio": round(med["priced"] / med["every line"], 3)})
        print(rows[-1])
    data = {"command": _lib.command(argv), "machine": _lib.machine(processor=True),
            "run": str(args.run), "requests": args.requests, "rounds": args.rounds,
            "max_batch_lines": args.max_batch, "budgets": [list(b) for b in budgets],
            "rows": rows}
    md = _lib.md_head(
        "serve_plan: event-loop time to plan one deadline request", data["command"],
        f"Machine: {data['machine']}",
        f"Latency table of `{args.run}` ({len(budgets)} budgets); {args.requests} requests "
        f"per queue, each behind the queue and the requests before it; medians of "
        f"{args.rounds} rounds, the two policies in turn; `plan` + `predicted` per request.")
    md += _lib.md_table(["queued lines", "priced (ms)", "every line (ms)", "priced / every"],
                        "rrrr", [[r["queue_lines"], r["priced_ms"], r["every_line_ms"],
                                  r["ratio"]] for r in rows])
    _lib.write_results(args.results, "serve_plan", data, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
