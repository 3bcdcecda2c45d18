"""Benchmark `cct_quality` (CCT paper fig. 4-5): one CCT against MAC-matched dense models.

One CCT with the capacity of `small` (3+3 layers, d=256, FFN 1024 in M=4 gated pieces),
trained on Multi30k en->fr with the budgets of configs/multi30k_cct_small.yaml, is evaluated
at (b, b) for b in {1, .5, .33, .2} and at the decoder-only budgets (1, b). Dense baselines
are the `small` model shrunk in depth or in FFN width to about the MACs the CCT realizes at
.5 and .33 (fig. 4), and with the full encoder and a shrunk decoder (fig. 5). The dense
`small` model itself (same data, updates, batch and seed as the CCT) is the "dense model of
the CCT's size".

    python benchmarks/cct_quality.py train cct          # the CCT (60 min, 1 thread)
    python benchmarks/cct_quality.py train baselines    # the dense baselines (1 thread)
    python benchmarks/cct_quality.py report             # evaluate, write results/
    python benchmarks/cct_quality.py train cct --variants cct_ctl cct_nonorm  # VARIANTS
    python benchmarks/cct_quality.py report --only cct_ctl cct_nonorm
    python benchmarks/cct_quality.py train baselines --only small_long width_f128_long depth_1_1_long
    python benchmarks/cct_quality.py train baselines --only small_x3 width_f128_x3 depth_1_1_x3

The two `train` lanes use one thread each, so they can run side by side on 2 cores.
Writes benchmarks/results/cct_quality.{json,md,png} (BLEU vs realized MACs/token) and
cct_adherence.{json,md} (realized fraction vs each trained budget). Run from the
repository root.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dynaseq.data import read_lines
from dynaseq.metrics import count_macs
from dynaseq.tasks.registry import load_config
from dynaseq.tasks.translation.predictor import Translator

import _lib
import _plot

DATA = _lib.MULTI30K
run_dir = _lib.cct_quality_run
CCT_RUN = run_dir("cct")
# the longer runs, name suffix -> updates (variants/cct_quality.yaml)
LONG_STEPS: dict[str, int] = _lib.variants_file("cct_quality")["long_steps"]
# name -> {"label", "overrides" of the CCT's config}: the YAML's variants, then cct_long,
# cct_x3 ... (the configured CCT trained LONG_STEPS updates)
VARIANTS: dict[str, dict] = {
    **_lib.registry("cct_quality", "variants", ("label", "overrides")),
    **{f"cct_{tag}": {"label": f"CCT, {steps} updates",
                      "overrides": [f"train.max_steps={steps}", f"train.max_minutes={steps // 10}"]}
       for tag, steps in LONG_STEPS.items()}}
VARIANT_BUDGETS = [(1.0, 1.0), (0.5, 0.5), (0.33, 0.33), (0.2, 0.2)]
CCT_MINUTES = 90.0  # a time cap only: max_steps (1400) ends the run first
# Every dense model gets the CCT's updates (configs/multi30k_cct_small.yaml train.max_steps),
# with the same data, batch size, schedule and seed: equal training, not equal minutes.
DENSE_STEPS = 1400
LONG_DENSE: list[str] = _lib.variants_file("cct_quality")["long_dense"]
# name -> {"label", "overrides" of configs/multi30k_small.yaml}, in training order
SHORT_BASELINES: dict[str, dict] = _lib.registry("cct_quality", "baselines",
                                                 ("label", "overrides"))
LONG_BASELINES: dict[str, dict] = {
    f"{n}_{tag}": {"label": f"{SHORT_BASELINES[n]['label']}, {LONG_STEPS[tag]} updates",
                   "overrides": [*SHORT_BASELINES[n]["overrides"],
                                 f"train.max_steps={LONG_STEPS[tag]}"]}
    for tag in _lib.variants_file("cct_quality")["dense_long_tags"] for n in LONG_DENSE}
BASELINES = {**SHORT_BASELINES, **LONG_BASELINES}
CCT_BUDGETS = [(1.0, 1.0), (0.5, 0.5), (0.33, 0.33), (0.2, 0.2), (1.0, 0.5), (1.0, 0.33),
               (1.0, 0.2)]
UNTRAINED = [(0.4, 0.4)]  # run by calibrating the nearest trained budget's gates


def cct_config(variant: str | None = None):
    """The CCT's config, or that of one of :data:`VARIANTS`."""
    run, overrides = (CCT_RUN, []) if variant is None else (run_dir(variant),
                                                             VARIANTS[variant]["overrides"])
    return load_config("configs/multi30k_cct_small.yaml",
                       [f"run_dir={run}", f"train.max_minutes={CCT_MINUTES}", *overrides])


