"""Benchmark `dmb` (Tan et al. 2021, Tables I-IV, fig. 5) on Multi30k en->de, `tiny` size.

Transformer vs Transformer-MoE (noisy top-2 of 4) vs Transformer-DMB (N = 4): #params,
#MACs (the paper's convention: a 30 -> 30-token pass, output layer included), BLEU (beam 4,
test_2016_flickr) and PTR = BLEU / sqrt(#MACs) · 10^4 (Table I); sequence-level distillation
from the dense tiny Transformer trained 3000 updates (`train long`; Table IV); DMB without
shared-private, without each auxiliary loss (and with a tenth of the diversity loss), without
DMB attention (Table III); N in {2, 4, 8} (fig. 5); CPU latency of a 30-token
sentence, greedy and beam 4, batch 1 and 32, fp32 and int8 (Table II protocol).

Every tiny model, the dense Transformer included, gets the same number of updates (STEPS)
with the same data, batch size, learning-rate schedule and seed.

    python benchmarks/dmb.py train a        # Transformer, DMB N=4, MoE, w/o shared-private,
                                            # w/o diversity
    python benchmarks/dmb.py train b        # w/o entropy, w/o DMB attention, N=2, N=8,
                                            # diversity × 0.1
    python benchmarks/dmb.py train kd       # distill-data from dense_3k (after `train long`),
                                            # 2 students
    python benchmarks/dmb.py report         # evaluate + latency + int8, write results/
    python benchmarks/dmb.py train long     # the Transformer and DMB continued to 3000 updates
    python benchmarks/dmb.py report-long    # Table I at 3000 updates: results/dmb_long.*
    python benchmarks/dmb.py report-latency # latency only, tiny trained + small/base untrained

The `train` lanes use one thread each, so two can run side by side on 2 cores; `report`
measures latency with every core and should run alone. Writes
benchmarks/results/dmb.{json,md,png}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from dynaseq.data import read_lines
from dynaseq.metrics.latency import decode_latency_ms
from dynaseq.metrics.profile import count_params
from dynaseq.tasks.registry import load_config
from dynaseq.tasks.translation.predictor import Translator

import _lib
import _plot

DATA = _lib.MULTI30K
RUNS = _lib.RUNS
STEPS = 1000
# the distillation teacher: the dense tiny Transformer trained 3000 updates (test BLEU 36.08,
# against 29.66 after the students' 1000); the paper distils from a larger Transformer
TEACHER = RUNS / "dmb_dense_3k"
KD_DATA = RUNS / "dmb_kd" / "train.distilled.de"  # spelled out in variants/dmb.yaml too
CONFIGS: dict[str, str] = _lib.registry("dmb", "configs")  # dense, dmb, moe -> tiny config
# name -> {"lane", "table", "system", "config", "overrides"}
VARIANTS: dict[str, dict] = _lib.registry("dmb", "variants",
                                          ("lane", "table", "system", "config", "overrides"))
LONG_STEPS = 3000
# name -> {"system", "source": the 1000-update run it continues, "config"}
LONG: dict[str, dict] = _lib.registry("dmb", "long", ("system", "source", "config"))


def run_dir(name: str) -> Path:
    """Where system ``name`` trains."""
    return RUNS / f"dmb_{name}"


def variant_config(name: str):
    """The config of variant ``name``: STEPS updates."""
    v = VARIANTS[name]
    return load_config(v["config"], [f"run_dir={run_dir(name)}", f"train.max_steps={STEPS}",
                                     "train.valid_bleu_lines=300", *v["overrides"]])


def distill_data(threads: int) -> None:
    """The teacher's beam-4 translations of the training sources (Kim & Rush 2016)."""
    if KD_DATA.exists():
        return
    KD_DATA.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dynaseq", "distill-data", str(TEACHER),
           "--src", str(DATA / "train.en.gz"), "--out", str(KD_DATA), "--beam", "4"]
    print("==", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # beside another lane
    subprocess.run(cmd, check=True, env=env)
    (KD_DATA.parent / "distill_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")


def long_configs(names: list[str]) -> Iterator:
    """The config continuing each finished run of ``names`` to LONG_STEPS updates, in a copy
    of its directory made as it comes up (resuming is exact, so this equals training
    LONG_STEPS updates straight through)."""
    for name in names:
        dst = run_dir(name)
        if not dst.exists():
            shutil.copytree(LONG[name]["source"], dst)
        yield load_config(LONG[name]["config"], [
            f"run_dir={dst}", f"train.max_steps={LONG_STEPS}", "train.max_minutes=1000",
            "train.valid_bleu_lines=300"])


def cmd_train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if args.lane == "long":
        _lib.train_each(long_configs([n for n in LONG if not args.only or n in args.only]))
        return
    if args.lane == "kd":
        distill_data(args.threads)
    _lib.train_each(variant_config(n) for n, v in VARIANTS.items()
                    if v["lane"] == args.lane and (not args.only or n in args.only))


def evaluate(t: Translator, src: list[str], ref: list[str]) -> dict:
    """One result row: BLEU (beam 4), MACs of a 30 -> 30 pass, PTR, test loss, params and
    the run's training throughput."""
    r = t.evaluate(src, ref, beam=4)
    row = {"bleu_beam4": round(r["bleu"], 2), "macs_pair": r["macs_pair"],
           "ptr": round(r["ptr"], 2), "loss": round(r["loss"], 4),
           "params": count_params(t.model),
           **_lib.throughput(Path(t.config.run_dir))}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def latency(model: torch.nn.Module, repeats: int) -> dict[str, float]:
    """ms for a 30 -> 30-token translation, greedy and beam 4, batch 1 and 32."""
    return {f"{'greedy' if beam == 1 else 'beam4'}_b{batch}": round(decode_latency_ms(
        model, 30, 30, beam=beam, batch=batch, repeats=repeats), 2)
        for beam in (1, 4) for batch in (1, 32)}


def interleaved_latency(models: dict[str, torch.nn.Module], rounds: int,
                        repeats: int) -> dict[str, dict[str, float]]:
    """Latency of each model, the models taking turns ``rounds`` times (the machine's noise
    then hits them alike); the median of each model's per-round medians."""
    per: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            per[name].append(latency(model, repeats))
    out = {}
    for name, runs in per.items():
        out[name] = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
    return out


def scaled_models(size: str, int8: bool = False) -> dict[str, torch.nn.Module]:
    """Untrained dense / DMB / MoE models of ``size`` (3+3 layers, vocabulary 8000), the
    DMB shared parts folded as for inference: latency does not depend on training, except
    through how tokens spread over branches (random-init routers spread them too).
    ``int8``: their int8 copies too (``{name}_{size}_int8``)."""
    from dynaseq.compress.int8 import quantize_int8
    from dynaseq.tasks.translation.model import build_seq2seq
    from dynaseq.techniques.branching import merge_shared_

    torch.manual_seed(0)
    out = {}
    for name, path in CONFIGS.items():
        model = build_seq2seq(load_config(path, [f"model.size={size}"]).model, 8000)
        merge_shared_(model)
        out[f"{name}_{size}"] = model.eval()
    if int8:
        out.update({f"{name}_int8": quantize_int8(model) for name, model in list(out.items())})
    return out


def target_ratios(lat: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The issue's latency targets for one group of models named ``dense*``, ``dmb*``,
    ``moe*`` (``*_int8`` their int8 copies): DMB ÷ dense (≤ 1.05), MoE ÷ DMB (≥ 1.3) and
    DMB fp32 ÷ DMB int8 (≥ 1.3 at batch 32), per setting."""
    def pick(prefix: str, int8: bool = False) -> dict[str, float] | None:
        return next((ms for name, ms in lat.items() if name.split("_")[0] == prefix
                     and name.endswith("_int8") == int8 and "no_" not in name), None)

    dense, dmb, moe, dmb8 = pick("dense"), pick("dmb"), pick("moe"), pick("dmb", True)
    out = {}
    for label, num, den in (("DMB ÷ dense (≤ 1.05)", dmb, dense), ("MoE ÷ DMB (≥ 1.3)", moe, dmb),
                            ("DMB fp32 ÷ DMB int8 (≥ 1.3 at b32)", dmb, dmb8)):
        if num is not None and den is not None:
            out[label] = {k: round(num[k] / den[k], 2) for k in num}
    return out


def finished(run: Path, steps: int = STEPS) -> bool:
    """The run trained to ``steps`` updates (a stopped or half-started one does not count)."""
    return _lib.finished(run, steps)


def cmd_report(args: argparse.Namespace) -> None:
    from dynaseq.compress.int8 import quantize_int8

    src = read_lines(DATA / "test_2016_flickr.en.gz")
    ref = read_lines(DATA / "test_2016_flickr.de.gz")
    rows, translators = [], {}
    made_by = _lib.provenance()  # recorded in every row measured now
    systems = [(n, v["table"], v["system"], run_dir(n)) for n, v in VARIANTS.items()
               if not args.only or n in args.only]
    for name, table, desc, path in systems:
        if not finished(path):
            print(f"-- {name}: no finished run at {path}, skipped", file=sys.stderr)
            continue
        t = Translator.load(path)
        translators[name] = t
        rows.append({"name": name, "table": table, "system": desc, **evaluate(t, src, ref),
                     "measured": time.strftime("%Y-%m-%d"), "made_by": made_by})
    int8 = {}
    for name in ("dense", "dmb", "moe"):
        if name in translators:
            t = Translator.load(translators[name].config.run_dir)
            t.model = quantize_int8(t.model)
            int8[name] = t
            rows.append({"name": f"{name}_int8", "table": "int8",
                         "system": f"{next(r['system'] for r in rows if r['name'] == name)}"
                                   " int8", **evaluate(t, src, ref),
                         "measured": time.strftime("%Y-%m-%d"), "made_by": made_by})
    models = {n: translators[n].model for n in ("dense", "dmb", "moe", "dmb_no_attention")
              if n in translators}
    models.update({f"{n}_int8": t.model for n, t in int8.items()})
    lat = interleaved_latency(models, args.rounds, args.repeats) if args.latency else {}
    scaled = {size: interleaved_latency(scaled_models(size), args.rounds, args.repeats)
              for size in (args.scale_sizes if args.latency else [])}
    for r in rows:
        if r["name"] in lat:
            r["latency_ms"] = lat[r["name"]]
    machine = _lib.machine(cpus=torch.get_num_threads())
    recipe = ("python benchmarks/dmb.py train a & python benchmarks/dmb.py train b; "
              "python benchmarks/dmb.py train kd; python benchmarks/dmb.py report")
    disk = disk_sizes(translators)
    if args.only:
        rows, disk = merge_committed(rows, disk, args.results / "dmb.json")
    out = {"benchmark": "dmb", "command": _lib.command(), "recipe": recipe, "machine": machine,
           "test_set": "multi30k test_2016_flickr en->de (1000 sentences), beam 4",
           "updates": STEPS, "rows": rows, "disk_bytes": disk,
           "latency_untrained_ms": scaled}
    lines = markdown(out)
    _lib.write_results(args.results, "dmb", out, lines)
    print("\n".join(lines))
    plot(rows, args.results / "dmb.png")


def cmd_made_by_from_git(args: argparse.Namespace) -> None:
    """Rows measured before rows recorded ``made_by`` get one reconstructed from git history
    (:func:`_lib.made_by_from_git`; an int8 row is re-measured with its float system); dmb.json
    and .md are written again, nothing re-measured."""
    out = _lib.made_by_from_git(args.results / "dmb.json", "name", "benchmarks/dmb.py",
                                lambda r: ["report", "--only", r["name"].removesuffix("_int8")])
    _lib.write_results(args.results, "dmb", out, markdown(out))


def merge_committed(rows: list[dict], disk: dict, path: Path) -> tuple[list[dict], dict]:
    """``rows`` re-measured by ``report --only`` merged into the committed results ``path``
    (dmb.json): the other systems keep their committed BLEU/MACs rows (without their latency,
    which belongs to the run that measured it), in the order of VARIANTS followed by the int8
    rows."""
    new = {r["name"] for r in rows}
    kept = [{k: v for k, v in r.items() if k != "latency_ms"}
            for name, r in _lib.committed_rows(path, "name").items() if name not in new]
    order = [*VARIANTS, *(f"{n}_int8" for n in VARIANTS)]
    merged = sorted(kept + rows, key=lambda r: order.index(r["name"]))
    old_disk = json.loads(path.read_text()).get("disk_bytes", {}) if path.exists() else {}
    return merged, {**old_disk, **disk}


def cmd_report_latency(args: argparse.Namespace) -> None:
    """Latency only (no BLEU): the trained tiny models fp32 and int8, and untrained models of
    ``--scale-sizes``, each group interleaved; results/dmb_latency{_TAG}.{json,md}."""
    from dynaseq.compress.int8 import quantize_int8

    trained = {}
    for name in ("dense", "dmb", "moe", "dmb_no_attention"):
        if finished(run_dir(name)):
            trained[name] = Translator.load(run_dir(name)).model
        else:
            print(f"-- {name}: no finished run, skipped", file=sys.stderr)
    for name in ("dense", "dmb", "moe"):
        if name in trained:
            trained[f"{name}_int8"] = quantize_int8(Translator.load(run_dir(name)).model)
    groups = ({"tiny (trained)": interleaved_latency(trained, args.rounds, args.repeats)}
              if trained else {})  # no finished `report` runs here: the untrained sizes only
    for size in args.scale_sizes:
        groups[f"{size} (untrained)"] = interleaved_latency(scaled_models(size, args.int8),
                                                            args.rounds, args.repeats)
    import dynaseq  # the code timed: this checkout, or another on PYTHONPATH

    code = _lib.code_state(Path(dynaseq.__file__).resolve().parent)  # its whole tree
    commit = (code["commit"] or "no git checkout")[:12]
    commit += " (with uncommitted changes)" if code["dirty"] else ""
    out = {"benchmark": "dmb_latency", "command": _lib.command(), "commit": commit,
           "machine": _lib.machine(),
           "measured": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds,
           "repeats": args.repeats, "groups": groups,
           "target_ratios": {g: target_ratios(lat) for g, lat in groups.items()}}
    lines = latency_markdown(out)
    _lib.write_results(args.results, f"dmb_latency{f'_{args.tag}' if args.tag else ''}", out,
                       lines)
    print("\n".join(lines))


def latency_markdown(out: dict) -> list[str]:
    """The lines of dmb_latency{_TAG}.md for the results ``out``."""
    lines = _lib.md_head(
        "dmb_latency: CPU latency of a 30 → 30-token translation (ms; ratio to the dense model "
        "of the same group)", out["command"], f"Code: {out['commit']} ({out['measured']})",
        f"Machine: {out['machine']}",
        f"Each group's models take turns {out['rounds']} times ({out['repeats']} timed "
        "decodes each after a warm-up); the median of the per-round medians. The trained "
        "models are the `report` runs (1000 updates); untrained ones have 3+3 layers, "
        "vocabulary 8000, and DMB shared parts merged.")[:-1]  # each group opens with a blank
    for group, lat in out["groups"].items():
        base = next(ms for name, ms in lat.items() if name.split("_")[0] == "dense"
                    and not name.endswith("int8"))
        keys = list(base)
        lines += ["", f"## {group}", ""]
        lines += _lib.md_table(["model", *keys], "l" + "r" * len(keys), (
            [name, *(f"{ms[k]} ({ms[k] / base[k]:.2f}×)" for k in keys)]
            for name, ms in lat.items()))
        lines += [""] + _lib.md_table(["target ratio", *keys], "l" + "r" * len(keys), (
            [label, *(f"{ratios[k]:.2f}" for k in keys)]
            for label, ratios in target_ratios(lat).items()))
    return lines


def cmd_report_long(args: argparse.Namespace) -> None:
    src = read_lines(DATA / "test_2016_flickr.en.gz")
    ref = read_lines(DATA / "test_2016_flickr.de.gz")
    rows = []
    for name, (desc, source, _) in LONG.items():
        for label, path in ((f"{LONG_STEPS} updates", run_dir(name)), ("1000 updates", source)):
            if path == run_dir(name) and not finished(path, LONG_STEPS):
                print(f"-- {name}: no finished run at {path}, skipped", file=sys.stderr)
                continue
            rows.append({"name": name, "system": desc, "updates": label,
                         **evaluate(Translator.load(path), src, ref)})
    # validation events at every 200th update (the configs' valid_every); a run stopped by a
    # signal also logs one at the step it stopped at: those are left out
    curves = {name: _lib.valid_curve(run_dir(name), every=200, missing_ok=True)
              for name in LONG}
    out = {"benchmark": "dmb_long", "command": "python benchmarks/dmb.py train long; "
           "python benchmarks/dmb.py report-long",
           "machine": _lib.machine(torch_threads=False),
           "test_set": "multi30k test_2016_flickr en->de (1000 sentences), beam 4", "rows": rows,
           "valid_curves": curves}
    lines = long_markdown(out)
    _lib.write_results(args.results, "dmb_long", out, lines)
    print("\n".join(lines))


def long_markdown(out: dict) -> list[str]:
    """The lines of dmb_long.md for the results ``out``."""
    lines = _lib.md_head(
        "dmb_long: Transformer vs Transformer-DMB (tiny, Multi30k en→de) by training length",
        out["command"], f"Machine: {out['machine']}", f"Test set: {out['test_set']}")
    lines += _lib.md_table(
        ["system", "updates", "params", "#MACs", "BLEU", "PTR", "test loss"], "llrrrrr",
        ([r["system"], r["updates"], f"{r['params'] / 1e6:.2f}M", f"{r['macs_pair'] / 1e6:.1f}M",
          r["bleu_beam4"], r["ptr"], r["loss"]] for r in out["rows"]))
    # step keys are strings once the results went through JSON
    curves = {n: {int(step): v for step, v in c.items()} for n, c in out["valid_curves"].items()}
    steps = sorted({step for c in curves.values() for step in c})
    lines += ["", "## Validation by update (valid loss / greedy BLEU on 300 valid lines; from "
              "each run's log.jsonl, so a run still training shows the updates it reached)", ""]
    return lines + _lib.md_table(
        ["update", *curves], "r" * (len(curves) + 1),
        ([step, *(f"{c[step]['loss']:.3f} / {c[step]['bleu']:.1f}" if step in c else ""
                  for c in curves.values())] for step in steps))


def disk_sizes(translators: dict[str, Translator]) -> dict[str, dict[str, int]]:
    """Bytes of the fp32 checkpoint each run's translator loads, and of its int8 run written
    by ``dynaseq quantize`` (into runs/bench/dmb_int8/<name>)."""
    out = {}
    for name in ("dense", "dmb", "moe"):
        if name not in translators:
            continue
        t = translators[name]
        q_dir = RUNS / "dmb_int8" / name
        if not q_dir.exists():
            subprocess.run([sys.executable, "-m", "dynaseq", "quantize", str(t.config.run_dir),
                            "--out", str(q_dir)], check=True)
        q_weights = sum(p.stat().st_size for p in q_dir.rglob("*.safetensors"))
        fp32 = sum(p.stat().st_size for p in Path(t.checkpoint).rglob("*.safetensors"))
        out[name] = {"fp32": fp32, "int8": q_weights}
    return out


def markdown(out: dict) -> list[str]:
    """The lines of dmb.md for the results ``out``."""
    rows = {r["name"]: r for r in out["rows"]}
    dense = rows.get("dense")
    lines = _lib.md_head(
        "dmb: Transformer vs Transformer-MoE vs Transformer-DMB (tiny, Multi30k en→de)",
        out["command"], *_lib.recipe_lines(out),
        f"Machine: {out['machine']}",
        f"Test set: {out['test_set']}; every model {out['updates']} updates with the same "
        "data, batch size, schedule and seed.")
    lines += ["#MACs: the DMB paper's convention, one 30 → 30-token pass with the output layer "
              "(Mult-Adds). PTR = BLEU / sqrt(#MACs) · 10⁴. Params: the inference model (shared "
              "part merged).", ""]
    lines += _lib.md_table(
        ["table", "system", "params", "#MACs", "÷ Transformer", "BLEU", "PTR", "steps",
         "train min", "measured"], "llrrrrrrrl",
        ([r["table"], r["system"], f"{r['params'] / 1e6:.2f}M", f"{r['macs_pair'] / 1e6:.1f}M",
          f"{r['macs_pair'] / dense['macs_pair']:.4f}" if dense else "", r["bleu_beam4"],
          r["ptr"], r["steps"], r["train_minutes"], r.get("measured", "earlier")]
         for r in out["rows"]))
    if any(r["table"] == "IV" for r in out["rows"]):
        lines += ["", f"Table IV: the students train on the beam-4 translations of the training "
                  f"sources by `{TEACHER}` (the dense tiny Transformer after {LONG_STEPS} "
                  "updates, `dmb_long.md`), references unchanged for testing."]
    lat_rows = [r for r in out["rows"] if "latency_ms" in r]
    if not lat_rows:
        lines += ["", "CPU latency: `python benchmarks/dmb.py report-latency` "
                  "(`dmb_latency.md`)."]
    if lat_rows:
        keys = list(lat_rows[0]["latency_ms"])
        base = rows["dense"]["latency_ms"] if "dense" in rows else None
        lines += ["", "## CPU latency, 30 → 30 tokens (ms; ratio to the fp32 Transformer)", ""]
        lines += _lib.md_table(["system", *keys], "l" + "r" * len(keys), (
            [r["system"], *(f"{r['latency_ms'][k]} ({r['latency_ms'][k] / base[k]:.2f}×)"
                            if base else r["latency_ms"][k] for k in keys)]
            for r in lat_rows))
    for size, lat in out.get("latency_untrained_ms", {}).items():
        keys = list(next(iter(lat.values())))
        base = lat[f"dense_{size}"]
        lines += ["", f"## CPU latency at the `{size}` size, untrained, 3+3 layers (ms; ratio to "
                  "dense)", ""]
        lines += _lib.md_table(["model", *keys], "l" + "r" * len(keys), (
            [name, *(f"{ms[k]} ({ms[k] / base[k]:.2f}×)" for k in keys)]
            for name, ms in lat.items()))
    if out.get("disk_bytes"):
        lines += ["", "## Disk size of the weights (bytes)", ""]
        lines += _lib.md_table(["model", "fp32", "int8", "ratio"], "lrrr", (
            [name, f"{d['fp32']:,}", f"{d['int8']:,}", f"{d['int8'] / d['fp32']:.3f}"]
            for name, d in out["disk_bytes"].items()))
    return lines + ["", *_lib.made_by_lines(out["rows"], "name")]


def plot(rows: list[dict], path: Path) -> None:
    """BLEU against #MACs, one labelled point per system."""
    _plot.labelled_scatter([(r["name"], r["macs_pair"] / 1e6, r["bleu_beam4"]) for r in rows],
                           "#MACs of a 30 → 30-token pass (millions)",
                           "BLEU, test_2016_flickr en→de, beam 4",
                           "dmb: BLEU vs Mult-Adds (tiny)", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("lane", choices=["a", "b", "kd", "long"])
    t.add_argument("--only", nargs="*", choices=[*VARIANTS, *LONG])
    t.add_argument("--threads", type=int, default=1)
    t.set_defaults(func=cmd_train)
    r = sub.add_parser("report")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--scale-sizes", nargs="*", default=["small"],
                   help="also time untrained dense/DMB/MoE models of these sizes")
    r.add_argument("--only", nargs="*", choices=list(VARIANTS),
                   help="re-measure these systems; the others keep their committed rows")
    r.add_argument("--no-latency", dest="latency", action="store_false",
                   help="BLEU, MACs, params and disk size only (time with report-latency)")
    _lib.add_results_arg(r)
    r.set_defaults(func=cmd_report)
    _lib.add_made_by_command(sub, cmd_made_by_from_git)
    long = sub.add_parser("report-long")
    _lib.add_results_arg(long)
    long.set_defaults(func=cmd_report_long)
    lat = sub.add_parser("report-latency")
    lat.add_argument("--rounds", type=int, default=5)
    lat.add_argument("--repeats", type=int, default=3)
    lat.add_argument("--scale-sizes", nargs="*", default=["small", "base"])
    lat.add_argument("--tag", default="", help="suffix of the result files, e.g. `before`")
    lat.add_argument("--no-int8", dest="int8", action="store_false",
                     help="time the untrained sizes in fp32 only")
    _lib.add_results_arg(lat)
    lat.set_defaults(func=cmd_report_latency)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
