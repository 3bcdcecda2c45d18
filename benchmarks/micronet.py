"""Benchmark `micronet` (Yan et al. 2020, Tables 2, 4, 5, 6) on WikiText-2, word level.

Pipeline (Table 2): core LM (configs/wikitext2_tiny.yaml) -> + token-level distillation from
a larger teacher (top-30 labels on disk, λ annealed 0.5 -> 0.05) -> + gradual pruning to 40%
sparsity (sensitivity-guided per-matrix targets) -> + neural-cache search on validation ->
+ 9-bit quantization-aware training; each row with params, MicroNet storage, ops/token (tokens
fed one at a time), valid/test perplexity with and without the cache, and the MicroNet score.
Ablations: per-layer context C (Table 4), the cache size used in training (Table 5) and the
Hebbian softmax (Table 6). Every model trains the same number of updates as the core LM.
`control` fine-tunes the pruned model's source for the same 1600 updates as pruning + QAT,
without either (the fair baseline for their cost); `prune35`/`quant35` repeat them at 35%.
The `converged` lane repeats control / 35% pruning / QAT from `core5`, the core trained about
5 epochs (6800 updates) instead of one, with 1000, 3000 and 6000 pruning updates (+ up to 600
QAT updates), each against a dense control of 1600, 3600 and 6600 updates, and the 6000-update
pruning distilled from core5's own top-30 (`_kd`, with a control distilled the same way).

    python benchmarks/micronet.py train pipeline    # teacher, core, distilled, prune, ...
    python benchmarks/micronet.py train ablations   # context sweep, training cache, Hebbian
    python benchmarks/micronet.py train converged   # core5 and its control / prune / QAT
    python benchmarks/micronet.py report            # evaluate + profile, write results/

The two `train` lanes use one thread each, so they can run side by side on 2 cores. Writes
benchmarks/results/micronet.{json,md,png}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _lib
import _plot

RUNS = _lib.RUNS / "micronet"
CONFIG = "configs/wikitext2_tiny.yaml"
STEPS = ["train.max_minutes=1000"]  # stop on the config's max_steps, whatever the load
BITS = 9  # the QAT runs' bit width (their commands in variants/micronet.yaml say --bits 9)
# top-k directory -> the run that writes it
TOPK_TEACHERS = {Path(d): run for d, run in _lib.registry("micronet", "topk").items()}
# name -> {"table", "system", "overrides" of CONFIG}
TRAINED: dict[str, dict] = _lib.registry("micronet", "trained", ("table", "system", "overrides"))
# name -> {"table", "system", "source" (None: the one `train --prune-from` names), "command"
# and its arguments}
DERIVED: dict[str, dict] = _lib.registry("micronet", "derived",
                                         ("table", "system", "source", "command"))
LANES: dict[str, list[str]] = _lib.variants_file("micronet")["lanes"]


def dynaseq(*args: str, capture: bool = False) -> str:
    """Run the ``dynaseq`` command on one thread; its stdout when ``capture``."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "dynaseq", *args]
    print("==", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, check=True, text=True,
                          stdout=subprocess.PIPE if capture else None)
    return proc.stdout if capture else ""


def done(name: str) -> bool:
    """A trained run reached its last update; a derived one exists (those commands write a
    temporary directory and rename it at the end)."""
    run = RUNS / name
    if name in TRAINED:
        return _lib.finished(run)
    return (run / "config.yaml").exists()


def ensure_topk(args: list[str]) -> None:
    """Write each teacher top-30 that ``args`` name and that does not exist yet."""
    for topk, teacher in TOPK_TEACHERS.items():
        if any(str(topk) in a for a in args) and not (topk / "meta.json").exists():
            dynaseq("distill-data", str(RUNS / teacher), "--out", str(topk), "--k", "30")


def build(name: str, prune_from: str = "distill") -> None:
    """Train or derive run ``name`` unless it is done; its wall time goes to NAME.seconds."""
    run = RUNS / name
    t0 = time.perf_counter()
    if done(name):
        return
    if name in TRAINED:
        ensure_topk(TRAINED[name]["overrides"])
        dynaseq("train", CONFIG, f"run_dir={run}", *STEPS, *TRAINED[name]["overrides"])
    else:
        source, cmd = DERIVED[name]["source"], DERIVED[name]["command"]
        ensure_topk(cmd)
        dynaseq(cmd[0], str(RUNS / (source or prune_from)), "--out", str(run), *cmd[1:])
    (RUNS / f"{name}.seconds").write_text(f"{time.perf_counter() - t0:.1f}\n")


def cmd_train(args: argparse.Namespace) -> None:
    RUNS.mkdir(parents=True, exist_ok=True)
    for name in LANES[args.lane]:
        if not args.only or name in args.only:
            build(name, args.prune_from)