def baseline_config(name: str):
    """The config of dense baseline ``name`` (one of :data:`BASELINES`)."""
    return load_config("configs/multi30k_small.yaml", [
        f"run_dir={run_dir(name)}",
        f"data.train_tgt={DATA}/train.fr.gz", f"data.valid_tgt={DATA}/val.fr.gz",
        f"train.max_steps={DENSE_STEPS}", "train.valid_bleu_lines=300",
        *BASELINES[name]["overrides"]])


def cmd_train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.lane == "cct":
        configs = [cct_config(v) for v in args.variants] if args.variants else [cct_config()]
    else:
        configs = [baseline_config(n) for n in BASELINES
                   if (n in args.only if args.only else n not in LONG_BASELINES)]
    _lib.train_each(configs)


def layer_macs_per_token(t: Translator, src: list[str], ref: list[str]) -> dict[str, float]:
    """A dense model's attention + FFN MACs (embeddings and output layer excluded, like the
    CCT's realized MACs) per source / target token over the test pairs, teacher forced."""
    enc = dec = n_src = n_tgt = 0
    for s_ids, r_ids in zip(t.tokenizer.encode(src), t.tokenizer.encode(ref), strict=True):
        s_len, t_len = len(s_ids) + 1, len(r_ids) + 1  # + eos / + bos
        rep = count_macs(t.model, s_len, t_len)
        enc += rep.encoder_total
        dec += rep.decoder_total - rep.decoder["output_proj"]
        n_src, n_tgt = n_src + s_len, n_tgt + t_len
    return {"encoder": enc / n_src, "decoder": dec / n_tgt, "total": enc / n_src + dec / n_tgt}


def evaluate(t: Translator, src: list[str], ref: list[str], budget=None) -> dict:
    r = t.evaluate(src, ref, beam=4, budget=budget)
    row = {"bleu_beam4": round(r["bleu"], 2), "loss": round(r["loss"], 4),
           "params": sum(p.numel() for p in t.model.parameters()),
           **_lib.throughput(Path(t.config.run_dir))}
    if budget is None:
        row["layer_macs_per_token"] = {k: round(v) for k, v in
                                       layer_macs_per_token(t, src, ref).items()}
    else:
        per_tok = r["realized_macs_per_token"]
        row["budget"] = list(budget)
        row["gate_offsets"] = r["gate_offsets"]
        row["realized_fraction"] = {k: round(v, 3) for k, v in r["realized_fraction"].items()}
        row["layer_macs_per_token"] = {"encoder": round(per_tok["encoder"]),
                                       "decoder": round(per_tok["decoder"]),
                                       "total": round(sum(per_tok.values()))}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def calibrated_cct(run: Path, lines: int, budgets=None) -> Translator:
    """The CCT of ``run`` with ``budgets`` (default: every trained budget and
    :data:`UNTRAINED`) calibrated on the first ``lines`` validation pairs (saved as the run's
    calibration.json)."""
    t = Translator.load(run)
    t.calibrations = []
    t.calibrate(read_lines(DATA / "val.en.gz")[:lines], read_lines(DATA / "val.fr.gz")[:lines],
                budgets=budgets or [*t.config.model.cct.controls, *UNTRAINED])
    t.save_calibration(run, {"src": str(DATA / "val.en.gz"), "lines": lines})
    return t


