"""Benchmark `cct_bert`: one CCT-BERT at budgets {.8 (full), .5, .33, .2} against dense
encoders shrunk in depth and in width to about the same MACs, each MLM-pre-trained on
WikiText-2 and fine-tuned on SST-2 and CoLA with the same updates (Bapna et al. 2020, sec. 5
and fig. 6), and the classification wall time at each budget.

Issue 24's targets: the full budget (.8) within 1 point of the dense encoder of its size; at
.5 and .33 above the shrunk encoders of equal realized MACs; wall time at each budget, batch
1 and batch 32, as a ratio to the full budget in one run.

Every encoder (benchmarks/variants/cct_bert.yaml) is pre-trained `--pretrain-steps` updates
with configs/wikitext2_mlm_small.yaml and fine-tuned `--finetune-steps` updates per task with
configs/{sst2,cola}_small.yaml (the CCT with its section added, λ 0.05 when fine-tuning), the
same data, schedule and seed. A finished run is not trained again.

Scores are on each task's whole dev set (batches of 32), from the run's kept checkpoint
(``dynaseq.load``: the best validation). The CCT runs each budget two ways: with its trained
control symbol as is, and calibrated (one gate offset per budget fitted on the first
`--calibration-rows` rows of the task's *training* set so that the realized compute meets
the budget). Its realized fraction is measured on the first `--fraction-rows` dev rows. Both
count each row over its own tokens, as one row alone would (the lean pass leaves the
batch's padding out), in batches of 32. Each target's comparison comes with the
95% paired-bootstrap interval of its score difference over the dev rows (``scipy``), from
each row's prediction.

Layer MACs per token: attention (q/k/v/out, scores and values) and FFN, plus the CCT's
control nets, from :func:`dynaseq.metrics.encoder_profile.encoder_macs` summed over the dev
rows at their own lengths and divided by their tokens; embeddings and heads excluded (the same
for every encoder of a width). For the CCT, that count with every gate on times the realized
fraction (the MACs its gated sub-layers really ran).

Wall time: `Classifier.classify_rows` on the first `--time-rows` dev rows one at a time
(batch 1) and on every dev row in batches of 32, each budget and the dense encoder taking
turns in `--rounds` rounds (medians), as ratios to the full budget's time. Classification
runs the lean encoder pass (`dynaseq.models.lean_encoder`); the CCT at the full budget and
the dense encoder also run through the model's own forward pass ("general") in the same
rounds.

    python benchmarks/cct_bert.py [--pretrain-steps 800] [--pretrain-batch 16]
                                  [--finetune-steps 600] [--rounds 3] [--precision fp32]
                                  [--only cct dense ...] [--tasks sst2 cola] [--report-only]
                                  [--glue-text] [--retime]
                                  [--train-only | --pretrain-only]
                                  [--parallel 1]

Runs: runs/bench/cct_bert/{model}_mlm and {model}_{task}. Writes
benchmarks/results/cct_bert.{json,md,png}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import _lib
import _plot

GLUE = Path("$DATA/glue")  # under the data root (dynaseq.data.datasets.data_root)
TASKS = {"sst2": {"config": "configs/sst2_small.yaml", "metric": "accuracy",
                  "dir": "SST-2", "header": True},
         "cola": {"config": "configs/cola_small.yaml", "metric": "mcc", "dir": "CoLA",
                  "header": False}}
MODELS: dict[str, dict] = _lib.registry("cct_bert", "models", ("label", "family", "overrides"))
CCT_SECTION: str = _lib.variants_file("cct_bert")["cct_section"]
BUDGETS = [0.8, 0.5, 0.33, 0.2]
FULL = BUDGETS[0]
RUNS = _lib.RUNS / "cct_bert"


def glue(task: str, split: str) -> Path:
    """The GLUE file ``split`` (``dev`` or ``train``) of ``task`` under the data root."""
    from dynaseq.data.datasets import resolve_data_path

    return resolve_data_path(f"{GLUE}/{TASKS[task]['dir']}/{split}.tsv")


def run_dir(model: str, stage: str, root: Path = RUNS) -> Path:
    """``stage``: ``mlm`` (pre-training) or a task name (fine-tuning)."""
    return Path(root) / f"{model}_{stage}"


def model_overrides(name: str) -> list[str]:
    spec = MODELS[name]
    return [*([CCT_SECTION] if spec["family"] == "cct" else []), *spec["overrides"]]


def configs(models: list[str], tasks: list[str], args: argparse.Namespace):
    """Each model's pre-training, then its fine-tunings, in ``models`` order."""
    from dynaseq.tasks.registry import load_config

    for name in models:
        model, mlm = model_overrides(name), run_dir(name, "mlm", args.runs)
        batch = [] if args.pretrain_batch is None else [f"data.batch_size={args.pretrain_batch}"]
        every = [f"train.precision={args.precision}", "train.max_minutes=600"]
        text = []
        if args.glue_text:
            glue_text = Path(args.runs) / _lib.UNLABELLED.name
            text = [f"data.train=[$DATA/wikitext-2/train.txt,{glue_text}]"]
            if not _lib.finished(mlm, args.pretrain_steps):  # written where it pre-trains
                _lib.write_unlabelled({t: TASKS[t]["config"] for t in TASKS}, glue_text)
        yield load_config("configs/wikitext2_mlm_small.yaml", [
            f"run_dir={mlm}", f"train.max_steps={args.pretrain_steps}", *every, *batch,
            *text, *model])
        for task in tasks:
            yield load_config(TASKS[task]["config"], [
                f"run_dir={run_dir(name, task, args.runs)}", f"train.init_from={mlm}",
                f"train.max_steps={args.finetune_steps}", *every, *model,
                *MODELS[name].get("finetune", [])])


