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
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from plotting import labelled_scatter

from dynaseq.config import load_config
from dynaseq.data import read_lines
from dynaseq.infer.translator import Translator
from dynaseq.metrics.latency import decode_latency_ms
from dynaseq.metrics.profile import count_params
from dynaseq.train.loop import train

from _lib import throughput

DATA = Path("../shared/data/multi30k")
RESULTS = Path("benchmarks/results")
RUNS = Path("runs/bench")
STEPS = 1000
# the distillation teacher: the dense tiny Transformer trained 3000 updates (test BLEU 36.08,
# against 29.66 after the students' 1000); the paper distils from a larger Transformer
TEACHER = RUNS / "dmb_dense_3k"
KD_DATA = RUNS / "dmb_kd" / "train.distilled.de"
DMB_CFG, MOE_CFG = "configs/multi30k_dmb_tiny.yaml", "configs/multi30k_moe_tiny.yaml"
DENSE_CFG = "configs/multi30k_tiny.yaml"
# name -> (lane, table, description, config, overrides)
VARIANTS: dict[str, tuple[str, str, str, str, list[str]]] = {
    "dense": ("a", "I", "Transformer", DENSE_CFG, []),
    "dmb": ("a", "I", "Transformer-DMB (N=4)", DMB_CFG, []),
    "moe": ("a", "I", "Transformer-MoE (top-2 of 4)", MOE_CFG, []),
    "dmb_no_shared_private": ("a", "III", "DMB w/o shared-private", DMB_CFG,
                              ["model.dmb.shared_private=false"]),
    "dmb_no_diversity": ("a", "III", "DMB w/o diversity loss", DMB_CFG,
                         ["model.dmb.diversity=false"]),
    "dmb_no_entropy": ("b", "III", "DMB w/o entropy loss", DMB_CFG, ["model.dmb.entropy=false"]),
    "dmb_no_attention": ("b", "III", "DMB w/o DMB attention (FFN only)", DMB_CFG,
                         ["model.dmb.attention=false"]),
    "dmb_n2": ("b", "fig5", "DMB N=2", DMB_CFG, ["model.dmb.n_branches=2"]),
    "dmb_n8": ("b", "fig5", "DMB N=8", DMB_CFG, ["model.dmb.n_branches=8"]),
    # not in the paper: at α = 0.1 the diversity loss makes routing uniform, without it routing
    # collapses onto one branch per sub-layer; a tenth of it lies between
    "dmb_div01": ("b", "III", "DMB, diversity loss × 0.1", DMB_CFG,
                  ["model.dmb.diversity_weight=0.1"]),
    "kd_dense": ("kd", "IV", "Transformer + seq-KD", DENSE_CFG,
                 [f"data.train_tgt={KD_DATA}"]),
    "kd_dmb": ("kd", "IV", "Transformer-DMB (N=4) + seq-KD", DMB_CFG,
               [f"data.train_tgt={KD_DATA}"]),
}

LONG_STEPS = 3000
# name -> (description, the 1000-update run it continues, config)
LONG: dict[str, tuple[str, Path, str]] = {
    "dense_3k": ("Transformer", RUNS / "dmb_dense", DENSE_CFG),
    "dmb_3k": ("Transformer-DMB (N=4)", RUNS / "dmb_dmb", DMB_CFG),
}


def run_dir(name: str) -> Path:
    return RUNS / f"dmb_{name}"


def variant_config(name: str):
    _, _, _, path, overrides = VARIANTS[name]
    return load_config(path, [f"run_dir={run_dir(name)}", f"train.max_steps={STEPS}",
                              "train.valid_bleu_lines=300", *overrides])


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


def train_long(names: list[str]) -> None:
    """Continue a finished run to LONG_STEPS updates in a copy of its directory (resuming is
    exact, so this equals training LONG_STEPS updates straight through)."""
    for name in names:
        desc, source, config = LONG[name]
        dst = run_dir(name)
        if not dst.exists():
            shutil.copytree(source, dst)
        cfg = load_config(config, [f"run_dir={dst}", f"train.max_steps={LONG_STEPS}",
                                   "train.max_minutes=1000", "train.valid_bleu_lines=300"])
        print(f"== training {cfg.run_dir} to {LONG_STEPS} updates", file=sys.stderr, flush=True)
        if train(cfg, progress=True).stopped_by_signal is not None:
            break