def cmd_report(args: argparse.Namespace) -> None:
    src = read_lines(DATA / "test_2016_flickr.en.gz")
    ref = read_lines(DATA / "test_2016_flickr.fr.gz")
    today = time.strftime("%Y-%m-%d")
    # rows of the committed results by system, with the date each was measured
    carried = _lib.committed_rows(args.results / "cct_quality.json", "system", "date",
                                  "2026-11-22")

    def wanted(name: str) -> bool:
        return not args.only or name in args.only

    rows = []
    if wanted("cct"):
        raw = Translator.load(CCT_RUN)
        raw.calibrations = []  # the trained gates as they are, whatever calibration.json holds
        rows += [{"system": f"CCT ({e:g}, {d:g})", **evaluate(raw, src, ref, (e, d))}
                 for e, d in CCT_BUDGETS]
        cal = calibrated_cct(CCT_RUN, args.calibration_lines)
        rows += [{"system": f"CCT ({e:g}, {d:g}) calibrated", **evaluate(cal, src, ref, (e, d))}
                 for e, d in [*CCT_BUDGETS, *UNTRAINED]]
    else:
        rows += [r for name, r in carried.items() if name.startswith("CCT (")]
    for variant, spec in VARIANTS.items():
        label, run = spec["label"], run_dir(variant)
        if wanted(variant) and (run / "config.yaml").exists():
            cal = calibrated_cct(run, args.calibration_lines, VARIANT_BUDGETS)
            rows += [{"system": f"{label} ({e:g}, {d:g}) calibrated",
                      "variant": variant, **evaluate(cal, src, ref, (e, d))}
                     for e, d in VARIANT_BUDGETS]
        else:
            rows += [r for name, r in carried.items() if name.startswith(label + " (")]
    for name, spec in BASELINES.items():
        run, system = Path(baseline_config(name).run_dir), f"dense {spec['label']}"
        if wanted(name) and (run / "config.yaml").exists():
            rows.append({"system": system, **evaluate(Translator.load(run), src, ref)})
        elif system in carried:  # not re-measured: keep the committed row and its date
            rows.append(carried[system])
    _lib.stamp([r for r in rows if "measured" not in r], _lib.provenance())  # measured now
    for r in rows:
        r.setdefault("measured", today)
    machine = _lib.machine()
    recipe = ("python benchmarks/cct_quality.py train cct & python benchmarks/cct_quality.py "
              "train baselines; python benchmarks/cct_quality.py train cct --variants "
              f"{' '.join(VARIANTS)}; python benchmarks/cct_quality.py train baselines --only "
              f"{' '.join(LONG_BASELINES)}; "
              "python benchmarks/cct_quality.py report")
    out = {"benchmark": "cct_quality", "command": _lib.command(), "recipe": recipe,
           "machine": machine, "date": today,
           "test_set": "multi30k test_2016_flickr en->fr (1000 sentences), beam 4",
           "calibration": f"first {args.calibration_lines} pairs of multi30k val en->fr",
           "rows": rows}
    lines = quality_md(out)
    _lib.write_results(args.results, "cct_quality", out, lines)
    print("\n".join(lines))
    adherence = adherence_results(out)
    adherence_lines = adherence_md(adherence, out["calibration"])
    _lib.write_results(args.results, "cct_adherence", adherence, adherence_lines)
    print("\n".join(adherence_lines))
    plot(rows, args.results / "cct_quality.png")