def layer_macs(model: Any, lengths: list[int]) -> float:
    """Attention + FFN MACs per token (every gate on) over rows of ``lengths`` tokens."""
    from dynaseq.metrics.encoder_profile import encoder_macs

    total = 0
    for s, n in Counter(lengths).items():
        parts = encoder_macs(model, s)
        total += n * sum(v for k, v in parts.items() if k.startswith(("self_attn.", "ffn.")))
    return total / sum(lengths)


def measure_task(task: str, models: list[str], args: argparse.Namespace) -> dict:
    """Scores, layer MACs and training cost of every finished run of ``task``, and the
    interleaved wall times of the CCT's budgets and the dense encoder."""
    import dynaseq
    from dynaseq.tasks.classify.glue import read_table

    metric, dev, train_tsv = TASKS[task]["metric"], glue(task, "dev"), glue(task, "train")
    rows, loaded, preds, layout = [], {}, {}, None
    for name in models:
        run = run_dir(name, task, args.runs)
        if not _lib.finished(run):
            print(f"-- {name} {task}: no finished run at {run}, skipped", flush=True)
            continue
        c = dynaseq.load(run)
        table = read_table(dev, c.layout)
        encoded = c.encode(list(table.text_a))[0]
        loaded[name], layout, gold = (c, encoded), c.layout, table.targets()  # gold: one dev set
        full_macs = layer_macs(c.model, [len(ids) for ids, _ in encoded])
        spec = MODELS[name]
        base = {"model": name, "label": spec["label"], "family": spec["family"],
                "params": sum(p.numel() for p in c.model.parameters()),
                "pretrain": _lib.throughput(run_dir(name, "mlm", args.runs)),
                "finetune": _lib.throughput(run)}
        if spec["family"] != "cct":
            res = c.evaluate(dev, batch_size=32)
            rows.append({**base, "score": round(100 * res[metric], 2),
                         "layer_macs_per_token": round(full_macs)})
            preds[row_key(rows[-1])] = c.classify_rows(encoded, batch_size=32)
            continue
        dev_lines = dev.read_text(encoding="utf-8").splitlines(keepends=True)
        header = 1 if TASKS[task]["header"] else 0
        with tempfile.TemporaryDirectory() as tmp:
            head = Path(tmp) / "dev_head.tsv"  # the first dev rows, for the batch-1 fraction
            _lib.write_atomic(head, "".join(dev_lines[:header + args.fraction_rows]))
            for calibrated in (False, True):
                if calibrated:
                    c.calibrate(train_tsv, BUDGETS, lines=args.calibration_rows)
                else:
                    c.calibrations = []
                for b in BUDGETS:
                    res = c.evaluate(dev, budget=b, batch_size=32)
                    frac = float(c.evaluate(head, budget=b, batch_size=32)["realized_fraction"])
                    rows.append({**base, "budget": b, "calibrated": calibrated,
                                 "score": round(100 * res[metric], 2),
                                 "realized_fraction": round(frac, 4),
                                 "layer_macs_per_token": round(full_macs * frac)})
                    preds[row_key(rows[-1])] = c.classify_rows(encoded, budget=b,
                                                               batch_size=32)
    timing = (time_budgets(loaded, args)
              if {"cct", "dense"} <= set(loaded) and args.rounds else {})
    res = {"metric": metric, "rows": rows, "timing": timing}
    if layout is None:
        return {**res, "targets": {}}
    return {**res, "targets": targets(res, partial(difference_ci, layout, metric, gold, preds))}