def cmd_train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if args.lane == "long":
        train_long([n for n in LONG if not args.only or n in args.only])
        return
    if args.lane == "kd":
        distill_data(args.threads)
    names = [n for n, v in VARIANTS.items() if v[0] == args.lane
             and (not args.only or n in args.only)]
    for name in names:
        cfg = variant_config(name)
        print(f"== training {cfg.run_dir}", file=sys.stderr, flush=True)
        result = train(cfg, progress=True)
        if result.stopped_by_signal is not None:  # checkpoint written; rerun to resume
            break


def evaluate(t: Translator, src: list[str], ref: list[str]) -> dict:
    r = t.evaluate(src, ref, beam=4)
    row = {"bleu_beam4": round(r["bleu"], 2), "macs_pair": r["macs_pair"],
           "ptr": round(r["ptr"], 2), "loss": round(r["loss"], 4),
           "params": count_params(t.model),
           **throughput(Path(t.config.run_dir))}
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
    from dynaseq.branching import merge_shared_
    from dynaseq.compress.int8 import quantize_int8
    from dynaseq.models import build_seq2seq

    torch.manual_seed(0)
    out = {}
    for name, path in (("dense", DENSE_CFG), ("dmb", DMB_CFG), ("moe", MOE_CFG)):
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
    log = run / "log.jsonl"
    if not log.exists():
        return False
    stops = [json.loads(line) for line in log.read_text().splitlines() if '"stop"' in line]
    return any(e.get("reason") == "max_steps" and e.get("step", 0) >= steps for e in stops)