def cmd_made_by_from_git(args: argparse.Namespace) -> None:
    """Rows measured before rows recorded ``made_by`` get one reconstructed from git history
    (:func:`_lib.made_by_from_git`); cct_quality's and cct_adherence's .json and .md are
    written again, nothing re-measured."""
    out = _lib.made_by_from_git(args.results / "cct_quality.json", "system",
                                "benchmarks/cct_quality.py", report_only)
    _lib.write_results(args.results, "cct_quality", out, quality_md(out))
    # the adherence rows again, with their systems' made_by, under the machine and command
    # the committed file records (the report that last wrote both may have run elsewhere)
    old = json.loads((args.results / "cct_adherence.json").read_text())
    adherence = {**adherence_results(out), "command": old["command"],
                 "machine": old["machine"]}
    def measured(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in ("system", "made_by")} for r in rows]

    if measured(adherence["rows"]) != measured(old["rows"]):
        raise ValueError("cct_adherence.json does not hold cct_quality.json's CCT rows: "
                         "run the report again")
    _lib.write_results(args.results, "cct_adherence", adherence,
                       adherence_md(adherence, out["calibration"]))


def report_only(row: dict) -> list[str]:
    """The ``report`` arguments that re-measure ``row`` of cct_quality.json: ``--only`` its
    variant, ``cct`` (every row of the configured CCT) or its dense baseline."""
    if row.get("variant"):
        return ["report", "--only", row["variant"]]
    if row["system"].startswith("CCT ("):
        return ["report", "--only", "cct"]
    name = next((n for n, spec in BASELINES.items() if row["system"] == f"dense {spec['label']}"),
                None)
    return ["report"] if name is None else ["report", "--only", name]


def quality_md(out: dict) -> list[str]:
    """The lines of cct_quality.md for the results ``out``."""
    full = next(r for r in out["rows"] if r["system"].startswith("dense small"))
    lines = _lib.md_head(
        "cct_quality: one CCT at several budgets vs MAC-matched dense models", out["command"],
        *_lib.recipe_lines(out),
        f"Machine: {out['machine']}", f"Test set: {out['test_set']}")
    lines += ["Layer MACs/token: attention + FFN (+ control nets for the CCT) per source token "
              "plus per target token, teacher forced over the test pairs, batch 1; embeddings "
              "and the output layer (the same for every model) excluded. For the CCT, the "
              "MACs that actually ran at that budget. \"calibrated\": the gate thresholds "
              f"shifted per budget and sub-network on {out.get('calibration', 'validation')} "
              "(`dynaseq calibrate`) so the realized compute meets the budget; (0.4, 0.4) was "
              "not trained and runs the (0.5, 0.5) control symbol calibrated to 0.4.", ""]

    def cells(r: dict) -> list:
        macs = r["layer_macs_per_token"]["total"]
        frac = r.get("realized_fraction")
        return [r["system"], r["bleu_beam4"], f"{macs / 1e6:.3f}M",
                f"{macs / full['layer_macs_per_token']['total']:.3f}",
                f"{frac['encoder']}, {frac['decoder']}" if frac else "", f"{r['params']:,}",
                r["steps"], r["train_minutes"], r.get("measured", "")]

    lines += _lib.md_table(
        ["system", "BLEU beam4", "layer MACs/token", "÷ dense small",
         "realized fraction (enc, dec)", "params", "steps", "train min", "measured"],
        "lrrrrrrrl", (cells(r) for r in out["rows"] if not r.get("variant")))
    return lines + variants_table(out["rows"]) + ["", *_lib.made_by_lines(out["rows"], "system")]


def variants_table(rows: list[dict]) -> list[str]:
    """BLEU of the CCT and each of :data:`VARIANTS` at the calibrated (b, b) budgets."""
    by_system = {r["system"]: r for r in rows}
    cols = [f"({b:g}, {b:g})" for b, _ in VARIANT_BUDGETS]
    table = []
    for label, overrides in [("CCT", []), *((v["label"], v["overrides"])
                                            for v in VARIANTS.values())]:
        found = [by_system.get(f"{label} {c} calibrated") for c in cols]
        if not any(found):
            continue
        table.append([label, " ".join(overrides) or "(as configured)",
                      *(r["bleu_beam4"] if r else "" for r in found),
                      next(r for r in found if r).get("measured", "")])
    return ["", "## CCT variants (same data and seed, 1400 updates unless named; calibrated "
            "budgets)", "",
            *_lib.md_table(["model", "config overrides", *(f"BLEU {c}" for c in cols),
                            "measured"], "ll" + "r" * len(cols) + "l", table),
            "", "One training run (seed 1) each: a BLEU or two between variants is within what "
            "another seed could move."]


