"""Benchmark `mt_baseline`: dense Transformers on Multi30k (train -> test_2016_flickr).

Trains `tiny` and `small` for en->de and en->fr within per-run CPU-time budgets, then reports
BLEU (sacreBLEU, beam 4 and greedy), params, MACs/token, training wall time, tokens/s and
the greedy / beam-4 latency of a 30-token sentence; the learning curve (validation BLEU by
step and minute) goes into the JSON and a PNG plot.

    python benchmarks/mt_baseline.py train            # the four runs (about 90 minutes on 2 cores)
    python benchmarks/mt_baseline.py report           # evaluate the runs, write results/

Writes benchmarks/results/mt_baseline.{json,md,png}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dynaseq.data import read_lines
from dynaseq.metrics.profile import profile_model
from dynaseq.tasks.registry import load_config
from dynaseq.tasks.translation.predictor import Translator, bleu

import _lib
import _plot

DATA = _lib.MULTI30K
RUNS = _lib.registry("mt_baseline", "runs", ("size", "tgt", "minutes"))


def run_dir(size: str, tgt: str) -> Path:
    """Where the ``size`` model for en->``tgt`` trains."""
    return _lib.RUNS / f"mt_baseline_{size}_en_{tgt}"


def config_for(size: str, tgt: str, minutes: float):
    """The config of one run: ``configs/multi30k_SIZE.yaml`` on en->``tgt``."""
    return load_config(f"configs/multi30k_{size}.yaml", [
        f"run_dir={run_dir(size, tgt)}",
        f"data.train_tgt={DATA}/train.{tgt}.gz", f"data.valid_tgt={DATA}/val.{tgt}.gz",
        f"train.max_minutes={minutes}"])


def cmd_train(args: argparse.Namespace) -> None:
    _lib.train_each(config_for(r["size"], r["tgt"], r["minutes"] * args.scale)
                    for name, r in RUNS.items() if not args.only or name in args.only)


def cmd_report(args: argparse.Namespace) -> None:
    src = read_lines(DATA / "test_2016_flickr.en.gz")
    rows = []
    for r in RUNS.values():
        size, tgt = r["size"], r["tgt"]
        path = run_dir(size, tgt)
        if not (path / "config.yaml").exists():
            continue
        ref = read_lines(DATA / f"test_2016_flickr.{tgt}.gz")
        t = Translator.load(path)
        row = {"size": size, "pair": f"en-{tgt}", "checkpoint": t.checkpoint.name}
        for beam in (4, 1):
            t0 = time.perf_counter()
            score, sig = bleu(t.translate(src, beam=beam), ref)
            row[f"bleu_beam{beam}"] = round(score, 2)
            row[f"test_decode_s_beam{beam}"] = round(time.perf_counter() - t0, 1)
        prof = profile_model(t.model, 30, 30, repeats=args.repeats)
        row.update(params=prof["params"],
                   macs_per_token={k: round(v) for k, v in prof["macs_per_token"].items()},
                   latency_ms_30tok={k: round(v, 1) for k, v in prof["latency_ms"].items()
                                     if k != "batch"},
                   **_lib.throughput(path), signature=sig,
                   learning_curve=_lib.learning_curve(path))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "learning_curve"}),
              file=sys.stderr, flush=True)
    out = {"benchmark": "mt_baseline", "command": "python benchmarks/mt_baseline.py train && "
           "python benchmarks/mt_baseline.py report",
           "machine": _lib.machine(processor=True),
           "test_set": "multi30k test_2016_flickr (1000 sentences)", "rows": rows}
    speed = args.results / "speed_vs_torch.json"
    if speed.exists():  # measured by benchmarks/speed_vs_torch.py
        out["speed_vs_torch"] = json.loads(speed.read_text())["results"]
    _lib.write_results(args.results, "mt_baseline", out, markdown(out))
    plot(rows, args.results / "mt_baseline.png")


def markdown(out: dict) -> list[str]:
    """The lines of mt_baseline.md for the results ``out``."""
    lines = _lib.md_head("mt_baseline: dense Transformer on Multi30k", out["command"],
                         f"Machine: {out['machine']}")
    lines += _lib.md_table(
        ["size", "pair", "params", "MACs/tok (enc+dec)", "train min", "steps", "tgt tok/s",
         "BLEU beam4", "BLEU greedy", "greedy ms (30 tok)", "beam4 ms (30 tok)"], "llrrrrrrrrr",
        ([r["size"], r["pair"], f"{r['params']:,}", f"{r['macs_per_token']['total'] / 1e6:.2f}M",
          r["train_minutes"], r["steps"], r["tgt_tokens_per_s"], r["bleu_beam4"],
          r["bleu_beam1"], r["latency_ms_30tok"]["greedy"], r["latency_ms_30tok"]["beam4"]]
         for r in out["rows"]))
    lines += ["", "Learning curves (validation BLEU, greedy, full val set):", ""]
    for r in out["rows"]:
        pts = ", ".join(f"{p['minutes']}min:{p['valid_bleu']}" for p in r["learning_curve"])
        lines.append(f"- {r['size']} {r['pair']}: {pts}")
    if "speed_vs_torch" in out:
        lines += ["", "## Speed against torch.nn.Transformer (same dims, same run)", ""]
        lines += [f"- {k}: {v}" for k, v in out["speed_vs_torch"].items()]
    return lines


def plot(rows: list[dict], path: Path) -> None:
    """Validation BLEU by training minute, one line per run."""
    fig, ax = _plot.pyplot().subplots(figsize=(6, 4))
    for r in rows:
        c = r["learning_curve"]
        ax.plot([p["minutes"] for p in c], [p["valid_bleu"] for p in c], marker=".",
                label=f"{r['size']} {r['pair']}")
    ax.set_xlabel("training minutes (2 CPU cores)")
    ax.set_ylabel("validation BLEU (greedy)")
    ax.set_title("Multi30k learning curves")
    ax.grid(alpha=0.3)
    ax.legend()
    _plot.save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--only", nargs="*", choices=list(RUNS), help="e.g. small_de tiny_fr")
    t.add_argument("--scale", type=float, default=1.0, help="multiply every time budget")
    t.set_defaults(func=cmd_train)
    r = sub.add_parser("report")
    r.add_argument("--repeats", type=int, default=5)
    _lib.add_results_arg(r)
    r.set_defaults(func=cmd_report)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