def row_key(row: dict) -> str:
    """A result row's name: the model, and for the CCT its budget and calibration."""
    if "budget" not in row:
        return row["model"]
    return f"{row['model']}@{row['budget']:g}{' calibrated' if row['calibrated'] else ''}"


def difference_ci(layout: Any, metric: str, gold: list, preds: dict[str, list], a: dict,
                  b: dict) -> list[float]:
    """95% paired-bootstrap interval (x 100) of row ``a``'s score minus row ``b``'s over the
    dev rows (:func:`_lib.paired_diff_ci`, from each row's predictions in ``preds``): whether
    a difference is more than the draw of the dev set's rows."""
    from dynaseq.tasks.classify.predictor import task_metrics

    lo, hi = _lib.paired_diff_ci(lambda g, p: task_metrics(layout, g, p)[metric], gold,
                                 preds[row_key(a)], preds[row_key(b)])
    return [round(100 * lo, 2), round(100 * hi, 2)]


def time_budgets(loaded: dict[str, tuple[Any, list]], args: argparse.Namespace) -> dict:
    """Median seconds of the calibrated CCT at each budget and of the dense encoder
    (``loaded``: name -> (classifier, its encoded dev rows)), batch 1 (the first
    ``--time-rows`` rows one at a time) and batch 32 (every row), the systems taking turns;
    and each as a ratio to the full budget."""
    def classify(c: Any, rows: list, b: float | None, n: int, lean: bool) -> None:
        c.fast_encode = lean
        c.classify_rows(rows, budget=b, batch_size=n)

    out = {}
    for batch in (1, 32):
        fns = {}
        for name in ("cct", "dense"):
            c, rows = loaded[name]
            rows = rows[:args.time_rows] if batch == 1 else rows
            for b in (BUDGETS if name == "cct" else [None]):
                fns[f"cct {b:g}" if b else "dense"] = partial(classify, c, rows, b, batch, True)
            # the model's own forward pass (the lean encoder off), at the full budget
            fns[f"cct {FULL:g} general" if name == "cct" else "dense general"] = partial(
                classify, c, rows, FULL if name == "cct" else None, batch, False)
        sec = _lib.interleaved_seconds(fns, args.rounds)
        full = sec[f"cct {FULL:g}"]
        out[f"batch_{batch}"] = {k: {"seconds": round(v, 4), "ratio_to_full": round(v / full, 3)}
                                 for k, v in sec.items()}
    return out


def retime(args: argparse.Namespace) -> dict:
    """The committed results (``RESULTS/cct_bert.json``) with each task's wall times measured
    again (:func:`time_budgets`, the CCT calibrated as :func:`measure_task` calibrates it);
    scores and fractions are kept, and ``retimed`` records what measured the times."""
    import json

    import dynaseq
    from dynaseq.tasks.classify.glue import read_table

    out = json.loads((args.results / "cct_bert.json").read_text())
    for task in args.tasks:
        dev, train_tsv = glue(task, "dev"), glue(task, "train")
        loaded = {}
        for name in ("cct", "dense"):
            c = dynaseq.load(run_dir(name, task, args.runs))
            loaded[name] = (c, c.encode(list(read_table(dev, c.layout).text_a))[0])
        loaded["cct"][0].calibrate(train_tsv, BUDGETS, lines=args.calibration_rows)
        out["tasks"][task]["timing"] = time_budgets(loaded, args)
    out["retimed"] = {"command": _lib.command(), "machine": _lib.machine(processor=True),
                      "provenance": _lib.provenance(), "rounds": args.rounds}
    return out


def curves(args: argparse.Namespace) -> dict:
    """Every run's validation curve from its ``log.jsonl`` (finished or not): for each model,
    pre-training steps -> masked-token loss and accuracy (the CCT's at the full budget), and
    each task's fine-tuning steps -> its dev metric. Where a time limit stopped a run, its
    curve shows how far it got."""
    out: dict[str, Any] = {}
    for name in args.only:
        stages = {"mlm": ("loss", "accuracy"),
                  **{t: (TASKS[t]["metric"],) for t in args.tasks}}
        for stage, keys in stages.items():
            events = [e for e in _lib.read_log(run_dir(name, stage, args.runs), missing_ok=True)
                      if e["event"] == "valid"]
            out.setdefault(name, {})[stage] = {
                int(e["step"]): {k: round(float(e.get(k, 0.0)), 4) for k in keys}
                for e in events}
    return out