def adherence_results(out: dict) -> dict:
    """cct_adherence.json: the realized fraction of each CCT budget row of ``out`` against its
    budget, with the quality row's ``system`` and ``made_by`` (what measured it)."""
    rows = []
    for r in out["rows"]:
        if "budget" not in r or r.get("variant"):
            continue
        enc, dec = r["budget"]
        f = r["realized_fraction"]
        err = {"encoder": round(f["encoder"] - enc, 3), "decoder": round(f["decoder"] - dec, 3)}
        rows.append({"system": r["system"], "made_by": r.get("made_by"),
                     "budget": r["budget"], "calibrated": bool(r.get("gate_offsets")),
                     "gate_offsets": r.get("gate_offsets"), "realized_fraction": f,
                     "error": err, "within_0.05": all(abs(v) <= 0.05 for v in err.values())})
    return {"benchmark": "cct_adherence", "command": out["command"], "machine": out["machine"],
            "test_set": out["test_set"], "rows": rows}


def adherence_md(res: dict, calibration: str = "validation") -> list[str]:
    """The lines of cct_adherence.md for the results ``res``, whose gate offsets were fitted
    on ``calibration`` (the quality results' ``calibration``)."""
    lines = _lib.md_head(
        "cct_adherence: realized compute fraction vs the trained budget", res["command"],
        f"Machine: {res['machine']}",
        "Realized fraction: MACs the gated sub-layers (attention, FFN pieces, control "
        "nets) ran on test_2016_flickr (teacher forced, batch 1) over the same passes "
        "with every gate on. Target: within ±0.05 of the budget. Calibrated: gate "
        f"offsets fitted on {calibration} (`dynaseq calibrate`), "
        "measured here on the test set.")

    def cells(r: dict) -> list:
        f, e, o = r["realized_fraction"], r["error"], r["gate_offsets"]
        return [tuple(r["budget"]), "yes" if r["calibrated"] else "no",
                f"{o['encoder']:+.3f}, {o['decoder']:+.3f}" if o else "", f["encoder"],
                f["decoder"], f"{e['encoder']:+}", f"{e['decoder']:+}",
                "yes" if r["within_0.05"] else "NO"]

    return lines + _lib.md_table(
        ["budget (enc, dec)", "calibrated", "offsets (enc, dec)", "realized enc",
         "realized dec", "error enc", "error dec", "within ±0.05"], "llrrrrrl",
        (cells(r) for r in res["rows"])) + [
        "", "Each row is measured with the cct_quality row of its system.", "",
        *_lib.made_by_lines(res["rows"], "system")]


