"""Benchmark `layouts`: the lean step's products in the layouts timed on this machine
(:mod:`dynaseq.nn.layouts`) against the fixed rule they replaced (issue 28: batch-1 decoding
near the limit, on whatever CPU a user has).

The rule before was tuned on an AMD EPYC: one row of a wide projection (and the output layer
at any row count but 2 to 8) against an ``(in, out)`` copy, 2 to 8 rows with the weight on the
left, narrow projections ``F.linear``, and the CCT feed-forward pieces' second layers with
their weights on the left up to 8 rows. Here both run in one process: two lean decoders of
the same model, one left to time its layouts, the other with the rule written into its
choices for every size class before it runs (:func:`pin_rule`), taking turns in every round.
Fixed-length 30 -> 30 decoding of untrained models (:func:`decode_latency_ms`), built as
``batch1_latency`` builds them (``_lib.dense_like``, ``_lib.untrained_cct``): the dense
model of the DMB/MoE configs' shape at ``small`` and ``base`` sizes and the CCT of
``configs/multi30k_cct_small.yaml`` with every gate open (+inf) and gates mixed (offset 0).
Reported: ms per decode of each, measured ÷ rule (the median of the rounds' ratios), and
the layouts the measured decoder chose (count per layout over its products and classes).

    python benchmarks/layouts.py [--rounds 5] [--threads 2]

Writes benchmarks/results/layouts.{json,md}. Run from the repository root, alone.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
from collections.abc import Iterator

import torch

from dynaseq.metrics.latency import decode_latency_ms
from dynaseq.models.lean import LeanDecoder
from dynaseq.nn.lean_step import StepLinear
from dynaseq.techniques.cct.gating import BudgetControl
from dynaseq.techniques.cct.lean_step import GatedFeedForward

import _lib

VOCAB = 8000

CELLS = [(1, 1), (1, 4), (8, 1), (32, 1), (32, 4)]  # (batch, beam)
CLASSES = [1 << k for k in range(10)]  # rows classes up to 512 (beam 4 x 32 = 128)
OLD_LEFT_ROWS = 8


def _parts(obj: object, seen: set[int]) -> Iterator[object]:
    """Every object reachable from ``obj`` through attributes, lists, tuples and dicts,
    among dynaseq's own (tensors and modules are not entered)."""
    if id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif type(obj).__module__.startswith("dynaseq") and hasattr(obj, "__dict__"):
        yield obj
        items = list(vars(obj).values())
    else:
        return
    for item in items:
        yield from _parts(item, seen)


def products(lean: LeanDecoder) -> tuple[list[StepLinear], list[GatedFeedForward]]:
    """The lean decoder's projections and CCT feed-forward parts (its encoder pass's too)."""
    found = list(_parts(lean, set()))
    return ([p for p in found if isinstance(p, StepLinear)],
            [p for p in found if isinstance(p, GatedFeedForward)])


def pin_rule(lean: LeanDecoder) -> None:
    """Write the fixed rule of before into every size class's choice of ``lean``'s products
    (at this process's threads), so that no trial runs."""
    threads = torch.get_num_threads()
    linears, ffns = products(lean)
    for fn in linears:
        out, n_in = fn.weight.shape
        output = fn is lean.output
        for c in CLASSES:
            if out >= n_in and 2 <= c <= OLD_LEFT_ROWS:
                choice = 2  # the weight on the left
            elif output or (c == 1 and out >= 2 * n_in):
                choice = 1  # the (in, out) copy
            else:
                choice = 0  # F.linear
            fn.layouts.chosen[(c, threads)] = choice
    for ffn in ffns:
        for c in CLASSES:
            for span in range(1, ffn.m + 1):
                ffn.second_layouts.chosen[((c, threads), span)] = int(c <= OLD_LEFT_ROWS)


def chosen(lean: LeanDecoder) -> dict[str, int]:
    """How often each layout was chosen over the measured decoder's products and classes."""
    linears, ffns = products(lean)
    counts: collections.Counter[str] = collections.Counter()
    for fn in linears:
        counts.update(StepLinear.LAYOUTS[i] for i in fn.layouts.chosen.values())
    for ffn in ffns:
        counts.update(("ffn2 stack", "ffn2 left")[i] for i in ffn.second_layouts.chosen.values())
    return dict(sorted(counts.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    _lib.add_results_arg(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    models = {"dense small": (_lib.dense_like("small", VOCAB), None),
              "dense base": (_lib.dense_like("base", VOCAB), None)}
    c = _lib.untrained_cct(VOCAB)
    for name, off in (("cct small, gates open (+inf)", math.inf),
                      ("cct small, gates mixed (offset 0)", 0.0)):
        models[name] = (c, BudgetControl(0, {"encoder": off, "decoder": off}))
    rows, layouts = [], {}
    for name, (model, control) in models.items():
        for batch, beam in CELLS:
            measured, rule = LeanDecoder.prepare(model), LeanDecoder.prepare(model)
            pin_rule(rule)
            systems = {"measured": measured, "rule": rule}
            times: dict[str, list[float]] = {k: [] for k in systems}
            for _ in range(args.rounds):
                for k, lean in systems.items():
                    times[k].append(decode_latency_ms(model, 30, 30, beam=beam, batch=batch,
                                                      repeats=1, control=control, lean=lean))
            ratios = [a / b for a, b in zip(times["measured"], times["rule"], strict=True)]
            rows.append({"model": name, "batch": batch, "beam": beam,
                         **{f"{k} ms": round(statistics.median(v), 2)
                            for k, v in times.items()},
                         "measured / rule": round(statistics.median(ratios), 3),
                         "range": [round(min(ratios), 3), round(max(ratios), 3)]})
            layouts[f"{name}, batch {batch}, beam {beam}"] = chosen(measured)
            print(rows[-1], flush=True)
    out = {"benchmark": "layouts", **_lib.provenance(),
           "machine": _lib.machine(processor=True), "rounds": args.rounds, "rows": rows,
           "chosen": layouts}
    md = _lib.md_head(
        "layouts: the lean step's products in layouts timed here against the fixed rule",
        out["command"], f"Machine: {out['machine']}",
        f"Untrained models, vocabulary {VOCAB}, fixed 30 -> 30 tokens, {args.rounds} "
        "interleaved rounds of one decode each in one process; measured / rule: the median "
        "of the rounds' ratios (range beside it).")
    md += _lib.md_table(
        ["model", "batch", "beam", "measured ms", "rule ms", "measured / rule", "range"],
        "lrrrrrl",
        [[r["model"], r["batch"], r["beam"], r["measured ms"], r["rule ms"],
          r["measured / rule"], f"{r['range'][0]}-{r['range'][1]}"] for r in rows])
    md += ["", "Layouts the measured decoders chose (products x size classes):", ""]
    md += [f"- {k}: {v}" for k, v in layouts.items()]
    _lib.write_results(args.results, "layouts", out, md)


if __name__ == "__main__":
    main()