def curves_markdown(out: dict, every: int) -> list[str]:
    """One table per stage: a row per model, its validation value every ``every`` steps."""
    lines = _lib.md_head("cct_bert: validation curves of every run", out["command"],
                         f"Machine: {out['machine']}. Date {out['date']}.",
                         "Pre-training: valid masked-token loss (accuracy %); fine-tuning: the "
                         "task's dev metric x 100. Blank: not reached (a stopped run).")
    stages = list(next(iter(out["curves"].values()), {}))
    for stage in stages:
        steps = sorted({s for m in out["curves"].values() for s in m[stage]
                        if s % every == 0})
        rows = []
        for name, by_stage in out["curves"].items():
            cells = []
            for s in steps:
                v = by_stage[stage].get(s)
                if v is None:
                    cells.append("")
                elif stage == "mlm":
                    cells.append(f"{v['loss']:.2f} ({100 * v['accuracy']:.1f})")
                else:
                    cells.append(f"{100 * next(iter(v.values())):.1f}")
            rows.append([MODELS[name]["label"], *cells])
        lines += ["", f"## {stage}", ""]
        lines += _lib.md_table(["encoder", *map(str, steps)], "l" + "r" * len(steps), rows)
    return lines


def targets(task: dict,
            diff_ci: Callable[[dict, dict], list[float]] | None = None) -> dict:
    """Issue 24's quality targets for one task's rows (calibrated CCT budgets); with
    ``diff_ci(row_a, row_b)`` (:func:`difference_ci`), each comparison also gets the 95%
    interval of its difference."""
    cct = {r["budget"]: r for r in task["rows"] if r["family"] == "cct" and r["calibrated"]}
    dense = next((r for r in task["rows"] if r["family"] == "dense"), None)
    out: dict[str, Any] = {}
    if FULL in cct and dense:
        gap = round(cct[FULL]["score"] - dense["score"], 2)
        out["full_within_1_of_dense"] = {"cct": cct[FULL]["score"], "dense": dense["score"],
                                         "difference": gap, "met": gap >= -1.0}
        if diff_ci is not None:
            out["full_within_1_of_dense"]["difference_ci95"] = diff_ci(cct[FULL], dense)
    for b in (0.5, 0.33):
        if b not in cct:
            continue
        mine = cct[b]
        for family in ("depth", "width"):
            shrunk = [r for r in task["rows"] if r["family"] == family]
            if not shrunk:
                continue
            near = min(shrunk, key=lambda r: abs(r["layer_macs_per_token"]
                                                 - mine["layer_macs_per_token"]))
            out[f"{b:g}_above_{family}"] = {
                "cct": mine["score"], "shrunk": near["model"], "shrunk_score": near["score"],
                "macs_ratio_cct_over_shrunk": round(mine["layer_macs_per_token"]
                                                    / near["layer_macs_per_token"], 3),
                "met": mine["score"] > near["score"]}
            if diff_ci is not None:
                out[f"{b:g}_above_{family}"]["difference_ci95"] = diff_ci(mine, near)
    return out