def pruned_from(name: str) -> str | None:
    """The run a pruned model started from (``train --prune-from``), from its report."""
    report = RUNS / name / "prune_report.json"
    return Path(json.loads(report.read_text())["source_run"]).name if report.exists() else None


def measure(name: str) -> dict:
    """One result row: run ``name``'s perplexities (valid, test; with and without the cache)
    and its profile (params, storage, ops/token, score, generation speed)."""
    run = RUNS / name
    row: dict = {"name": name}
    for split in ("valid", "test"):
        r = json.loads(dynaseq("evaluate", str(run), "--split", split, "--json", capture=True))
        row[f"{split}_ppl"] = round(r["ppl"], 2)
        row[f"{split}_ppl_cache"] = round(r["ppl_cache"], 2)
        row["cache"] = r["cache"]
    prof = json.loads(dynaseq("profile", str(run), "--json", capture=True))
    mn = prof["micronet"]
    row.update(params=prof["params"], storage=round(mn["params_storage"]),
               ops_per_token=mn["ops_per_token"], score=round(mn["score"], 5),
               ms_per_token=prof["ms_per_token"], gen_ratio=round(prof["ratio_last_first"], 3))
    secs = RUNS / f"{name}.seconds"
    row["build_minutes"] = round(float(secs.read_text()) / 60, 2) if secs.exists() else None
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def cmd_report(args: argparse.Namespace) -> None:
    # rows of the committed results, by name, to carry over for runs not rebuilt here
    rows, earlier = [], _lib.committed_rows(args.results / "micronet.json", "name",
                                            "measured_on")
    today = time.strftime("%Y-%m-%d")
    made_by = _lib.provenance()  # recorded in every row measured now
    for name in [*TRAINED, *DERIVED]:
        if done(name) and (not args.only or name in args.only):
            spec = TRAINED.get(name) or DERIVED[name]
            row = {"table": spec["table"], "system": spec["system"], "measured": today,
                   **measure(name), "made_by": made_by}
            if name in ("prune", "prune35") or name.startswith("prune35_"):
                row["pruned_from"] = pruned_from(name)
                row["system"] += f" (from {row['pruned_from']})"
            rows.append(row)
        elif name in earlier and args.carry:
            print(f"-- {name}: not measured now, row carried from the committed results",
                  file=sys.stderr)
            rows.append(earlier[name])
        else:
            print(f"-- {name}: not built, skipped", file=sys.stderr)
    machine = _lib.machine(torch_threads=False, cpus=os.cpu_count(),
                           threads=os.environ.get("OMP_NUM_THREADS", "1"))
    recipe = ("python benchmarks/micronet.py train pipeline & python benchmarks/micronet.py "
              "train ablations; python benchmarks/micronet.py report")
    out = {"benchmark": "micronet", "command": _lib.command(), "recipe": recipe,
           "machine": machine, "measured_on": today,
           "data": "WikiText-2 word level (33,278 types); valid 217,646 / test 245,569 tokens",
           "rows": rows, "targets": targets(rows)}
    lines = markdown(out)
    _lib.write_results(args.results, "micronet", out, lines)
    print("\n".join(lines))
    plot(rows, args.results / "micronet.png")


def cmd_made_by_from_git(args: argparse.Namespace) -> None:
    """Rows measured before rows recorded ``made_by`` get one reconstructed from git history
    (:func:`_lib.made_by_from_git`); micronet.json and .md are written again, nothing
    re-measured."""
    out = _lib.made_by_from_git(args.results / "micronet.json", "name",
                                "benchmarks/micronet.py",
                                lambda r: ["report", "--only", r["name"]])
    _lib.write_results(args.results, "micronet", out, markdown(out))


