"""Benchmark `cct_bert_plateau`: why CCT-BERT's masked-LM pre-training never leaves the
unigram plateau, measured as the early learning curves of CCT variants against the dense
encoder, all on the same 3000-update schedule cut by time.

On the H200 run of `cct_bert` (benchmarks/results/cct_bert_h200) every dense encoder left the
plateau (masked-token loss ~5.5, a unigram guess) by about 1000 updates, the CCT-BERT never
did in 3000 (5.41, accuracy 14%). Each probe here (``plateau`` in
benchmarks/variants/cct_bert.yaml: the paper's recipe, ``paper_section`` there, with
overrides of the gates' noise, the budget loss, the control symbol's scale, the output
LayerNorms or a gate warm-up) is pre-trained with
configs/wikitext2_mlm_small.yaml, ``train.max_steps=3000`` (the H200 run's cosine schedule),
cut at ``--minutes``; what is compared is the training masked-token loss (NLL, without the
budget term) at the same updates. A probe "leaves the plateau" at the first logged update
whose training NLL is below ``--below`` (5.75: the stalled runs stay at 5.98-6.1 through
update 1200 on this vocabulary; the dense encoder passes it at ~1000).

    python benchmarks/cct_bert_plateau.py [--only dense cct ...] [--minutes 16] [--report-only]

Runs: runs/bench/cct_bert_plateau/{probe}. Writes benchmarks/results/cct_bert_plateau.{json,md}.
Run from the repository root. A run already trained is not trained again.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _lib

PROBES: dict[str, dict] = _lib.registry("cct_bert", "plateau", ("label", "cct", "overrides"))
PAPER_SECTION: str = _lib.variants_file("cct_bert")["paper_section"]
RUNS = _lib.RUNS / "cct_bert_plateau"
STEPS = (600, 800, 1000, 1200, 1400, 1600, 2000, 3000)


def config(name: str, args: argparse.Namespace):
    from dynaseq.tasks.registry import load_config

    spec = PROBES[name]
    return load_config("configs/wikitext2_mlm_small.yaml", [
        f"run_dir={args.runs / name}", "train.max_steps=3000",
        f"train.max_minutes={args.minutes}", *([PAPER_SECTION] if spec["cct"] else []),
        *spec["overrides"]])


def curve(run: Path) -> dict:
    """Training NLL at each logged update, validation loss at each validation, and the
    budget loss (0 for a dense run) at each logged update, of ``run``."""
    log = _lib.read_log(run)
    train = [e for e in log if e["event"] == "train"]
    return {"nll": {e["step"]: round(e["nll"], 3) for e in train},
            "budget_loss": {e["step"]: round(e.get("budget_loss", 0.0), 3) for e in train},
            "valid": {e["step"]: round(e["loss"], 3) for e in log if e["event"] == "valid"},
            "steps": max((e["step"] for e in train), default=0),
            "minutes": round(max((e["elapsed_s"] for e in train), default=0.0) / 60, 1)}


def left_plateau(nll: dict[int, float], below: float) -> int | None:
    """The first logged update whose training NLL is below ``below`` (None: never)."""
    return next((s for s in sorted(nll) if s > 1 and nll[s] < below), None)


def markdown(out: dict) -> list[str]:
    lines = _lib.md_head(
        "cct_bert_plateau: CCT-BERT's masked-LM pre-training against the dense encoder, "
        "early updates", out["command"],
        f"Machine: {out['machine']}. Date {out['date']}.",
        "Every probe: configs/wikitext2_mlm_small.yaml, 3000-update cosine schedule, cut by "
        "time (its training minutes in the table; 1 or 2 threads); training masked-token NLL "
        f"at the update (the budget term excluded); 'leaves' = first logged update with NLL "
        f"< {out['below']}.")
    lines += [""] + _lib.md_table(
        ["probe", "what it keeps", *[f"NLL @{s}" for s in STEPS], "valid @1000",
         "leaves", "updates run", "minutes", "budget loss, last"],
        "ll" + "r" * (len(STEPS) + 5),
        [[name, r["label"], *[_at(r["nll"], s) for s in STEPS], _at(r["valid"], 1000),
          r["leaves"] or "no", r["steps"], r["minutes"], _at(r["budget_loss"], r["steps"])]
         for name, r in out["probes"].items()])
    return lines


def _at(values: dict, step: int) -> object:
    """``values[step]`` with int or (as JSON writes them) string keys; "" where absent."""
    return values.get(step, values.get(str(step), ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(PROBES), default=list(PROBES))
    p.add_argument("--minutes", type=float, default=16.0,
                   help="each probe's training time (it stops there, mid-schedule)")
    p.add_argument("--below", type=float, default=5.75,
                   help="training NLL under which a probe has left the plateau")
    p.add_argument("--report-only", action="store_true", help="train nothing")
    p.add_argument("--runs", type=Path, default=RUNS, help=f"where the runs live ({RUNS})")
    _lib.add_results_arg(p)
    args = p.parse_args()
    if not args.report_only:
        _lib.train_each(c for c in (config(n, args) for n in args.only)
                        if not _lib.done(Path(c.run_dir), c))
    probes = {}
    for name in args.only:
        run = args.runs / name
        if not (run / "log.jsonl").exists():
            print(f"-- {name}: no run at {run}, skipped", flush=True)
            continue
        c = curve(run)
        probes[name] = {"label": PROBES[name]["label"], **c,
                        "leaves": left_plateau(c["nll"], args.below)}
    out = {"benchmark": "cct_bert_plateau", "command": _lib.command(),
           "date": time.strftime("%Y-%m-%d"), "machine": _lib.machine(processor=True),
           "provenance": _lib.provenance(), "minutes": args.minutes, "below": args.below,
           "probes": probes}
    lines = markdown(out)
    _lib.write_results(args.results, "cct_bert_plateau", out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