def markdown(out: dict) -> list[str]:
    lines = _lib.md_head(
        "cct_bert: one CCT-BERT at several budgets vs dense encoders shrunk in depth and "
        "width (SST-2, CoLA dev)", out["command"],
        f"Machine: {out['machine']}. Date {out['date']}.",
        f"Training: every encoder {out['pretrain_steps']} MLM updates of "
        f"{out.get('pretrain_batch') or 16} blocks on WikiText-2"
        f"{' and the SST-2/CoLA training sentences' if out.get('glue_text') else ''}, precision "
        f"{out.get('precision', 'fp32')} "
        f"(configs/wikitext2_mlm_small.yaml), then {out['finetune_steps']} fine-tuning "
        "updates per task (configs/{sst2,cola}_small.yaml); same data, schedule and seed.",
        "Targets (issue 24): CCT at the full budget (.8) within 1 point of the dense encoder; "
        "at .5 and .33 above the shrunk encoder of the nearest layer MACs, in depth and in "
        "width. `difference_ci95`: the 95% paired-bootstrap interval of the CCT's score minus "
        "the other's over the dev rows (1000 resamples).")
    if "retimed" in out:
        r = out["retimed"]
        lines += ["", f"Wall times measured again by `{r['command']}` (code "
                      f"{r['provenance']['commit']}, {r['provenance']['date']} UTC; machine "
                      f"{r['machine']}): scores and fractions are those above."]
    for task, res in out["tasks"].items():
        lines += ["", f"## {task} (dev, {res['metric']} x 100)", ""]
        lines += _lib.md_table(
            ["encoder", "budget", "calibrated", "score", "realized fraction",
             "layer MACs/token", "÷ dense", "params", "pre-train min", "fine-tune min"],
            "llllrrrrrr",
            [[r["label"], r.get("budget", ""), {True: "yes", False: "no"}.get(
                r.get("calibrated"), ""), r["score"], r.get("realized_fraction", ""),
              f"{r['layer_macs_per_token'] / 1e3:.1f}K",
              _ratio(r, res["rows"]), f"{r['params']:,}", r["pretrain"]["train_minutes"],
              r["finetune"]["train_minutes"]] for r in res["rows"]])
        if res["targets"]:
            lines += ["", "Targets:", ""]
            lines += [f"- `{k}`: {v}" for k, v in res["targets"].items()]
        rounds = out.get("retimed", out)["rounds"]
        for batch, t in res["timing"].items():
            lines += ["", f"Wall time, {batch.replace('_', ' ')} (interleaved, median of "
                      f"{rounds} rounds; ratio to the CCT at {FULL:g}): "
                      + ", ".join(f"{k} {v['ratio_to_full']} ({v['seconds']} s)"
                                  for k, v in t.items())]
    return lines


def _ratio(row: dict, rows: list[dict]) -> str:
    dense = next((r for r in rows if r["family"] == "dense"), None)
    return f"{row['layer_macs_per_token'] / dense['layer_macs_per_token']:.3f}" if dense else ""


def plot(out: dict, path: Path) -> None:
    """Score against realized layer MACs per token, one panel per task (fig. 6's axes)."""
    plt = _plot.pyplot()
    fig, axes = plt.subplots(1, len(out["tasks"]), figsize=(5 * len(out["tasks"]), 4),
                             squeeze=False)
    for ax, (task, res) in zip(axes[0], out["tasks"].items(), strict=True):
        series = {"CCT-BERT (calibrated)": [r for r in res["rows"] if r.get("calibrated")],
                  "CCT-BERT (trained symbols)": [r for r in res["rows"]
                                                 if r.get("calibrated") is False],
                  "shrunk in depth": [r for r in res["rows"] if r["family"] == "depth"],
                  "shrunk in width": [r for r in res["rows"] if r["family"] == "width"],
                  "dense": [r for r in res["rows"] if r["family"] == "dense"]}
        for label, pts in series.items():
            pts = sorted(pts, key=lambda r: r["layer_macs_per_token"])
            if pts:
                ax.plot([r["layer_macs_per_token"] / 1e3 for r in pts],
                        [r["score"] for r in pts], marker="o", label=label)
        ax.set_title(f"{task} dev")
        ax.set_xlabel("layer MACs per token (thousands; CCT: realized)")
        ax.set_ylabel(f"{res['metric']} x 100")
        ax.legend(fontsize=7)
    _plot.save(fig, path)


