"""Benchmark `glue`: a `small` encoder on SST-2 and CoLA dev, trained from scratch vs.
fine-tuned from an MLM pre-training on WikiText-2, with the same fine-tuning.

Issue 24's targets: pre-training adds >= 3 points on SST-2; SST-2 dev >= 84% (BERT-Mini,
4 layers d=256 pre-trained on BooksCorpus + Wikipedia: 85.9 on the test set); CoLA MCC >= 20.
On 2 CPU cores the budget is bounded: the pre-training runs ``--pretrain-minutes`` (default
15), each fine-tuning ``--finetune-minutes`` (default 10) or its update limit; the learning
curves (validation metric against updates and minutes) are committed so one can see where
each run flattens.

    python benchmarks/glue.py [--pretrain-minutes 15] [--pretrain-steps N] [--glue-text]
                              [--finetune-minutes 10] [--finetune-steps N]
                              [--precision fp32|bf16] [--report-only]

``--precision bf16`` trains every run under bfloat16 autocast (``train.precision``): on a
CPU with AVX512-BF16 an update of the pre-training takes about 0.6x the float32 time, so
the same minutes buy more updates. ``--finetune-steps`` overrides both tasks' update limit.

``--glue-text`` adds the unlabelled sentences of the SST-2 and CoLA *training* sets to the
pre-training text (issue 24 allows it; BERT's domain gap between Wikipedia and movie
reviews is what it closes): they are written, labels dropped, to
``runs/bench/glue_unlabelled.txt`` (``_lib.write_unlabelled``). Dev sentences are never
read for pre-training.

Runs: runs/bench/glue_mlm (configs/wikitext2_mlm_small.yaml), runs/bench/glue_{sst2,cola}_
{scratch,pretrained} (configs/{sst2,cola}_small.yaml). A finished run is not trained again;
one whose limits the command raises (``--pretrain-steps``, ``--pretrain-minutes``, which
count the run's minutes in all) resumes from its last checkpoint under the longer
schedule: a cosine schedule restarts at the learning rate the new length gives there.
Writes benchmarks/results/glue.{json,md,png}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _lib
import _plot

TASKS = {"sst2": ("configs/sst2_small.yaml", "accuracy"),
         "cola": ("configs/cola_small.yaml", "mcc")}
MLM = _lib.RUNS / "glue_mlm"


def run_dir(task: str, init: str) -> Path:
    return _lib.RUNS / f"glue_{task}_{init}"


def configs(pretrain_minutes: float, finetune_minutes: float, tasks: list[str],
            pretrain_steps: int | None = None, glue_text: bool = False,
            finetune_steps: int | None = None, precision: str = "fp32"):
    from dynaseq.tasks.registry import load_config

    every = [f"train.precision={precision}"]
    tune = every + ([] if finetune_steps is None else [f"train.max_steps={finetune_steps}"])
    extra = every + ([] if pretrain_steps is None else [f"train.max_steps={pretrain_steps}"])
    if glue_text:
        text = _lib.write_unlabelled({t: TASKS[t][0] for t in tasks})
        extra.append(f"data.train=[$DATA/wikitext-2/train.txt,{text}]")
    yield load_config("configs/wikitext2_mlm_small.yaml",
                      [f"run_dir={MLM}", f"train.max_minutes={pretrain_minutes}", *extra])
    for task in tasks:
        path, _ = TASKS[task]
        for init in ("scratch", "pretrained"):
            extra = [f"train.init_from={MLM}"] if init == "pretrained" else []
            yield load_config(path, [f"run_dir={run_dir(task, init)}",
                                     f"train.max_minutes={finetune_minutes}", *tune, *extra])


def curve(run: Path, metric: str) -> list[dict[str, float]]:
    """(step, minutes, metric) of each validation event."""
    out, elapsed = [], 0.0
    for rec in _lib.read_log(run, missing_ok=True):
        if rec["event"] == "train":
            elapsed = rec["elapsed_s"]
        if rec["event"] == "valid" and metric in rec:
            out.append({"step": rec["step"], "minutes": round(elapsed / 60, 2),
                        metric: round(100 * rec[metric], 2)})
    return out


def flattens(points: list[dict[str, float]], metric: str, tol: float = 0.5) -> int | str | None:
    """The first validated step within ``tol`` points of the run's best, or ``"rising"``
    when that is the last validation (the curve had not flattened; None: no curve)."""
    if not points:
        return None
    best = max(p[metric] for p in points)
    first = next(p["step"] for p in points if p[metric] >= best - tol)
    return "rising" if first == points[-1]["step"] else first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pretrain-minutes", type=float, default=15.0)
    p.add_argument("--pretrain-steps", type=int, default=None,
                   help="pre-training updates (default: the config's max_steps)")
    p.add_argument("--glue-text", action="store_true",
                   help="add the tasks' unlabelled training sentences to the pre-training text")
    p.add_argument("--finetune-minutes", type=float, default=10.0)
    p.add_argument("--finetune-steps", type=int, default=None,
                   help="fine-tuning updates (default: each task config's max_steps)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="train.precision of every run")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--report-only", action="store_true", help="only read the runs' logs")
    _lib.add_results_arg(p)
    args = p.parse_args()
    if not args.report_only:
        _lib.train_each(c for c in configs(args.pretrain_minutes, args.finetune_minutes,
                                           args.tasks, args.pretrain_steps, args.glue_text,
                                           args.finetune_steps, args.precision)
                        if not _lib.done(Path(c.run_dir), c))
    mlm = [{"step": r["step"], "minutes": round(r.get("elapsed_s", 0) / 60, 2)}
           for r in _lib.read_log(MLM, missing_ok=True) if r["event"] == "train"]
    mlm_valid = [{"step": r["step"], "loss": round(r["loss"], 4),
                  "accuracy": round(100 * r["accuracy"], 2)}
                 for r in _lib.read_log(MLM, missing_ok=True) if r["event"] == "valid"]
    rows, curves = [], {}
    for task in args.tasks:
        _, metric = TASKS[task]
        for init in ("scratch", "pretrained"):
            pts = curve(run_dir(task, init), metric)
            curves[f"{task}_{init}"] = pts
            tp = _lib.throughput(run_dir(task, init)) if pts else {}
            rows.append({"task": task, "init": init, "metric": metric,
                         "best": max((x[metric] for x in pts), default=None),
                         "final": pts[-1][metric] if pts else None,
                         "steps": tp.get("steps"), "minutes": tp.get("train_minutes"),
                         "flattens_at_step": flattens(pts, metric)})
    out = {"benchmark": "glue", "command": _lib.command(), "date": time.strftime("%Y-%m-%d"),
           "machine": _lib.machine(processor=True),
           "setup": {"model": "small encoder: d=256, ffn 1024, 4 heads, 4 layers, pre-LN, "
                              "learned positions, max 128",
                     "pretraining": "MLM on WikiText-2 train" + (
                         " + the SST-2 and CoLA training sentences (labels dropped)"
                         if args.glue_text else "") + ", blocks of 128, batch 16, at most "
                         f"{args.pretrain_minutes} min" + (
                         "" if args.pretrain_steps is None
                         else f" and {args.pretrain_steps} updates (cosine schedule)")
                         + f", precision {args.precision}",
                     "finetuning": f"same for both inits: configs/{{sst2,cola}}_small.yaml, "
                                   f"at most {args.finetune_minutes} min each"
                                   + ("" if args.finetune_steps is None
                                      else f" and {args.finetune_steps} updates")
                                   + f", precision {args.precision}; metric on the "
                                   "whole dev set (best of the validations kept)"},
           "pretraining": {"updates": mlm[-1]["step"] if mlm else None,
                           "minutes": mlm[-1]["minutes"] if mlm else None,
                           "valid": mlm_valid},
           "rows": rows, "curves": curves}
    lines = markdown(out)
    _lib.write_results(args.results, "glue", out, lines)
    print("\n".join(lines))
    plot(curves, args.results / "glue.png")


def markdown(out: dict) -> list[str]:
    pre = out["pretraining"]
    last = pre["valid"][-1] if pre["valid"] else {}
    lines = _lib.md_head(
        "GLUE dev: small encoder, from scratch vs MLM-pretrained on WikiText-2", out["command"],
        f"Machine: {out['machine']}. Date {out['date']}.",
        f"Pre-training: {out['setup']['pretraining']}; {pre['updates']} updates in "
        f"{pre['minutes']} min; valid masked-token loss {last.get('loss')}, accuracy "
        f"{last.get('accuracy')}% (WikiText-2 valid).",
        "Targets (issue 24): SST-2 >= 84, pre-training +3 on SST-2, CoLA MCC >= 20.",
        "For scale, Google's BERT miniatures (Turc et al. 2019; fine-tuned 4 epochs, best of "
        "20 settings; GLUE *test* set): BERT-Mini, this encoder's shape (4 layers, d=256) "
        "pre-trained on BooksCorpus + Wikipedia, SST-2 85.9 and CoLA MCC 0.0; BERT-Small "
        "(4 layers, d=512) CoLA 27.8.")
    lines += _lib.md_table(
        ["task", "init", "metric", "best", "final", "updates", "minutes", "flattens at step"],
        "lllrrrrr",
        [[r["task"], r["init"], r["metric"], r["best"], r["final"], r["steps"], r["minutes"],
          r["flattens_at_step"]] for r in out["rows"]])
    lines += ["", "Learning curves (dev metric x 100 per validation): `glue.json` -> `curves`; "
                  "plot `glue.png`. `flattens at step`: first validation within 0.5 points of "
                  "the run's best (`rising`: only the last one, the curve had not flattened)."]
    return lines


def plot(curves: dict[str, list[dict[str, float]]], path: Path) -> None:
    plt = _plot.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, task in zip(axes, TASKS, strict=False):
        metric = TASKS[task][1]
        for init in ("scratch", "pretrained"):
            pts = curves.get(f"{task}_{init}", [])
            if pts:
                ax.plot([x["step"] for x in pts], [x[metric] for x in pts], marker=".",
                        label=init)
        ax.set_title(f"{task} dev")
        ax.set_xlabel("updates")
        ax.set_ylabel(metric + " x 100")
        ax.legend()
    _plot.save(fig, path)


if __name__ == "__main__":
    main()
