"""Benchmark `mixed_budgets`: lines that carry different budgets, decoded by budget against
as mixed batches (issue 30: mixed-budget throughput).

One CCT (default: the model `make demo` shows, shipped in the package), greedy decoding,
batches of ``--batch`` lines, in one process, the systems taking turns round by round:

* ``by budget``: ``Translator.translate(lines, budget=[one per line])`` over the whole
  corpus, which batches the lines by budget, then by length
  (:func:`dynaseq.tasks.translation.predictor.budget_batches`), a batch of one budget run
  as that budget's call (``one_budget``);
* ``mixed batches``: the same lines and budgets sorted by length, each batch of ``--batch``
  decoded as one batch whatever its budgets (the search on the lean decoder, as
  ``decode_corpus`` ran every batch before ``budget_batches``, and as a server batch of
  requests at several budgets would be run without it);
* ``one batch, translate``: the first ``--batch`` lines alone through ``translate`` (as a
  server runs a batch of requests) against ``one batch, mixed``, the same lines as one
  mixed batch through the search itself, and ``one batch, one per budget``, each budget's
  lines of it as a batch of their own at that budget (what cutting the batch would cost);
* every line at each budget, and at ``--mid``: the references.

The lines ask for ``--budgets`` (default the largest and the smallest trained) in the
counts ``--mix`` per ``--batch`` lines (default 12 and 20 of 32, as in the issue's
analysis), shuffled (seed 1). ``linear mix`` is what those lines would cost at their
budgets' own single-budget rates. Each line is also compared with the same line translated
at its budget alone.

    python benchmarks/mixed_budgets.py [--run DIR] [--src FILE] [--lines 192] [--rounds 5]
        [--budgets 1 0.2] [--mix 12 20] [--stem mixed_budgets]

Writes benchmarks/results/STEM.{json,md} (``--stem``, default ``mixed_budgets``). Run from the
repository root, alone.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from dynaseq.data import read_lines, write_task
from dynaseq.data.batching import collate_source
from dynaseq.models.search import greedy_search
from dynaseq.nn.modes import evaluating
from dynaseq.tasks.translation.predictor import Translator

import _lib

DEMO_MODEL = Path("src/dynaseq/workflows/demo_model")


def corpus(src: Path | None, n: int) -> list[str]:
    """``n`` non-empty lines of ``src`` (default: the synthetic task's test set, seed 5)."""
    if src is None:
        src = write_task(tempfile.mkdtemp(prefix="mixed_budgets_"), seed=5, n_train=10,
                         n_valid=10, n_test=max(2 * n, 400))["test.src"]
    lines = [x for x in read_lines(src) if x.strip()]
    if len(lines) < n:
        raise SystemExit(f"{src} has {len(lines)} non-empty lines, fewer than --lines {n}")
    return random.Random(0).sample(lines, n)


def by_length_batches(t: Translator, lines: list[str], budgets: list, batch: int
                      ) -> list[tuple[list[str], list]]:
    """The batches a length-sorted decode forms: consecutive ``batch`` lines by length."""
    lengths = [len(ids) for ids in t.tokenizer.encode(lines)]
    order = sorted(range(len(lines)), key=lambda i: lengths[i])
    return [([lines[i] for i in order[k: k + batch]], [budgets[i] for i in order[k: k + batch]])
            for k in range(0, len(order), batch)]


def one_mixed_batch(t: Translator, lines: list[str], budgets: list) -> list[list[int] | None]:
    """``lines`` (non-empty) decoded greedily as one batch at their ``budgets``, through the
    lean decoder as ``decode_corpus`` decodes a batch."""
    d, m = t.config.decode, t.model
    src = collate_source([ids[: m.encoder.positions.max_positions - 1]
                          for ids in t.tokenizer.encode(lines)], m.pad_id, m.eos_id)
    lean = t.lean_decoder()
    with evaluating(m):
        return greedy_search(m if lean is None else lean, src, max_len_a=d.max_len_a,
                             max_len_b=d.max_len_b,
                             max_positions=m.encoder.positions.max_positions,
                             control=t.control_for(budgets, len(lines)))


def budget_arg(text: str) -> tuple[float, float]:
    """``--budgets`` item: ``b`` (both sides) or ``e,d``."""
    parts = [float(x) for x in text.split(",")]
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"a budget is b or e,d, got {text!r}")
    return (parts[0], parts[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, default=DEMO_MODEL, help="a CCT run or model directory")
    p.add_argument("--src", type=Path, help="source lines (default: the synthetic test set)")
    p.add_argument("--lines", type=int, default=192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--budgets", type=budget_arg, nargs="+",
                   help="the budgets the lines ask for (b or e,d; default the largest and "
                        "the smallest trained)")
    p.add_argument("--mix", type=int, nargs="+", default=[12, 20],
                   help="lines at each of --budgets per --batch lines (default 12 20)")
    p.add_argument("--mid", type=float, default=0.5, help="the middle reference budget (b, b)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stem", default="mixed_budgets",
                   help="the result files' name (default mixed_budgets)")
    _lib.add_results_arg(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    t = Translator.load(args.run)
    trained = sorted({tuple(b) for b in t.config.model.cct.budgets}, reverse=True)
    kinds = args.budgets or [trained[0], trained[-1]]
    if len(args.mix) != len(kinds) or sum(args.mix) != args.batch:
        raise SystemExit(f"--mix needs one count per budget ({len(kinds)}) adding up to "
                         f"--batch {args.batch}, got {args.mix}")
    mid = (args.mid, args.mid)
    lines = corpus(args.src, args.lines)
    counts = [round(c * len(lines) / args.batch) for c in args.mix]
    counts[-1] = len(lines) - sum(counts[:-1])
    budgets = [b for b, c in zip(kinds, counts, strict=True) for _ in range(c)]
    random.Random(1).shuffle(budgets)
    batches = by_length_batches(t, lines, budgets, args.batch)
    first, first_budgets = lines[: args.batch], budgets[: args.batch]

    def translate(some: list[str], budget: object) -> list[str]:
        return t.translate(some, beam=1, batch_size=args.batch, budget=budget)

    def one_per_budget() -> None:
        for b in kinds:
            own = [x for x, bx in zip(first, first_budgets, strict=True) if bx == b]
            if own:
                translate(own, b)

    systems = {
        "by budget": lambda: translate(lines, budgets),
        "mixed batches": lambda: [one_mixed_batch(t, b, bud) for b, bud in batches],
        "one batch, translate": lambda: translate(first, first_budgets),
        "one batch, mixed": lambda: one_mixed_batch(t, first, first_budgets),
        "one batch, one per budget": one_per_budget,
        **{f"all {b}": (lambda b=b: translate(lines, b)) for b in dict.fromkeys([*kinds, mid])},
    }
    sec = _lib.interleaved_seconds(systems, args.rounds)
    ms = {k: round(1000 * v / (len(first) if k.startswith("one batch") else len(lines)), 3)
          for k, v in sec.items()}  # per line

    alone = {b: translate(lines, b) for b in kinds}
    mixed_out = translate(lines, budgets)
    same = sum(mixed_out[i] == alone[b][i] for i, b in enumerate(budgets))
    linear = sum(c * ms[f"all {b}"] for b, c in zip(kinds, counts, strict=True)) / len(lines)
    in_first = {str(b): first_budgets.count(b) for b in kinds}
    out = {
        **_lib.provenance(), "machine": _lib.machine(processor=True),
        "run": str(args.run), "lines": len(lines), "batch": args.batch, "rounds": args.rounds,
        "budgets": [list(b) for b in kinds], "lines_per_budget": counts,
        "first_batch_lines_per_budget": in_first, "mid": list(mid),
        "ms_per_line": ms, "linear_mix_ms_per_line": round(linear, 3),
        "ratios": {
            "by budget ÷ mixed batches (time)": round(ms["by budget"] / ms["mixed batches"],
                                                      3),
            "one batch: translate ÷ mixed (time)": round(
                ms["one batch, translate"] / ms["one batch, mixed"], 3),
            "one batch: one per budget ÷ mixed (time)": round(
                ms["one batch, one per budget"] / ms["one batch, mixed"], 3),
            "by budget ÷ linear mix (time)": round(ms["by budget"] / linear, 3),
            f"by budget throughput ÷ all {mid}": round(ms[f"all {mid}"] / ms["by budget"], 3),
            f"mixed batches throughput ÷ all {mid}": round(
                ms[f"all {mid}"] / ms["mixed batches"], 3),
        },
        "lines_equal_to_their_budget_alone": f"{same} of {len(lines)}",
    }
    mix_text = ", ".join(f"{c} at {b}" for b, c in zip(kinds, counts, strict=True))
    lines_md = _lib.md_head(
        "mixed_budgets: lines at several budgets, decoded by budget or as mixed batches",
        out["command"], f"Code: {(out['commit'] or 'no git checkout')[:12]}"
        f"{' (with uncommitted changes)' if out['dirty'] else ''} ({out['date']} UTC)",
        f"Machine: {out['machine']}",
        f"Run {args.run}; {len(lines)} lines ({mix_text}, shuffled; the first batch: "
        f"{', '.join(f'{c} at {b}' for b, c in in_first.items())}), greedy, batches of "
        f"{args.batch}; median of {args.rounds} interleaved rounds after a warm-up.")
    lines_md += _lib.md_table(["system", "ms per line"], "lr",
                              [[k, v] for k, v in ms.items()] + [["linear mix", round(linear, 3)]])
    lines_md += ["", *_lib.md_table(["ratio", "value"], "lr", out["ratios"].items()), "",
                 f"Lines equal to their budget alone: {out['lines_equal_to_their_budget_alone']}."]
    _lib.write_results(args.results, args.stem, out, lines_md)
    print("\n".join(lines_md))


if __name__ == "__main__":
    main()