def targets(rows: list[dict]) -> dict:
    """The issue's three targets, from the rows that measure them."""
    by = {r["name"]: r for r in rows}
    out = {}
    for name in ("core_cache400", "core_cache"):
        if name in by and "core" in by:
            c, cc = by["core"], by[name]
            out[f"cache ({name}, n_cache {cc['cache']['n_cache']})"] = {
                "ppl": c["test_ppl"], "ppl_cache": cc["test_ppl_cache"],
                "relative_gain": round(1 - cc["test_ppl_cache"] / c["test_ppl"], 4),
                "ops_ratio": round(cc["ops_per_token"]["total"] / c["ops_per_token"]["total"],
                                   4),
                "target": "gain >= 0.10 at ops_ratio < 1.05"}
    if "quant" in by and "cache" in by:
        # one definition per key: ppl_* without the cache, ppl_*_cache with it, and every
        # relative cost between two perplexities without the cache
        quantized = by["quant"]["test_ppl"]
        source = by["prune"].get("pruned_from", "distill") if "prune" in by else "distill"
        unpruned = by[source]["test_ppl"] if source in by else None
        out["prune_quant"] = {
            "pruned_from": source, "ppl_before_prune": unpruned, "ppl_quantized": quantized,
            "relative_cost_of_prune_and_qat":
                round(quantized / unpruned - 1, 4) if unpruned else None,
            "ppl_pruned_cache": by["cache"]["test_ppl_cache"],
            "ppl_quantized_cache": by["quant"]["test_ppl_cache"],
            "target": f">= 35% sparsity + {BITS}-bit QAT cost <= 3% ppl"}
        if "control" in by:  # the same number of fine-tuning updates, dense and in float
            control = by["control"]["test_ppl"]
            out["prune_quant"].update(ppl_control=control, relative_cost_vs_control=round(
                by["quant"]["test_ppl"] / control - 1, 4))
            if "quant35" in by:
                out["prune_quant"]["at_35_percent"] = {
                    "ppl_quantized": by["quant35"]["test_ppl"], "relative_cost_vs_control":
                        round(by["quant35"]["test_ppl"] / control - 1, 4)}
    for quant, control_name, key in (("quant35_5", "control5", "prune_quant_converged"),
                                     ("quant35_5_long", "control5_long",
                                      "prune_quant_converged_long"),
                                     ("quant35_5_xl", "control5_xl",
                                      "prune_quant_converged_xl"),
                                     ("quant35_5_kd", "control5_xl",
                                      "prune_quant_converged_kd"),
                                     ("quant35_5_kd", "control5_kd",
                                      "prune_quant_converged_kd_vs_kd_control")):
        if all(n in by for n in ("core5", control_name, quant)):
            control = by[control_name]["test_ppl"]
            out[key] = {
                "ppl_core5": by["core5"]["test_ppl"], "ppl_control": control,
                "ppl_quantized": by[quant]["test_ppl"],
                "relative_cost_vs_control": round(by[quant]["test_ppl"] / control - 1, 4),
                "relative_cost_vs_core5": round(
                    by[quant]["test_ppl"] / by["core5"]["test_ppl"] - 1, 4),
                "target": f">= 35% sparsity + {BITS}-bit QAT cost <= 3% ppl"}
    if "core" in by:
        out["generation"] = {"ms_per_token": by["core"]["ms_per_token"],
                             "ratio": by["core"]["gen_ratio"], "target": "<= 1.1"}
    return out


def markdown(out: dict) -> list[str]:
    """The lines of micronet.md for the results ``out``."""
    lines = _lib.md_head("micronet: the MicroNet pipeline on WikiText-2 (word level)",
                         out["command"], *_lib.recipe_lines(out),
                         f"Machine: {out['machine']}", f"Data: {out['data']}")
    lines += ["Storage: parameters weighted by bit width / 32, sparse matrices by the challenge "
              "rules. Ops/token: multiplies + adds with tokens fed one at a time (full softmax, "
              "cache included when the run has one). Score = storage / 159M + ops / 318M.", ""]
    lines += _lib.md_table(
        ["table", "system", "params", "storage", "ops/token", "valid ppl", "valid ppl cache",
         "test ppl", "test ppl cache", "score", "minutes", "measured"], "llrrrrrrrrrl",
        ([r["table"], r["system"], f"{r['params']:,}", f"{r['storage']:,}",
          f"{r['ops_per_token']['total'] / 1e6:.3f}M", r["valid_ppl"], r["valid_ppl_cache"],
          r["test_ppl"], r["test_ppl_cache"], r["score"], r["build_minutes"],
          r.get("measured") or "earlier"] for r in out["rows"]))
    return lines + ["", "## Targets", "", "Test perplexities: `ppl_*` without the neural cache, "
                    "`ppl_*_cache` with it; every `relative_cost*` compares two perplexities "
                    "without the cache.", "", "```json", json.dumps(out["targets"], indent=1),
                    "```", "", *_lib.made_by_lines(out["rows"], "name")]


def plot(rows: list[dict], path: Path) -> None:
    """Test perplexity (with the cache) against the MicroNet score, one point per run."""
    _plot.labelled_scatter([(r["name"], r["score"], r["test_ppl_cache"]) for r in rows
                            if r["name"] != "teacher"],
                           "MicroNet score (lower is better)", "test perplexity with the cache",
                           "micronet: WikiText-2", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("lane", choices=list(LANES))
    t.add_argument("--only", nargs="*", choices=[*TRAINED, *DERIVED])
    t.add_argument("--prune-from", choices=["distill", "core"], default="distill",
                   help="the run `prune` starts from (core: skip the teacher and distillation)")
    t.set_defaults(func=cmd_train)
    r = sub.add_parser("report")
    r.add_argument("--no-carry", dest="carry", action="store_false",
                   help="leave out runs not built here instead of carrying their committed rows")
    r.add_argument("--only", nargs="*", choices=[*TRAINED, *DERIVED],
                   help="measure only these runs; the others' committed rows are carried")
    _lib.add_results_arg(r)
    r.set_defaults(func=cmd_report)
    _lib.add_made_by_command(sub, cmd_made_by_from_git)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
