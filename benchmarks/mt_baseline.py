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
import platform
import sys
import time
from pathlib import Path

import torch

from dynaseq.config import load_config
from dynaseq.data import read_lines
from dynaseq.infer.translator import Translator, bleu
from dynaseq.metrics.profile import profile_model
from dynaseq.train.loop import train

DATA = Path("../shared/data/multi30k")
RESULTS = Path("benchmarks/results")
# (size, target language, training minutes)
RUNS = [("small", "de", 60.0), ("small", "fr", 15.0), ("tiny", "de", 9.0), ("tiny", "fr", 6.0)]


def run_dir(size: str, tgt: str) -> Path:
    return Path(f"runs/bench/mt_baseline_{size}_en_{tgt}")


def config_for(size: str, tgt: str, minutes: float):
    return load_config(f"configs/multi30k_{size}.yaml", [
        f"run_dir={run_dir(size, tgt)}",
        f"data.train_tgt={DATA}/train.{tgt}.gz", f"data.valid_tgt={DATA}/val.{tgt}.gz",
        f"train.max_minutes={minutes}"])


def cmd_train(args: argparse.Namespace) -> None:
    for size, tgt, minutes in RUNS:
        if args.only and f"{size}_{tgt}" not in args.only:
            continue
        print(f"== training {size} en->{tgt} for {minutes} min", file=sys.stderr, flush=True)
        result = train(config_for(size, tgt, minutes * args.scale), progress=True)
        if result.stopped_by_signal is not None:  # checkpoint written; rerun to resume
            break


def learning_curve(path: Path) -> list[dict[str, float]]:
    curve, elapsed = [], 0.0
    for line in (path / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "train":
            elapsed = rec["elapsed_s"]
        if rec["event"] == "valid":
            curve.append({"step": rec["step"], "minutes": round(elapsed / 60, 2),
                          "valid_bleu": round(rec.get("bleu", float("nan")), 2),
                          "valid_loss": round(rec["loss"], 4)})
    return curve


def throughput(path: Path) -> dict[str, float]:
    recs = [json.loads(x) for x in (path / "log.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["event"] == "train"]
    stop = [r for r in recs if r["event"] == "stop"]
    tps = [r["tokens_per_s"] for r in train_recs if r["step"] > 1]
    return {"train_minutes": round(stop[-1]["elapsed_s"] / 60, 2) if stop else None,
            "steps": stop[-1]["step"] if stop else None,
            "tgt_tokens_per_s": round(sorted(tps)[len(tps) // 2], 1) if tps else None}


def cmd_report(args: argparse.Namespace) -> None:
    src = read_lines(DATA / "test_2016_flickr.en.gz")
    rows = []
    for size, tgt, _ in RUNS:
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
                   **throughput(path), signature=sig, learning_curve=learning_curve(path))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "learning_curve"}),
              file=sys.stderr, flush=True)
    out = {"benchmark": "mt_baseline", "command": "python benchmarks/mt_baseline.py train && "
           "python benchmarks/mt_baseline.py report",
           "machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "torch": torch.__version__, "threads": torch.get_num_threads()},
           "test_set": "multi30k test_2016_flickr (1000 sentences)", "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    speed = RESULTS / "speed_vs_torch.json"
    if speed.exists():  # measured by benchmarks/speed_vs_torch.py
        out["speed_vs_torch"] = json.loads(speed.read_text())["results"]
    (RESULTS / "mt_baseline.json").write_text(json.dumps(out, indent=1))
    write_markdown(out)
    plot(rows)


def write_markdown(out: dict) -> None:
    lines = ["# mt_baseline: dense Transformer on Multi30k", "",
             f"Command: `{out['command']}`  ", f"Machine: {out['machine']}", "",
             "| size | pair | params | MACs/tok (enc+dec) | train min | steps | tgt tok/s | "
             "BLEU beam4 | BLEU greedy | greedy ms (30 tok) | beam4 ms (30 tok) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["rows"]:
        lines.append(
            f"| {r['size']} | {r['pair']} | {r['params']:,} | "
            f"{r['macs_per_token']['total'] / 1e6:.2f}M | {r['train_minutes']} | {r['steps']} | "
            f"{r['tgt_tokens_per_s']} | {r['bleu_beam4']} | {r['bleu_beam1']} | "
            f"{r['latency_ms_30tok']['greedy']} | {r['latency_ms_30tok']['beam4']} |")
    lines += ["", "Learning curves (validation BLEU, greedy, full val set):", ""]
    for r in out["rows"]:
        pts = ", ".join(f"{p['minutes']}min:{p['valid_bleu']}" for p in r["learning_curve"])
        lines.append(f"- {r['size']} {r['pair']}: {pts}")
    if "speed_vs_torch" in out:
        lines += ["", "## Speed against torch.nn.Transformer (same dims, same run)", ""]
        lines += [f"- {k}: {v}" for k, v in out["speed_vs_torch"].items()]
    (RESULTS / "mt_baseline.md").write_text("\n".join(lines) + "\n")


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        c = r["learning_curve"]
        ax.plot([p["minutes"] for p in c], [p["valid_bleu"] for p in c], marker=".",
                label=f"{r['size']} {r['pair']}")
    ax.set_xlabel("training minutes (2 CPU cores)")
    ax.set_ylabel("validation BLEU (greedy)")
    ax.set_title("Multi30k learning curves")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "mt_baseline.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--only", nargs="*", help="e.g. small_de tiny_fr")
    t.add_argument("--scale", type=float, default=1.0, help="multiply every time budget")
    t.set_defaults(func=cmd_train)
    r = sub.add_parser("report")
    r.add_argument("--repeats", type=int, default=5)
    r.set_defaults(func=cmd_report)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
