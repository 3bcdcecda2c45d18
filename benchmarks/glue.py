"""Benchmark `glue`: a `small` encoder on SST-2 and CoLA dev, trained from scratch vs.
fine-tuned from an MLM pre-training on WikiText-2, with the same fine-tuning.

Issue 24's targets: pre-training adds >= 3 points on SST-2; SST-2 dev >= 84% (BERT-Mini,
4 layers d=256 pre-trained on BooksCorpus + Wikipedia: 85.9 on the test set); CoLA MCC >= 20.
On 2 CPU cores the budget is bounded: the pre-training runs ``--pretrain-minutes`` (default
15), each fine-tuning ``--finetune-minutes`` (default 10) or its update limit; the learning
curves (validation metric against updates and minutes) are committed so one can see where
each run flattens.

    python benchmarks/glue.py [--pretrain-minutes 15] [--pretrain-steps N] [--glue-text]
                              [--pretrain-batch 16] [--finetune-minutes 10]
                              [--finetune-steps N] [--precision fp32|bf16] [--runs DIR]
                              [--parallel 1] [--pretrain-only | --train-only | --report-only]

``--precision bf16`` trains every run under bfloat16 autocast (``train.precision``): on a
CPU with AVX512-BF16 an update of the pre-training takes about 0.6x the float32 time, so
the same minutes buy more updates. ``--finetune-steps`` overrides both tasks' update limit.
``--pretrain-batch`` sets the pre-training's blocks per update (16 in the config): on a GPU a
larger batch costs little more time per update, so the same minutes see more text.
``--parallel N`` fine-tunes N runs at a time, each in a process of its own (for a GPU; on 2
CPU cores keep 1), once the pre-training is done.

``--glue-text`` adds the unlabelled sentences of the SST-2 and CoLA *training* sets to the
pre-training text (issue 24 allows it; BERT's domain gap between Wikipedia and movie
reviews is what it closes): both tasks' sentences, whichever tasks the command fine-tunes,
are written, labels dropped, to ``glue_unlabelled.txt`` under ``--runs``
(``_lib.write_unlabelled``). Dev sentences are never read for pre-training.

Runs (under ``--runs``, default runs/bench): glue_mlm (configs/wikitext2_mlm_small.yaml),
glue_{sst2,cola}_{scratch,pretrained} (configs/{sst2,cola}_small.yaml). A finished run is
not trained again; one whose limits the command raises (``--pretrain-steps``,
``--pretrain-minutes``, which count the run's minutes in all) resumes from its last
checkpoint under the longer schedule: a cosine schedule restarts at the learning rate the
new length gives there.
Writes benchmarks/results/glue.{json,md,png}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _lib
import _plot

TASKS = {"sst2": ("configs/sst2_small.yaml", "accuracy"),
         "cola": ("configs/cola_small.yaml", "mcc")}
INITS = ("scratch", "pretrained")


def mlm_dir(runs: Path) -> Path:
    return Path(runs) / "glue_mlm"


def run_dir(task: str, init: str, runs: Path = _lib.RUNS) -> Path:
    return Path(runs) / f"glue_{task}_{init}"


def pretrain_config(args: argparse.Namespace, write_text: bool = True):
    """The MLM pre-training's run config. With ``--glue-text`` its text includes every
    task's unlabelled training sentences, whichever tasks this command fine-tunes, so that
    one pre-training serves them all; ``write_text`` writes that file (only a run about to
    pre-train needs it)."""
    from dynaseq.tasks.registry import load_config

    extra = [f"train.precision={args.precision}"]
    if args.pretrain_steps is not None:
        extra.append(f"train.max_steps={args.pretrain_steps}")
    if args.pretrain_batch is not None:
        extra.append(f"data.batch_size={args.pretrain_batch}")
    if args.glue_text:
        text = Path(args.runs) / _lib.UNLABELLED.name
        if write_text:
            _lib.write_unlabelled({t: TASKS[t][0] for t in TASKS}, text)
        extra.append(f"data.train=[$DATA/wikitext-2/train.txt,{text}]")
    return load_config("configs/wikitext2_mlm_small.yaml",
                       [f"run_dir={mlm_dir(args.runs)}",
                        f"train.max_minutes={args.pretrain_minutes}", *extra])


def finetune_config(args: argparse.Namespace, task: str, init: str):
    """The fine-tuning run config of ``task`` from ``init`` (scratch or the pre-training)."""
    from dynaseq.tasks.registry import load_config

    extra = [f"train.precision={args.precision}"]
    if args.finetune_steps is not None:
        extra.append(f"train.max_steps={args.finetune_steps}")
    if init == "pretrained":
        extra.append(f"train.init_from={mlm_dir(args.runs)}")
    return load_config(TASKS[task][0], [f"run_dir={run_dir(task, init, args.runs)}",
                                        f"train.max_minutes={args.finetune_minutes}", *extra])


def finetune_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """One command per fine-tuning run (this script again, ``--train-only`` for one task
    and one init, the same limits), for :func:`_lib.run_parallel`."""
    same = ["--runs", str(args.runs), "--pretrain-minutes", str(args.pretrain_minutes),
            "--finetune-minutes", str(args.finetune_minutes), "--precision", args.precision]
    for flag, value in (("--pretrain-steps", args.pretrain_steps),
                        ("--pretrain-batch", args.pretrain_batch),
                        ("--finetune-steps", args.finetune_steps)):
        same += [] if value is None else [flag, str(value)]
    same += ["--glue-text"] if args.glue_text else []
    return {f"glue_{task}_{init}": [sys.executable, __file__, *same, "--tasks", task,
                                    "--inits", init, "--train-only"]
            for task in args.tasks for init in args.inits}


def train(args: argparse.Namespace) -> None:
    """Pre-train (in this process), then fine-tune each task from each init, one after
    the other or ``--parallel`` at a time; a finished run is not trained again."""
    pre = pretrain_config(args, write_text=False)
    if not _lib.done(mlm_dir(args.runs), pre):  # (a fine-tuning process skips this)
        _lib.train_each([pretrain_config(args)])
    if args.pretrain_only:
        return
    if args.parallel > 1:
        _lib.run_parallel(finetune_commands(args), args.parallel, Path(args.runs))
        return
    _lib.train_each(c for c in (finetune_config(args, t, i)
                                for t in args.tasks for i in args.inits)
                    if not _lib.done(Path(c.run_dir), c))


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


def pretraining_text(args: argparse.Namespace) -> str:
    """What the pre-training was, read from its run's saved config (so that a
    ``--report-only`` needs none of the training options again); from ``args`` when the run
    has no config yet."""
    from dynaseq.tasks.registry import load_config

    saved = mlm_dir(args.runs) / "config.yaml"
    cfg = (load_config(str(saved), []) if saved.exists()
           else pretrain_config(args, write_text=False))
    return ("MLM on WikiText-2 train" + (" + the SST-2 and CoLA training sentences (labels "
                                          "dropped)" if len(cfg.data.train) > 1 else "")
            + f", blocks of 128, batch {cfg.data.batch_size}, at most "
            f"{cfg.train.max_minutes} min and {cfg.train.max_steps} updates (cosine "
            f"schedule), precision {cfg.train.precision}")


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
    p.add_argument("--pretrain-batch", type=int, default=None,
                   help="pre-training blocks per update (default: the config's, 16)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--inits", nargs="+", default=list(INITS), choices=INITS)
    p.add_argument("--runs", type=Path, default=_lib.RUNS,
                   help=f"where the runs live ({_lib.RUNS})")
    p.add_argument("--parallel", type=int, default=1,
                   help="fine-tunings at a time, each in its own process (default 1)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--report-only", action="store_true", help="only read the runs' logs")
    stop.add_argument("--train-only", action="store_true", help="write no report")
    stop.add_argument("--pretrain-only", action="store_true",
                      help="train the pre-training only; write no report")
    _lib.add_results_arg(p)
    args = p.parse_args()
    if args.parallel < 1:
        p.error(f"--parallel must be at least 1, got {args.parallel}")
    if args.pretrain_batch is not None and args.pretrain_batch < 1:
        p.error(f"--pretrain-batch must be at least 1, got {args.pretrain_batch}")
    if not args.report_only:
        train(args)
    if args.train_only or args.pretrain_only:
        return
    mlm_run = mlm_dir(args.runs)
    mlm = [{"step": r["step"], "minutes": round(r.get("elapsed_s", 0) / 60, 2)}
           for r in _lib.read_log(mlm_run, missing_ok=True) if r["event"] in ("train", "stop")]
    mlm_valid = [{"step": r["step"], "loss": round(r["loss"], 4),
                  "accuracy": round(100 * r["accuracy"], 2)}
                 for r in _lib.read_log(mlm_run, missing_ok=True) if r["event"] == "valid"]
    rows, curves = [], {}
    for task in args.tasks:
        _, metric = TASKS[task]
        for init in args.inits:
            run = run_dir(task, init, args.runs)
            pts = curve(run, metric)
            curves[f"{task}_{init}"] = pts
            tp = _lib.throughput(run) if pts else {}
            rows.append({"task": task, "init": init, "metric": metric,
                         "best": max((x[metric] for x in pts), default=None),
                         "final": pts[-1][metric] if pts else None,
                         "steps": tp.get("steps"), "minutes": tp.get("train_minutes"),
                         "flattens_at_step": flattens(pts, metric)})
    out = {"benchmark": "glue", "command": _lib.command(), "date": time.strftime("%Y-%m-%d"),
           "machine": _lib.machine(processor=True),
           "setup": {"model": "small encoder: d=256, ffn 1024, 4 heads, 4 layers, pre-LN, "
                              "learned positions, max 128",
                     "pretraining": pretraining_text(args),
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
