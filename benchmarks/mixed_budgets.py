"""Benchmark `mixed_budgets`: lines that carry different budgets, decoded by budget against
as mixed batches (issue 30: mixed-budget throughput).

One CCT (default: the model `make demo` shows, shipped in the package), greedy decoding,
batches of ``--batch`` lines, in one process, the systems taking turns round by round:

* ``by budget``: ``Translator.translate(lines, budget=[one per line])`` over the whole
  corpus, which batches the lines by budget, then by length, and decodes a batch that
  holds the full budget and one other as two
  (:func:`dynaseq.tasks.translation.predictor.budget_batches`);
* ``mixed batches``: the same lines and budgets sorted by length, each batch of ``--batch``
  decoded as one batch whatever its budgets (the search on the lean decoder, as
  ``decode_corpus`` ran every batch before ``budget_batches``, and as a server batch of
  requests at several budgets would be run without it);
* ``one batch, by budget``: the first ``--batch`` lines alone through ``translate`` (a
  server's batch: its full-budget lines and the others as two batches) against
  ``one batch, mixed``, the same lines as one mixed batch;
* every line at the largest budget, at the smallest, and at ``--mid``: the references.

A share ``--full-share`` of the lines (default 12 of 32, as in the issue's analysis) asks
for the largest budget, the others for the smallest, shuffled (seed 1). ``linear mix`` is
what those lines would cost at their budgets' own single-budget rates. Each budget's lines
are also compared with the same lines translated at that budget alone.

    python benchmarks/mixed_budgets.py [--run DIR] [--src FILE] [--lines 192] [--rounds 5]

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, default=DEMO_MODEL, help="a CCT run or model directory")
    p.add_argument("--src", type=Path, help="source lines (default: the synthetic test set)")
    p.add_argument("--lines", type=int, default=192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--full-share", type=float, default=12 / 32)
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
    full, small, mid = trained[0], trained[-1], (args.mid, args.mid)
    lines = corpus(args.src, args.lines)
    n_full = round(args.full_share * len(lines))
    budgets = [full] * n_full + [small] * (len(lines) - n_full)
    random.Random(1).shuffle(budgets)
    batches = by_length_batches(t, lines, budgets, args.batch)

    def translate(budget: object) -> list[str]:
        return t.translate(lines, beam=1, batch_size=args.batch, budget=budget)

    first, first_budgets = lines[: args.batch], budgets[: args.batch]
    systems = {
        "by budget": lambda: translate(budgets),
        "mixed batches": lambda: [one_mixed_batch(t, b, bud) for b, bud in batches],
        "one batch, by budget": lambda: t.translate(first, beam=1, batch_size=args.batch,
                                                    budget=first_budgets),
        "one batch, mixed": lambda: one_mixed_batch(t, first, first_budgets),
        f"all {full}": lambda: translate(full),
        f"all {small}": lambda: translate(small),
        f"all {mid}": lambda: translate(mid),
    }
    sec = _lib.interleaved_seconds(systems, args.rounds)
    ms = {k: round(1000 * v / (len(first) if k.startswith("one batch") else len(lines)), 3)
          for k, v in sec.items()}  # per line

    alone = {b: translate(b) for b in (full, small)}
    mixed_out = translate(budgets)
    same = sum(mixed_out[i] == alone[b][i] for i, b in enumerate(budgets))
    linear = (n_full * ms[f"all {full}"] + (len(lines) - n_full) * ms[f"all {small}"]) / len(lines)
    out = {
        **_lib.provenance(), "machine": _lib.machine(processor=True),
        "run": str(args.run), "lines": len(lines), "batch": args.batch, "rounds": args.rounds,
        "lines_at_full": n_full, "full": list(full), "smallest": list(small), "mid": list(mid),
        "ms_per_line": ms, "linear_mix_ms_per_line": round(linear, 3),
        "ratios": {
            "by budget ÷ mixed batches (time)": round(ms["by budget"] / ms["mixed batches"],
                                                      3),
            "one batch: by budget ÷ mixed (time)": round(
                ms["one batch, by budget"] / ms["one batch, mixed"], 3),
            "by budget ÷ linear mix (time)": round(ms["by budget"] / linear, 3),
            f"by budget throughput ÷ all {mid}": round(ms[f"all {mid}"] / ms["by budget"], 3),
            f"mixed batches throughput ÷ all {mid}": round(
                ms[f"all {mid}"] / ms["mixed batches"], 3),
        },
        "lines_equal_to_their_budget_alone": f"{same} of {len(lines)}",
    }
    lines_md = _lib.md_head(
        "mixed_budgets: lines at several budgets, decoded by budget or as mixed batches",
        out["command"], f"Code: {(out['commit'] or 'no git checkout')[:12]}"
        f"{' (with uncommitted changes)' if out['dirty'] else ''} ({out['date']} UTC)",
        f"Machine: {out['machine']}",
        f"Run {args.run}; {len(lines)} lines, {n_full} at {full} and the others at {small} "
        f"(shuffled), greedy, batches of {args.batch}; median of {args.rounds} interleaved "
        "rounds after a warm-up.")
    lines_md += _lib.md_table(["system", "ms per line"], "lr",
                              [[k, v] for k, v in ms.items()] + [["linear mix", round(linear, 3)]])
    lines_md += ["", *_lib.md_table(["ratio", "value"], "lr", out["ratios"].items()), "",
                 f"Lines equal to their budget alone: {out['lines_equal_to_their_budget_alone']}."]
    _lib.write_results(args.results, args.stem, out, lines_md)
    print("\n".join(lines_md))


if __name__ == "__main__":
    main()
