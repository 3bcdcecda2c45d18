"""Benchmark `mixed_budgets`: a corpus whose lines carry different budgets, batched by budget
against batched by length alone (issue 30: mixed-budget throughput).

One CCT (default: the model `make demo` shows, shipped in the package), greedy decoding,
batches of ``--batch`` lines, in one process, the systems taking turns round by round:

* ``by budget``: ``Translator.translate(lines, budget=[one per line])`` over the whole
  corpus, which batches the lines by budget, then by length
  (:func:`dynaseq.tasks.translation.predictor.budget_order`);
* ``by length``: the same lines and budgets, sorted by length and handed over one batch at a
  time (each call one batch that mixes the budgets: what the decoder ran for every
  per-line corpus before ``budget_order``, and what a caller that forms its own batches gets);
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

    systems = {
        "by budget": lambda: translate(budgets),
        "by length": lambda: [x for b, bud in batches
                              for x in t.translate(b, beam=1, batch_size=args.batch,
                                                   budget=bud)],
        f"all {full}": lambda: translate(full),
        f"all {small}": lambda: translate(small),
        f"all {mid}": lambda: translate(mid),
    }
    sec = _lib.interleaved_seconds(systems, args.rounds)
    ms = {k: round(1000 * v / len(lines), 3) for k, v in sec.items()}  # per line

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
            "by budget ÷ by length (time)": round(ms["by budget"] / ms["by length"], 3),
            "by budget ÷ linear mix (time)": round(ms["by budget"] / linear, 3),
            f"by budget throughput ÷ all {mid}": round(ms[f"all {mid}"] / ms["by budget"], 3),
            f"by length throughput ÷ all {mid}": round(ms[f"all {mid}"] / ms["by length"], 3),
        },
        "lines_equal_to_their_budget_alone": f"{same} of {len(lines)}",
    }
    lines_md = _lib.md_head(
        "mixed_budgets: a corpus of per-line budgets, batched by budget or by length",
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