def train_parallel(args: argparse.Namespace) -> None:
    """Train every model's runs in processes of their own, ``args.parallel`` at a time
    (:func:`_lib.run_parallel`): first each model's pre-training, then each of its
    fine-tunings (one process per model and task); each is this script again with ``--only
    MODEL --train-only``, its output in ``{runs}/{job}.out``."""
    same = [sys.executable, __file__, "--train-only", "--pretrain-steps",
            str(args.pretrain_steps), "--finetune-steps", str(args.finetune_steps), "--runs",
            str(args.runs), "--precision", args.precision,
            *(["--glue-text"] if args.glue_text else []),
            *([] if args.pretrain_batch is None
              else ["--pretrain-batch", str(args.pretrain_batch)])]
    _lib.run_parallel({f"{name}_mlm": [*same, "--only", name, "--pretrain-only"]
                       for name in args.only}, args.parallel, Path(args.runs))
    if not args.pretrain_only:
        _lib.run_parallel({f"{name}_{task}": [*same, "--only", name, "--tasks", task]
                           for name in args.only for task in args.tasks},
                          args.parallel, Path(args.runs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pretrain-steps", type=int, default=800)
    p.add_argument("--pretrain-batch", type=int, default=None,
                   help="pre-training blocks per update (default: the config's, 16); on a "
                        "GPU a larger batch costs little more time per update")
    p.add_argument("--finetune-steps", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of the wall times (0: none, e.g. on a GPU whose "
                        "times are not the CPU's the issue asks for)")
    p.add_argument("--calibration-rows", type=int, default=300,
                   help="training rows each CCT budget's gate offset is fitted on")
    p.add_argument("--fraction-rows", type=int, default=300,
                   help="dev rows the CCT's realized fraction is measured on")
    p.add_argument("--time-rows", type=int, default=100,
                   help="dev rows classified one at a time for the batch-1 wall time")
    p.add_argument("--only", nargs="+", choices=list(MODELS), default=list(MODELS),
                   help="train and report these encoders only")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="train.precision of every run (bf16: autocast, on a GPU)")
    p.add_argument("--glue-text", action="store_true",
                   help="pre-train on WikiText-2 and the unlabelled SST-2 and CoLA training "
                        "sentences (dev sentences are never read), as glue.py --glue-text")
    p.add_argument("--report-only", action="store_true", help="train nothing")
    p.add_argument("--train-only", action="store_true", help="measure nothing")
    p.add_argument("--pretrain-only", action="store_true",
                   help="train the pre-trainings only (implies --train-only)")
    p.add_argument("--parallel", type=int, default=1,
                   help="train this many models' runs at once, each in its own process "
                        "(for an accelerator; default 1)")
    p.add_argument("--retime", action="store_true",
                   help="train nothing, measure only the wall times again (into the "
                        "committed results)")
    p.add_argument("--curves", type=int, default=None, metavar="EVERY",
                   help="train nothing, write every run's validation curve (finished or "
                        "not, from its log) every EVERY steps to cct_bert_curves.{json,md}")
    p.add_argument("--runs", type=Path, default=RUNS, help=f"where the runs live ({RUNS})")
    _lib.add_results_arg(p)
    args = p.parse_args()
    if args.rounds < 0 or (args.retime and not args.rounds):
        p.error(f"--rounds must be at least {1 if args.retime else 0}, got {args.rounds}")
    if args.retime:
        out = retime(args)
        lines = markdown(out)
        _lib.write_results(args.results, "cct_bert", out, lines)
        print("\n".join(lines))
        return
    if args.curves is not None:
        if args.curves < 1:
            p.error(f"--curves must be at least 1, got {args.curves}")
        out = {"benchmark": "cct_bert_curves", "command": _lib.command(),
               "date": time.strftime("%Y-%m-%d"), "machine": _lib.machine(processor=True),
               "provenance": _lib.provenance(), "curves": curves(args)}
        lines = curves_markdown(out, args.curves)
        _lib.write_results(args.results, "cct_bert_curves", out, lines)
        print("\n".join(lines))
        return
    if args.parallel < 1:
        p.error(f"--parallel must be at least 1, got {args.parallel}")
    if args.parallel > 1 and not args.report_only:
        train_parallel(args)
    elif not args.report_only:
        tasks = [] if args.pretrain_only else args.tasks
        _lib.train_each(c for c in configs(args.only, tasks, args)
                        if not _lib.finished(Path(c.run_dir), args.pretrain_steps
                                             if c.run_dir.endswith("_mlm")
                                             else args.finetune_steps))
    if args.train_only or args.pretrain_only:
        return
    tasks = {}
    for task in args.tasks:
        tasks[task] = measure_task(task, args.only, args)
    out = {"benchmark": "cct_bert", "command": _lib.command(),
           "date": time.strftime("%Y-%m-%d"), "machine": _lib.machine(processor=True),
           "provenance": _lib.provenance(), "pretrain_steps": args.pretrain_steps,
           "pretrain_batch": args.pretrain_batch, "precision": args.precision,
           "glue_text": args.glue_text,
           "finetune_steps": args.finetune_steps, "rounds": args.rounds,
           "calibration": f"first {args.calibration_rows} rows of each task's train.tsv, "
                          "each over its own tokens",
           "realized_fraction": f"first {args.fraction_rows} dev rows, each over its own "
                                "tokens",
           "tasks": tasks}
    lines = markdown(out)
    _lib.write_results(args.results, "cct_bert", out, lines)
    print("\n".join(lines))
    plot(out, args.results / "cct_bert.png")


if __name__ == "__main__":
    main()
