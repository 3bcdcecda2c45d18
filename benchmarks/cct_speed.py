"""Benchmark `cct_speed`: is a CCT budget a wall-clock saving? (2 CPU cores)

For the CCT of benchmarks/cct_quality.py at each budget (b, b), and for the dense `small`
model of the same size (benchmarks/mt_baseline.py), measures in one process, interleaved
round by round (these machines are noisy; the ratios come from the same rounds):

* teacher-forced scoring of Multi30k test_2016_flickr (1000 sentences, batches of
  ``data.max_tokens`` tokens);
* batched beam-4 decoding of the same sentences (batches of 64).

Times are reported as ratios to the CCT at budget 1 (median over rounds). Also measured:
the CCT with every gate forced off (``force_gates(model, 0.0)``: embeddings, output layer,
control nets and gating overhead only), scored only (decoding it would run to the length
limit): the floor under any budget. ``floor + b·(1 − floor)`` is then the best scoring time a
budget b can reach given the ungated parts (Amdahl).

    python benchmarks/cct_speed.py [--rounds 3] [--decode-lines 1000]

Writes benchmarks/results/cct_speed.{json,md}. Run from the repository root, alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dynaseq.adaptive.cct import force_gates
from dynaseq.data import read_lines
from dynaseq.infer.translator import Translator

DATA = Path("../shared/data/multi30k")
RESULTS = Path("benchmarks/results")
CCT_RUN = Path("runs/bench/cct_quality_cct")
DENSE_RUN = Path("runs/bench/mt_baseline_small_en_fr")
BUDGETS = [(1.0, 1.0), (0.5, 0.5), (0.33, 0.33), (0.2, 0.2)]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-lines", type=int, default=1000)
    args = p.parse_args()
    src = read_lines(DATA / "test_2016_flickr.en.gz")
    ref = read_lines(DATA / "test_2016_flickr.fr.gz")
    dec_src = src[: args.decode_lines]
    cct, dense = Translator.load(CCT_RUN), Translator.load(DENSE_RUN)
    # name -> (translator, budget, gates forced to)
    systems = {f"cct {b[0]:g},{b[1]:g}": (cct, b, None) for b in BUDGETS}
    systems["cct all gates off"] = (cct, BUDGETS[0], 0.0)
    systems["dense small"] = (dense, None, None)
    times = {name: {"score": [], "beam4": []} for name in systems}
    for r in range(args.rounds + 1):  # round 0 warms up and is not counted
        for name, (t, budget, forced) in systems.items():
            ctx = force_gates(t.model, forced) if forced is not None else contextlib.nullcontext()
            with ctx:
                s = timed(lambda t=t, budget=budget: t.score(src, ref, budget=budget))
                d = float("nan") if forced is not None else timed(
                    lambda t=t, budget=budget: t.translate(dec_src, beam=4, budget=budget))
            if r:
                times[name]["score"].append(s)
                times[name]["beam4"].append(d)
            print(f"round {r} {name}: score {s:.2f}s beam4 {d:.2f}s", file=sys.stderr,
                  flush=True)
    med = {n: {k: statistics.median(v) for k, v in m.items()} for n, m in times.items()}
    base = med["cct 1,1"]
    floor = med["cct all gates off"]["score"] / base["score"]
    rows = []
    for name in systems:
        row = {"system": name, "seconds": {k: round(v, 3) for k, v in med[name].items()},
               "ratio_to_cct_budget_1": {k: round(med[name][k] / base[k], 3) for k in base}}
        budget = systems[name][1]
        if name.startswith("cct ") and systems[name][2] is None:
            b = budget[0]
            row["budget"] = list(budget)
            row["target"] = {"score": round(b + 0.10, 3), "beam4": round(b + 0.25, 3)}
            row["amdahl_limit"] = {"score": round(floor + b * (1 - floor), 3)}
        rows.append(row)
    dense_vs_cct = {k: round(base[k] / med["dense small"][k], 3) for k in base}
    out = {"benchmark": "cct_speed",
           "command": f"python benchmarks/cct_speed.py --rounds {args.rounds} "
                      f"--decode-lines {args.decode_lines}",
           "machine": {"platform": platform.platform(), "torch": torch.__version__,
                       "threads": torch.get_num_threads()},
           "test_set": f"multi30k test_2016_flickr en->fr: {len(src)} sentences scored, "
                       f"{len(dec_src)} decoded (beam 4, batches of 64)",
           "rows": rows, "cct_budget_1_time_over_dense": dense_vs_cct,
           "floor_all_gates_off": {"score": round(floor, 3)}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cct_speed.json").write_text(json.dumps(out, indent=1))
    lines = ["# cct_speed: wall time at each budget, ratio to budget 1 (same run, interleaved)",
             "", f"Command: `{out['command']}`  ", f"Machine: {out['machine']}  ",
             f"Test set: {out['test_set']}", "",
             "| system | scoring s | scoring ratio | target | Amdahl limit | beam-4 s | "
             "beam-4 ratio | target |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tg, lim = r.get("target", {}), r.get("amdahl_limit", {})
        lines.append(
            f"| {r['system']} | {r['seconds']['score']} | {r['ratio_to_cct_budget_1']['score']}"
            f" | {tg.get('score', '')} | {lim.get('score', '')} | {r['seconds']['beam4']} | "
            f"{r['ratio_to_cct_budget_1']['beam4']} | {tg.get('beam4', '')} |")
    lines += ["", f"CCT at budget 1 takes {dense_vs_cct['score']}× the dense model's time "
              f"to score and {dense_vs_cct['beam4']}× to beam-decode (target ≤ 1.10×).",
              "", "Amdahl limit: floor + b·(1 − floor), where the floor is the CCT's time "
              "with every gate forced off (the ungated embeddings, output layer and control "
              "nets, plus gating overhead), scoring: "
              f"{out['floor_all_gates_off']['score']} of budget 1's time."]
    (RESULTS / "cct_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