def plot(rows: list[dict], path: Path) -> None:
    """Left: every system at 1400 updates (the CCT's variants in grey). Right: the CCT at its
    calibrated (b, b) budgets and the dense models of equal MACs, one colour per length."""
    fig, (ax, ax_len) = _plot.pyplot().subplots(1, 2, figsize=(13, 5))

    def cct(r: dict, calibrated: bool) -> bool:
        return ("budget" in r and not r.get("variant")
                and bool(r.get("gate_offsets")) == calibrated)

    def mmacs(r: dict) -> float:
        return r["layer_macs_per_token"]["total"] / 1e6

    for label, keep, style in (
            ("CCT (b, b)", lambda r: cct(r, False) and r["budget"][0] == r["budget"][1], "o-"),
            ("CCT (b, b) calibrated", lambda r: cct(r, True)
             and r["budget"][0] == r["budget"][1], "o:"),
            ("CCT (1, b): decoder budget only", lambda r: cct(r, False)
             and r["budget"][0] == 1.0 and r["budget"][1] < 1.0, "s--")):
        ax.plot(*zip(*sorted((mmacs(r), r["bleu_beam4"]) for r in rows if keep(r)),
                     strict=True), style, label=label)
    long_cct = {f"cct_{tag}": steps for tag, steps in LONG_STEPS.items()}
    for variant in VARIANTS:
        pts = sorted((mmacs(r), r["bleu_beam4"]) for r in rows if r.get("variant") == variant)
        if pts and variant not in long_cct:
            ax.plot(*zip(*pts, strict=True), ".:", color="0.6", lw=0.8)
            ax.annotate(variant, pts[-1], fontsize=6, color="0.4")
    dense = [r for r in rows if "budget" not in r]
    for r in dense:
        if r["steps"] == DENSE_STEPS:
            ax.plot(mmacs(r), r["bleu_beam4"], "k^")
            ax.annotate(r["system"].removeprefix("dense "), (mmacs(r), r["bleu_beam4"]),
                        fontsize=7, xytext=(4, -3), textcoords="offset points")
    ax.set_title(f"{DENSE_STEPS} updates: CCT budgets vs MAC-matched dense models (▲)")
    ax.legend(fontsize=8)

    trained = [list(b) for b in VARIANT_BUDGETS]  # not the untrained (0.4, 0.4)
    by_system = {r["system"]: r for r in dense}
    lengths = {DENSE_STEPS: ("", [r for r in rows if cct(r, True)]), **{
        steps: (f"_{tag}", [r for r in rows if r.get("variant") == f"cct_{tag}"])
        for tag, steps in LONG_STEPS.items()}}
    for i, (steps, (suffix, cct_rows)) in enumerate(lengths.items()):
        pts = sorted((mmacs(r), r["bleu_beam4"]) for r in cct_rows if r["budget"] in trained)
        if pts:
            ax_len.plot(*zip(*pts, strict=True), "o-", color=f"C{i}",
                        label=f"CCT (b, b) calibrated, {steps} updates")
        for n in LONG_DENSE:
            dense_run = BASELINES.get(n + suffix)  # none past dense_long_tags
            r = None if dense_run is None else by_system.get(f"dense {dense_run['label']}")
            if r is not None:
                ax_len.plot(mmacs(r), r["bleu_beam4"], "^", color=f"C{i}", ms=8)
                if not suffix:
                    ax_len.annotate(BASELINES[n]["label"], (mmacs(r), r["bleu_beam4"]),
                                    fontsize=7, xytext=(6, -12), textcoords="offset points")
    ax_len.set_title("Training length: CCT (●) and dense models of equal MACs (▲)")
    ax_len.legend(fontsize=8, loc="lower right")
    for a in (ax, ax_len):
        a.set_xlabel("layer MACs per token (millions; CCT: realized)")
        a.set_ylabel("BLEU, test_2016_flickr en→fr, beam 4")
        a.grid(alpha=0.3)
    _plot.save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("lane", choices=["cct", "baselines"])
    t.add_argument("--variants", nargs="*", choices=list(VARIANTS),
                   help="with lane cct: train these variants instead of the CCT")
    t.add_argument("--only", nargs="*", choices=list(BASELINES))
    t.set_defaults(func=cmd_train)
    r = sub.add_parser("report")
    r.add_argument("--only", nargs="*", choices=["cct", *VARIANTS, *BASELINES],
                   help="re-measure these systems only (cct: every CCT row); the other rows "
                        "are kept from the committed results with their dates")
    r.add_argument("--calibration-lines", type=int, default=300,
                   help="validation pairs the budget calibration runs on")
    _lib.add_results_arg(r)
    r.set_defaults(func=cmd_report)
    _lib.add_made_by_command(sub, cmd_made_by_from_git)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