def cmd_report(args: argparse.Namespace) -> None:
    from dynaseq.compress.int8 import quantize_int8

    src = read_lines(DATA / "test_2016_flickr.en.gz")
    ref = read_lines(DATA / "test_2016_flickr.de.gz")
    rows, translators = [], {}
    systems = [(n, v[1], v[2], run_dir(n)) for n, v in VARIANTS.items()
               if not args.only or n in args.only]
    for name, table, desc, path in systems:
        if not finished(path):
            print(f"-- {name}: no finished run at {path}, skipped", file=sys.stderr)
            continue
        t = Translator.load(path)
        translators[name] = t
        rows.append({"name": name, "table": table, "system": desc, **evaluate(t, src, ref),
                     "measured": time.strftime("%Y-%m-%d")})
    int8 = {}
    for name in ("dense", "dmb", "moe"):
        if name in translators:
            t = Translator.load(translators[name].config.run_dir)
            t.model = quantize_int8(t.model)
            int8[name] = t
            rows.append({"name": f"{name}_int8", "table": "int8",
                         "system": f"{next(r['system'] for r in rows if r['name'] == name)}"
                                   " int8", **evaluate(t, src, ref),
                         "measured": time.strftime("%Y-%m-%d")})
    models = {n: translators[n].model for n in ("dense", "dmb", "moe", "dmb_no_attention")
              if n in translators}
    models.update({f"{n}_int8": t.model for n, t in int8.items()})
    lat = interleaved_latency(models, args.rounds, args.repeats) if args.latency else {}
    scaled = {size: interleaved_latency(scaled_models(size), args.rounds, args.repeats)
              for size in (args.scale_sizes if args.latency else [])}
    for r in rows:
        if r["name"] in lat:
            r["latency_ms"] = lat[r["name"]]
    machine = {"platform": platform.platform(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "cpus": torch.get_num_threads()}
    command = ("python benchmarks/dmb.py train a & python benchmarks/dmb.py train b; "
               "python benchmarks/dmb.py train kd; python benchmarks/dmb.py report"
               f"{'' if args.latency else ' --no-latency'}")
    disk = disk_sizes(translators)
    if args.only:
        rows, disk = merge_committed(rows, disk)
        command += " --only NAME…"
    out = {"benchmark": "dmb", "command": command, "machine": machine,
           "test_set": "multi30k test_2016_flickr en->de (1000 sentences), beam 4",
           "updates": STEPS, "rows": rows, "disk_bytes": disk,
           "latency_untrained_ms": scaled}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dmb.json").write_text(json.dumps(out, indent=1))
    write_md(out)
    plot(rows)


def merge_committed(rows: list[dict], disk: dict) -> tuple[list[dict], dict]:
    """``rows`` re-measured by ``report --only`` merged into the committed ``dmb.json``: the
    other systems keep their committed BLEU/MACs rows (without their latency, which belongs to
    the run that measured it), in the order of VARIANTS followed by the int8 rows."""
    path = RESULTS / "dmb.json"
    old = json.loads(path.read_text()) if path.exists() else {"rows": [], "disk_bytes": {}}
    new = {r["name"] for r in rows}
    kept = [{k: v for k, v in r.items() if k != "latency_ms"} for r in old["rows"]
            if r["name"] not in new]
    order = [*VARIANTS, *(f"{n}_int8" for n in VARIANTS)]
    merged = sorted(kept + rows, key=lambda r: order.index(r["name"]))
    return merged, {**old.get("disk_bytes", {}), **disk}


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
    groups = {"tiny (trained)": interleaved_latency(trained, args.rounds, args.repeats)}
    for size in args.scale_sizes:
        groups[f"{size} (untrained)"] = interleaved_latency(scaled_models(size, args.int8),
                                                            args.rounds, args.repeats)
    import dynaseq  # the code timed: this checkout, or another on PYTHONPATH

    src = Path(dynaseq.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."],
                           capture_output=True, text=True).stdout.strip()
    commit += " (with uncommitted changes)" if dirty else ""
    tag = f"_{args.tag}" if args.tag else ""
    command = (f"python benchmarks/dmb.py report-latency{f' --tag {args.tag}' if tag else ''}"
               f" --rounds {args.rounds} --scale-sizes {' '.join(args.scale_sizes)}"
               f"{'' if args.int8 else ' --no-int8'}")
    out = {"benchmark": "dmb_latency", "command": command, "commit": commit,
           "machine": {"platform": platform.platform(), "torch": torch.__version__,
                       "threads": torch.get_num_threads()},
           "measured": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds,
           "repeats": args.repeats, "groups": groups,
           "target_ratios": {g: target_ratios(lat) for g, lat in groups.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"dmb_latency{tag}.json").write_text(json.dumps(out, indent=1))
    lines = ["# dmb_latency: CPU latency of a 30 → 30-token translation (ms; ratio to the "
             "dense model of the same group)", "", f"Command: `{command}`  ",
             f"Code: {commit} ({out['measured']})  ", f"Machine: {out['machine']}  ",
             f"Each group's models take turns {args.rounds} times ({args.repeats} timed "
             "decodes each after a warm-up); the median of the per-round medians. The trained "
             "models are the `report` runs (1000 updates); untrained ones have 3+3 layers, "
             "vocabulary 8000, and DMB shared parts merged."]
    for group, lat in groups.items():
        base = next(ms for name, ms in lat.items() if name.split("_")[0] == "dense"
                    and not name.endswith("int8"))
        keys = list(base)
        lines += ["", f"## {group}", "", "| model | " + " | ".join(keys) + " |",
                  "|---|" + "---:|" * len(keys)]
        for name, ms in lat.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{ms[k]} ({ms[k] / base[k]:.2f}×)" for k in keys) + " |")
        lines += ["", "| target ratio | " + " | ".join(keys) + " |",
                  "|---|" + "---:|" * len(keys)]
        for label, ratios in target_ratios(lat).items():
            lines.append(f"| {label} | " + " | ".join(f"{ratios[k]:.2f}" for k in keys) + " |")
    (RESULTS / f"dmb_latency{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


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
    curves = {name: valid_curve(run_dir(name)) for name in LONG}
    out = {"benchmark": "dmb_long", "command": "python benchmarks/dmb.py train long; "
           "python benchmarks/dmb.py report-long",
           "machine": {"platform": platform.platform(), "torch": torch.__version__},
           "test_set": "multi30k test_2016_flickr en->de (1000 sentences), beam 4", "rows": rows,
           "valid_curves": curves}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dmb_long.json").write_text(json.dumps(out, indent=1))
    lines = ["# dmb_long: Transformer vs Transformer-DMB (tiny, Multi30k en→de) by training "
             "length", "", f"Command: `{out['command']}`  ", f"Machine: {out['machine']}  ",
             f"Test set: {out['test_set']}", "",
             "| system | updates | params | #MACs | BLEU | PTR | test loss |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['updates']} | {r['params'] / 1e6:.2f}M | "
                     f"{r['macs_pair'] / 1e6:.1f}M | {r['bleu_beam4']} | {r['ptr']} | "
                     f"{r['loss']} |")
    steps = sorted({step for c in curves.values() for step in c})
    lines += ["", "## Validation by update (valid loss / greedy BLEU on 300 valid lines; from "
              "each run's log.jsonl, so a run still training shows the updates it reached)", "",
              "| update | " + " | ".join(LONG) + " |", "|---:|" + "---:|" * len(LONG)]
    for step in steps:
        cells = [f"{curves[n][step]['loss']:.3f} / {curves[n][step]['bleu']:.1f}"
                 if step in curves[n] else "" for n in LONG]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    (RESULTS / "dmb_long.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def valid_curve(run: Path) -> dict[int, dict[str, float]]:
    """Validation events of a run's log at every 200th update (the configs' valid_every):
    ``{step: {"loss", "bleu"}}``. A run stopped by a signal also logs one at the step it
    stopped at; those are left out."""
    log = run / "log.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {e["step"]: {"loss": round(e["loss"], 4), "bleu": round(e.get("bleu", float("nan")), 2)}
            for e in events if e.get("event") == "valid" and e["step"] % 200 == 0}


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


def write_md(out: dict) -> None:
    rows = {r["name"]: r for r in out["rows"]}
    dense = rows.get("dense")
    lines = ["# dmb: Transformer vs Transformer-MoE vs Transformer-DMB (tiny, Multi30k en→de)",
             "", f"Command: `{out['command']}`  ", f"Machine: {out['machine']}  ",
             f"Test set: {out['test_set']}; every model {out['updates']} updates with the same "
             "data, batch size, schedule and seed.", "",
             "#MACs: the DMB paper's convention, one 30 → 30-token pass with the output layer "
             "(Mult-Adds). PTR = BLEU / sqrt(#MACs) · 10⁴. Params: the inference model (shared "
             "part merged).", "",
             "| table | system | params | #MACs | ÷ Transformer | BLEU | PTR | steps | train min "
             "| measured |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in out["rows"]:
        ratio = f"{r['macs_pair'] / dense['macs_pair']:.4f}" if dense else ""
        lines.append(f"| {r['table']} | {r['system']} | {r['params'] / 1e6:.2f}M | "
                     f"{r['macs_pair'] / 1e6:.1f}M | {ratio} | {r['bleu_beam4']} | {r['ptr']} | "
                     f"{r['steps']} | {r['train_minutes']} | {r.get('measured', 'earlier')} |")
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
        lines += ["", "## CPU latency, 30 → 30 tokens (ms; ratio to the fp32 Transformer)", "",
                  "| system | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        for r in lat_rows:
            cells = [f"{r['latency_ms'][k]} ({r['latency_ms'][k] / base[k]:.2f}×)" if base
                     else str(r['latency_ms'][k]) for k in keys]
            lines.append(f"| {r['system']} | " + " | ".join(cells) + " |")
    for size, lat in out.get("latency_untrained_ms", {}).items():
        keys = list(next(iter(lat.values())))
        base = lat[f"dense_{size}"]
        lines += ["", f"## CPU latency at the `{size}` size, untrained, 3+3 layers (ms; ratio to "
                  "dense)", "", "| model | " + " | ".join(keys) + " |",
                  "|---|" + "---:|" * len(keys)]
        for name, ms in lat.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{ms[k]} ({ms[k] / base[k]:.2f}×)" for k in keys) + " |")
    if out.get("disk_bytes"):
        lines += ["", "## Disk size of the weights (bytes)", "", "| model | fp32 | int8 | ratio |",
                  "|---|---:|---:|---:|"]
        for name, d in out["disk_bytes"].items():
            lines.append(f"| {name} | {d['fp32']:,} | {d['int8']:,} | "
                         f"{d['int8'] / d['fp32']:.3f} |")
    (RESULTS / "dmb.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(rows: list[dict]) -> None:
    labelled_scatter([(r["name"], r["macs_pair"] / 1e6, r["bleu_beam4"]) for r in rows],
                     "#MACs of a 30 → 30-token pass (millions)",
                     "BLEU, test_2016_flickr en→de, beam 4", "dmb: BLEU vs Mult-Adds (tiny)",
                     RESULTS / "dmb.png")


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
    r.set_defaults(func=cmd_report)
    sub.add_parser("report-long").set_defaults(func=cmd_report_long)
    lat = sub.add_parser("report-latency")
    lat.add_argument("--rounds", type=int, default=5)
    lat.add_argument("--repeats", type=int, default=3)
    lat.add_argument("--scale-sizes", nargs="*", default=["small", "base"])
    lat.add_argument("--tag", default="", help="suffix of the result files, e.g. `before`")
    lat.add_argument("--no-int8", dest="int8", action="store_false",
                     help="time the untrained sizes in fp32 only")
    lat.set_defaults(func=cmd_report_latency)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
