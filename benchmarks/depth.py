"""Benchmark `depth` (issue 25): ALBERTa (adaptive depth, paper 004) against ALBERT at fixed
depth, LayerDrop, HeadPrune, BranchyNet, Shallow-Deep, PABEE and a static exit, on the same
`tiny` encoder (12 layer applications) and data, SST-2 and CoLA dev. Three reports:

* ``depth_glue``: each method's dev score and its wall-clock speed-up over ALBERT, measured
  side by side in one process (interleaved rounds, medians) at batch 1 and batch 32; the
  accuracy-time curves of each method's knob (batch 32); the static exit (every input the
  same depth, ALBERTa's mean), a shuffled exit (ALBERTa's depths given to other inputs) and
  an oracle exit (each input at the shallowest fixed depth that gets it right), to see
  whether the structure predictor knows which inputs are hard and what knowing would buy;
  each score's difference from ALBERT's with a paired-bootstrap interval.
* ``depth_ablation`` (SST-2): without early exit, γ in {0.1, 0.5, 0.9}, without RevPC,
  without absolute or relative positions.
* ``depth_speed`` (SST-2): ALBERTa's batch-1 speed-up by sentence length, and the depths it
  chooses by length and by ALBERT's confidence (plots).
* ``depth_exit_fit`` (SST-2, ``--only exitfit``): ALBERTa's predictor refitted to oracle
  depths on training rows, its γ curve against the static exit and the end-to-end predictor.

    python benchmarks/depth.py [--rounds 3] [--timing-rows 300]
                               [--only glue ablation speed exitfit]
                               [--train-only | --report-only] [--runs DIR]
                               [--pretrain-batch N] [--precision fp32] [--parallel 1]

Runs (benchmarks/variants/depth.yaml) live in runs/bench/depth/; a finished run is not
trained again, and ``--only`` trains only the runs its reports read. The methods of
``depth_glue`` and ``depth_speed`` are fine-tuned from MLM pre-trainings (one for ALBERT, its
LayerDrop, HeadPrune and multi-exit variants, one for ALBERTa with its structure predictor),
the same updates each; so are the ablation's variants (without absolute or relative positions:
their own pre-trainings). Writes
benchmarks/results/depth_{glue,ablation,speed}.{json,md} and .png. Run from the repository
root, alone (timings).
"""

from __future__ import annotations

import argparse
import operator
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import _lib
import _plot

ROOT = _lib.RUNS / "depth"
GENERAL = ":general"
"""A method's run name ending in it: the run classifying through the model's own pass
(``Classifier.fast_encode = False``), not the lean encoder layers."""


def run_dir(task: str, run: str) -> Path:
    return ROOT / f"{task}_{run}"


def train_runs(v: dict[str, Any], needed: set[str], tasks: list[str],
               args: argparse.Namespace) -> None:
    """Train the ``needed`` runs of ``v["runs"]`` on ``tasks`` that are not finished, in the
    file's order, each MLM pre-training just before the first run fine-tuned from it; with
    ``--parallel N``, N runs at a time in processes of their own, the pre-trainings first.
    ``--precision`` applies to every run, ``--pretrain-batch`` to the pre-trainings."""
    from dynaseq.tasks.registry import load_config

    todo, pre = [], v.get("pretrain", {})
    every = [f"train.precision={args.precision}"]
    batch = [] if args.pretrain_batch is None else [f"data.batch_size={args.pretrain_batch}"]
    for name, spec in v["runs"].items():
        if name not in needed:
            continue
        overrides = _flat(spec["overrides"])
        init = spec.get("init")
        if init is not None:
            mlm = ROOT / init
            if not _lib.done(mlm) and all(c.run_dir != str(mlm) for c in todo):
                text = _lib.write_unlabelled({t: v["tasks"][t]["config"]
                                              for t in pre["glue_text"]})
                pre_over = pre["runs"][init]
                todo.append(load_config(pre["config"], [
                    f"run_dir={mlm}", f"data.train=[$DATA/wikitext-2/train.txt,{text}]",
                    *pre["common"], *every, *batch, *pre_over, *_smoke(v, pre_over)]))
            overrides.append(f"train.init_from={mlm}")
        for task in (t for t in spec["tasks"] if t in tasks):
            t = v["tasks"][task]
            run = run_dir(task, name)
            if not _lib.done(run):
                todo.append(load_config(t["config"], [
                    f"run_dir={run}", *v["common"], f"train.max_steps={t['steps']}", *every,
                    *overrides, *_smoke(v, overrides)]))
    if args.parallel == 1:
        _lib.train_each(todo)
        return
    for phase in ([c for c in todo if c.task == "mlm"], [c for c in todo if c.task != "mlm"]):
        _lib.train_in_processes(phase, args.parallel, ROOT / "processes")


def needed_runs(v: dict[str, Any], reports: list[str]) -> set[str]:
    """The runs the chosen reports read (HeadPrune's pruned run: its source run)."""
    sections = {"glue": ("methods", "sweeps"), "ablation": ("ablation",),
                "speed": ("methods", "sweeps"), "exitfit": ()}
    names = {m["run"].removesuffix(GENERAL) for r in reports for s in sections[r]
             for m in v[s].values()} | ({"alberta"} if "exitfit" in reports else set())
    pruned = f"{v['head_prune']['run']}_heads{round(100 * v['head_prune']['keep'])}"
    return (names - {pruned}) | ({v["head_prune"]["run"]} if pruned in names else set())


def _flat(overrides: list) -> list[str]:
    """The overrides with YAML-anchored lists (``[*alberta, ...]``) spliced in."""
    return [o for x in overrides for o in (_flat(x) if isinstance(x, list) else [x])]


def _smoke(v: dict[str, Any], overrides: list[str]) -> list[str]:
    """The smoke overrides (the depth ones only for ALBERTa runs)."""
    return [o for o in v.get("smoke", [])
            if not o.startswith("model.depth.") or any(x.startswith("model.depth.")
                                                       for x in overrides)]


def head_prune(v: dict[str, Any], task: str) -> None:
    """The HeadPrune run: ALBERT with ``keep`` of its heads, by importance on training rows
    (not the dev set the methods are scored on)."""
    from dynaseq.workflows.head_prune import prune_heads_run

    hp = v["head_prune"]
    out = run_dir(task, f"{hp['run']}_heads{round(100 * hp['keep'])}")
    if out.exists():
        return
    from dynaseq.tasks.registry import load_config

    cfg = load_config(v["tasks"][task]["config"], [])
    from dynaseq.data.datasets import resolve_data_path

    rows = Path(resolve_data_path(cfg.data.train)).read_text().splitlines()
    head = 1 if task == "sst2" else 0  # SST-2 has a header line, CoLA none
    data = ROOT / f"{task}_importance.tsv"
    _lib.write_atomic(data, "\n".join(rows[:head + hp["importance_rows"]]) + "\n")
    prune_heads_run(run_dir(task, hp["run"]), out, data, hp["keep"])


class Bench:
    """The dev rows of one task and the loaded runs; scores and times method calls."""

    def __init__(self, task: str, v: dict[str, Any]) -> None:
        import dynaseq
        from dynaseq.tasks.classify.glue import read_table

        self.task, self.metric = task, v["tasks"][task]["metric"]
        self.runs: dict[str, Any] = {}
        for name in {m["run"] for section in ("methods", "sweeps") for m in v[section].values()}:
            path = run_dir(task, name.removesuffix(GENERAL))
            if path.exists():
                self.runs[name] = dynaseq.load(path)
                self.runs[name].fast_encode = not name.endswith(GENERAL)
        first = next(iter(self.runs.values()))
        self.layout = first.layout
        self.dev = read_table(first.config.data.valid, self.layout)
        self.rows = {n: c.encode(list(self.dev.text_a))[0] for n, c in self.runs.items()}
        self.n_dev = len(self.dev.text_a)
        self._alberta_layers: torch.Tensor | None = None
        self.preds: dict[str, list] = {}

    def alberta_layers(self) -> torch.Tensor:
        """(N,) long: the layers ALBERTa runs for each dev row at γ = 0.5 (measured once)."""
        from dynaseq.tasks.classify.predictor import RealizedCompute

        if self._alberta_layers is None:
            compute = RealizedCompute()
            self.runs["alberta"].classify_rows(self.rows["alberta"], batch_size=32,
                                               compute=compute, gamma=0.5)
            self._alberta_layers = compute.row_layers
        return self._alberta_layers

    def score(self, run: str, call: dict[str, Any], key: str | None = None
              ) -> dict[str, float]:
        """The task metric (x 100) and the average layers run on the whole dev set; the
        predictions are kept under ``key`` for :meth:`diff_ci`."""
        from dynaseq.tasks.classify.predictor import RealizedCompute

        c = self.runs[run]
        compute = RealizedCompute()
        pred = c.classify_rows(self.rows[run], batch_size=32, compute=compute, **call)
        layers = compute.avg_layers if compute.rows else float(
            call.get("keep_layers", c.config.model.layers))
        return self.scored(pred, layers, key)

    def scored(self, pred: list, layers: float, key: str | None) -> dict[str, float]:
        """:meth:`score` of predictions made elsewhere (the shuffled and oracle exits)."""
        from dynaseq.tasks.classify.predictor import task_metrics

        if key is not None:
            self.preds[key] = pred
        metrics = task_metrics(self.layout, self.dev.targets(), pred)
        return {"score": round(100 * metrics[self.metric], 2), "avg_layers": round(layers, 3)}

    def diff_ci(self, key: str, base: str = "ALBERT") -> list[float]:
        """95% paired-bootstrap interval of the score of ``key`` minus that of ``base`` (x 100,
        :func:`_lib.paired_diff_ci`): whether a difference is more than the dev set's draw."""
        from dynaseq.tasks.classify.predictor import task_metrics

        lo, hi = _lib.paired_diff_ci(lambda g, p: task_metrics(self.layout, g, p)[self.metric],
                                     self.dev.targets(), self.preds[key], self.preds[base])
        return [round(100 * lo, 2), round(100 * hi, 2)]

    def times(self, entries: dict[str, tuple[str, dict]], batch: int, n_rows: int,
              rounds: int, subset: list[int] | None = None) -> dict[str, float]:
        """Median seconds each entry takes to classify the first ``n_rows`` dev rows (of
        ``subset``, default all) at ``batch``, the entries interleaved in a new random order
        each round."""
        order = list(entries)
        got: dict[str, list[float]] = {k: [] for k in order}
        rng = random.Random(0)
        for name in order:  # warm-up
            run, call = entries[name]
            self.runs[run].classify_rows(self.rows[run][:batch], batch_size=batch, **call)
        for _ in range(rounds):
            rng.shuffle(order)
            for name in order:
                run, call = entries[name]
                rows = self.rows[run] if subset is None else [self.rows[run][i] for i in subset]
                c, rows = self.runs[run], rows[:n_rows]
                got[name].append(_lib.timed(
                    lambda c=c, rows=rows, call=call: c.classify_rows(rows, batch_size=batch,
                                                                      **call)))
        return {k: statistics.median(t) for k, t in got.items()}


def static_calls(bench: Bench) -> dict[str, tuple[str, dict]]:
    """The static exit at ALBERTa's mean depth (every input the same), rounded down and up."""
    c = bench.runs["alberta"]
    mean = float(bench.alberta_layers().float().mean()) - c.config.model.depth.first_group
    lo = int(mean)
    return {f"static exit (depth {k})": ("alberta", {"depth": k}) for k in sorted({lo, lo + 1})
            if k <= c.config.model.layers - c.config.model.depth.first_group}


def shuffled_score(bench: Bench, seed: int = 0) -> dict[str, float]:
    """ALBERTa with its own depths (at γ = 0.5) given to other inputs: the same compute, no
    knowledge of which input needs which depth."""
    from dynaseq.tasks.classify.predictor import decide, predict_logits
    from dynaseq.techniques.depth.exits import DepthExit

    c = bench.runs["alberta"]
    first = c.config.model.depth.first_group
    depths = bench.alberta_layers() - first
    perm = torch.randperm(len(depths), generator=torch.Generator().manual_seed(seed))
    logits = predict_logits(c.model, bench.rows["alberta"], 32, c.device,
                            exit=DepthExit(depth=depths[perm]))
    return bench.scored(decide(logits, bench.layout), float(depths.float().mean()) + first,
                        "shuffled exit")


def shallowest_right(c: Any, rows: list, gold: list, fallback: int
                     ) -> tuple[list[list], list[int]]:
    """ALBERTa ``c``'s predictions of ``rows`` at each fixed depth 0..K, and each row's
    oracle depth: the shallowest whose prediction is ``gold`` (``fallback`` where none is)."""
    first = c.config.model.depth.first_group
    preds = [c.classify_rows(rows, batch_size=32, depth=k)
             for k in range(c.config.model.layers - first + 1)]
    pick = [next((k for k, p in enumerate(preds) if p[i] == g), fallback)
            for i, g in enumerate(gold)]
    return preds, pick


def oracle_score(bench: Bench) -> dict[str, float]:
    """The oracle exit, an upper bound no predictor can pass: each input at the shallowest of
    ALBERTa's fixed depths that classifies it right (the full depth where none does). The gap
    between it and the structure predictor at the same layers is what knowing each input's
    difficulty could buy."""
    c = bench.runs["alberta"]
    k_max = c.config.model.layers - c.config.model.depth.first_group
    preds, pick = shallowest_right(c, bench.rows["alberta"], bench.dev.targets(), k_max)
    return bench.scored([preds[k][i] for i, k in enumerate(pick)],
                        c.config.model.depth.first_group + statistics.mean(pick), "oracle exit")


def glue_report(v: dict[str, Any], tasks: list[str], args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {"rows": [], "curves": {}}
    for task in tasks:
        bench = Bench(task, v)
        methods = {k: (m["run"], m["call"]) for k, m in v["methods"].items()
                   if m["run"] in bench.runs}
        methods.update(static_calls(bench))
        scores = {k: bench.score(run, call, k) for k, (run, call) in methods.items()}
        scores["shuffled exit"] = shuffled_score(bench)
        scores["oracle exit"] = oracle_score(bench)
        for k in scores:
            scores[k]["vs_albert_ci"] = bench.diff_ci(k)
        t1 = bench.times(methods, 1, args.timing_rows, args.rounds)
        t32 = bench.times(methods, 32, bench.n_dev, args.rounds)
        for k in [*methods, "shuffled exit", "oracle exit"]:
            row = {"task": task, "method": k, **scores[k]}
            if k in methods:
                row.update(speedup_b1=round(t1["ALBERT"] / t1[k], 3),
                           speedup_b32=round(t32["ALBERT"] / t32[k], 3),
                           ms_per_row_b1=round(1000 * t1[k] / args.timing_rows, 3),
                           ms_per_row_b32=round(1000 * t32[k] / bench.n_dev, 3))
            out["rows"].append(row)
        sweep_calls, labels = {}, {}
        for name, s in v["sweeps"].items():
            if s["run"] not in bench.runs:
                continue
            for value in s["values"]:
                key = f"{name} {s['knob']}={value}"
                sweep_calls[key] = (s["run"], {**s.get("fixed", {}), s["knob"]: value})
                labels[key] = (name, value)
        sweep_calls["ALBERT"] = ("albert", {})
        labels["ALBERT"] = ("ALBERT", None)
        st = bench.times(sweep_calls, 32, bench.n_dev, args.rounds)
        curves: dict[str, list] = {}
        for key, (run, call) in sweep_calls.items():
            name, value = labels[key]
            curves.setdefault(name, []).append(
                {"value": value, **bench.score(run, call),
                 "speedup_b32": round(st["ALBERT"] / st[key], 3)})
        out["curves"][task] = curves
    return out


def ablation_report(v: dict[str, Any], args: argparse.Namespace) -> dict:
    bench = Bench("sst2", {**v, "methods": v["ablation"]})
    entries = {k: (m["run"], m["call"]) for k, m in v["ablation"].items() if m["run"] in bench.runs}
    t1 = bench.times(entries, 1, args.timing_rows, args.rounds)
    t32 = bench.times(entries, 32, bench.n_dev, args.rounds)
    scores = {k: bench.score(*entries[k], k) for k in entries}
    return {"rows": [{"variant": k, **scores[k], "vs_albert_ci": bench.diff_ci(k),
                      "speedup_b1": round(t1["ALBERT"] / t1[k], 3),
                      "speedup_b32": round(t32["ALBERT"] / t32[k], 3)} for k in entries]}


def exit_fit_report(v: dict[str, Any], args: argparse.Namespace) -> dict:
    """ALBERTa's structure predictor refitted, after fine-tuning, to each training row's
    oracle depth (the shallowest fixed depth that classifies it right; 0 where none does) by
    cross-entropy on the first group's pooled state, the other weights kept: does a predictor
    told which inputs are hard beat the static exit that the end-to-end one only matches?
    (A learning-to-exit target; the paper trains the predictor through the task loss only.)"""
    from dynaseq.tasks.classify.glue import read_table
    from dynaseq.techniques.depth.predictor import StructurePredictor

    fit = v["exit_fit"]
    bench = Bench("sst2", {**v, "methods": {"ALBERTa": v["methods"]["ALBERTa"]}, "sweeps": {}})
    c = bench.runs["alberta"]
    enc = c.model.encoder
    k_max, first = enc.predictor.n_adaptive, enc.predictor.first_group
    table = read_table(c.config.data.train, bench.layout)
    sample = random.Random(fit["seed"]).sample(range(len(table.text_a)), fit["rows"])
    gold = [table.targets()[i] for i in sample]
    rows = c.encode([table.text_a[i] for i in sample])[0]
    preds, depths = shallowest_right(c, rows, gold, 0)
    oracle = torch.tensor(depths)
    pooled: list[torch.Tensor] = []
    hook = enc.predictor.register_forward_hook(
        lambda m, inp, out: pooled.append(inp[0][:, 0].clone()))
    c.fast_encode = False  # one row a call through the model's pass: the hook sees it in order
    for r in rows:
        c.classify_rows([r], batch_size=1, gamma=0.5)
    hook.remove()
    c.fast_encode = True
    x = torch.cat(pooled)
    out: dict[str, Any] = {
        "rows": fit["rows"], "oracle_histogram": _histogram(depths),
        "train_accuracy_by_depth": [
            round(100 * sum(map(operator.eq, p, gold)) / len(gold), 2) for p in preds],
        "curves": {"static exit": [{"value": k, **bench.score("alberta", {"depth": k})}
                                   for k in range(k_max + 1)]}}
    bench.score("alberta", {"gamma": 0.5}, "ALBERTa")
    trained = {k: t.clone() for k, t in enc.predictor.state_dict().items()}
    counts = torch.bincount(oracle, minlength=k_max + 1).float().clamp(min=1)
    for name, weighting in fit["weightings"].items():
        torch.manual_seed(fit["seed"])
        new = StructurePredictor(x.shape[1], enc.predictor.hidden.out_features, k_max, first)
        weight = (counts.sum() / counts) ** weighting  # 0: plain, 0.5: sqrt-balanced classes
        opt = torch.optim.Adam(new.parameters(), lr=fit["lr"])
        with torch.enable_grad():
            for _ in range(fit["epochs"]):
                for b in torch.randperm(len(oracle)).split(128):
                    loss = torch.nn.functional.cross_entropy(new.logits(x[b]), oracle[b],
                                                             weight=weight)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        enc.predictor.load_state_dict(new.state_dict())
        out["curves"][name] = [{"value": g, **bench.score("alberta", {"gamma": g}, f"{name} {g}"),
                                "vs_alberta_ci": bench.diff_ci(f"{name} {g}", "ALBERTa")}
                               for g in fit["gammas"]]
    enc.predictor.load_state_dict(trained)
    out["curves"]["ALBERTa (end to end)"] = [
        {"value": g, **bench.score("alberta", {"gamma": g})} for g in fit["gammas"]]
    return out


def speed_report(v: dict[str, Any], args: argparse.Namespace) -> dict:
    """Batch-1 speed-up by length bucket; chosen depths by length and by ALBERT's confidence."""
    from dynaseq.tasks.classify.predictor import predict_logits

    bench = Bench("sst2", v)
    ab = bench.runs["albert"]
    lengths = [len(ids) for ids, _ in bench.rows["alberta"]]
    edges = [0, 10, 20, 30, 40, 1000]
    buckets = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        idx = [i for i, n in enumerate(lengths) if lo < n <= hi][:args.timing_rows // 3]
        if not idx:
            continue
        entries = {"ALBERT": ("albert", {}), "ALBERTa": ("alberta", {"gamma": 0.5})}
        t = bench.times(entries, 1, len(idx), args.rounds, subset=idx)
        buckets.append({"tokens": f"{lo + 1}-{hi}" if hi < 1000 else f">{lo}", "rows": len(idx),
                        "speedup_b1": round(t["ALBERT"] / t["ALBERTa"], 3)})
    depth = bench.alberta_layers().tolist()
    probs = predict_logits(ab.model, bench.rows["albert"], 32, ab.device).softmax(-1).max(-1).values
    conf = probs.tolist()
    order = sorted(range(len(conf)), key=lambda i: conf[i])
    third = len(order) // 3
    by_conf = {"hard (lowest ALBERT confidence third)": order[:third],
               "easy (highest third)": order[-third:]}
    by_length = sorted(range(len(lengths)), key=lambda i: lengths[i])
    by_len = {"short (shortest third)": by_length[:third],
              "long (longest third)": by_length[-third:]}
    groups = {name: {"mean_layers": round(statistics.mean(depth[i] for i in idx), 3),
                     "histogram": _histogram([depth[i] for i in idx])}
              for name, idx in {**by_len, **by_conf}.items()}
    corr_len = _spearman(lengths, depth)
    corr_conf = _spearman(conf, depth)
    return {"length_buckets": buckets, "groups": groups,
            "spearman_depth_vs_length": corr_len, "spearman_depth_vs_confidence": corr_conf,
            "depth_histogram": _histogram(depth)}


def _histogram(values: list[int]) -> dict[str, int]:
    return {str(k): values.count(k) for k in sorted(set(values))}


def _spearman(a: list[float], b: list[float]) -> float | None:
    from scipy.stats import spearmanr

    r = spearmanr(a, b).statistic
    return None if r != r else round(float(r), 3)  # NaN: one of them is constant


def write_reports(v: dict, glue: dict | None, abl: dict | None, speed: dict | None,
                  args: argparse.Namespace) -> None:
    head = {"command": _lib.command(), "date": time.strftime("%Y-%m-%d"),
            "machine": _lib.machine(processor=True), "provenance": _lib.provenance(),
            "setup": "tiny encoder (d=128, 4 heads, ffn 512), 12 layer applications; ALBERT: "
                     "one shared layer; ALBERTa: 4 shared groups, predictor after 2 layers, "
                     "absolute + relative positions (R=16); speed-ups: ALBERT's time / the "
                     "method's, interleaved rounds in one process, medians",
            "pretraining": pretraining(v)}
    targets = ("Targets (issue 25): ALBERTa >= 1.6x ALBERT at batch 1 and 32 scoring no lower; "
               "PABEE batched >= 1.3x; ALBERTa's accuracy-time curve above every baseline's.")
    if glue is not None:
        data = {"benchmark": "depth_glue", **head, **glue}
        lines = _lib.md_head("Adaptive depth on GLUE dev (the paper's table, small scale)",
                             data["command"], f"Machine: {data['machine']}. Date {data['date']}.",
                             data["setup"] + ".", pre_line(head["pretraining"]), targets)
        lines += _lib.md_table(
            ["task", "method", "score", "- ALBERT (95% CI)", "avg layers", "speed-up b1",
             "speed-up b32", "ms/row b1", "ms/row b32"], "llrrrrrrr",
            [[r["task"], r["method"], r["score"], _ci(r["vs_albert_ci"]), r["avg_layers"],
              r.get("speedup_b1", "-"), r.get("speedup_b32", "-"), r.get("ms_per_row_b1", "-"),
              r.get("ms_per_row_b32", "-")] for r in glue["rows"]])
        lines += ["", "Score: SST-2 accuracy, CoLA MCC (x 100), whole dev set. `- ALBERT`: the "
                      "score minus ALBERT's, 95% paired-bootstrap interval over the dev rows "
                      "(1000 resamples). Shuffled exit: ALBERTa's depths at γ=0.5 given to "
                      "other inputs (same compute). Oracle exit: each input at the shallowest "
                      "fixed depth of ALBERTa that gets it right (an upper bound for a "
                      "predictor). Curves (batch 32): `depth_glue.json` -> `curves`, plot "
                      "`depth_glue.png`."]
        _lib.write_results(args.results, "depth_glue", data, lines)
        plot_curves(glue["curves"], args.results / "depth_glue.png")
        print("\n".join(lines))
    if abl is not None:
        data = {"benchmark": "depth_ablation", **head, **abl}
        lines = _lib.md_head("ALBERTa ablation (SST-2 dev)", data["command"],
                             f"Machine: {data['machine']}. Date {data['date']}.",
                             data["setup"] + "; every variant pre-trained and fine-tuned as "
                             "ALBERTa is.", pre_line(head["pretraining"]))
        lines += _lib.md_table(["variant", "accuracy", "- ALBERT (95% CI)", "avg layers",
                                "speed-up b1", "speed-up b32"], "lrrrrr",
                               [[r["variant"], r["score"], _ci(r["vs_albert_ci"]),
                                 r["avg_layers"], r["speedup_b1"], r["speedup_b32"]]
                                for r in abl["rows"]])
        _lib.write_results(args.results, "depth_ablation", data, lines)
        print("\n".join(lines))
    if speed is not None:
        data = {"benchmark": "depth_speed", **head, **speed}
        lines = _lib.md_head("ALBERTa: speed-up by length and depths chosen (SST-2 dev)",
                             data["command"], f"Machine: {data['machine']}. Date {data['date']}.",
                             data["setup"] + ".", pre_line(head["pretraining"]))
        lines += _lib.md_table(["tokens", "rows", "speed-up b1"], "lrr",
                               [[b["tokens"], b["rows"], b["speedup_b1"]]
                                for b in speed["length_buckets"]])
        lines += ["", *_lib.md_table(["inputs", "mean layers", "layers: rows"], "lrl",
                                     [[k, g["mean_layers"], g["histogram"]]
                                      for k, g in speed["groups"].items()]),
                  "", f"Spearman correlation of the depth with the length: "
                      f"{speed['spearman_depth_vs_length']}, with ALBERT's confidence: "
                      f"{speed['spearman_depth_vs_confidence']}. Plot `depth_speed.png`."]
        _lib.write_results(args.results, "depth_speed", data, lines)
        plot_speed(speed, args.results / "depth_speed.png")
        print("\n".join(lines))


def write_exit_fit(fit: dict, args: argparse.Namespace) -> None:
    data = {"benchmark": "depth_exit_fit", "command": _lib.command(),
            "date": time.strftime("%Y-%m-%d"), "machine": _lib.machine(processor=True),
            "provenance": _lib.provenance(), **fit}
    lines = _lib.md_head(
        "ALBERTa's predictor refitted to oracle depths (SST-2 dev)", data["command"],
        f"Machine: {data['machine']}. Date {data['date']}.",
        f"The fine-tuned ALBERTa (`sst2_alberta`); its predictor refitted on {fit['rows']} "
        "training rows to each row's oracle depth (shallowest fixed depth that classifies it "
        f"right, 0 where none does; histogram {fit['oracle_histogram']}), the other weights "
        "kept. Class weights (count share)^-w: `plain` w=0, `balanced` w=0.5.")
    lines += _lib.md_table(["predictor", "γ / depth", "accuracy", "avg layers",
                            "- end-to-end γ=0.5 (95% CI)"], "lrrrr",
                           [[name, p["value"], p["score"], p["avg_layers"],
                             _ci(p["vs_alberta_ci"]) if "vs_alberta_ci" in p else "-"]
                            for name, pts in fit["curves"].items() for p in pts])
    _lib.write_results(args.results, "depth_exit_fit", data, lines)
    print("\n".join(lines))


def _ci(ci: list[float]) -> str:
    return f"[{ci[0]:+.1f}, {ci[1]:+.1f}]"


def pretraining(v: dict[str, Any]) -> dict[str, Any]:
    """Each MLM pre-training's updates, minutes and last validation (masked-token loss and
    accuracy)."""
    out = {}
    for name in v.get("pretrain", {}).get("runs", {}):
        log = _lib.read_log(ROOT / name, missing_ok=True)
        train = [r for r in log if r["event"] == "train"]
        valid = [r for r in log if r["event"] == "valid"]
        out[name] = {"updates": train[-1]["step"] if train else None,
                     "minutes": round(train[-1]["elapsed_s"] / 60, 1) if train else None,
                     "valid_loss": round(valid[-1]["loss"], 3) if valid else None,
                     "valid_accuracy": round(100 * valid[-1]["accuracy"], 2) if valid else None}
    return out


def pre_line(pre: dict[str, Any]) -> str:
    return ("MLM pre-training (WikiText-2 + SST-2/CoLA training sentences): " + "; ".join(
        f"{k} {r['updates']} updates in {r['minutes']} min, valid loss {r['valid_loss']}, "
        f"accuracy {r['valid_accuracy']}%" for k, r in pre.items())
        + ". Every method and variant is fine-tuned from one of them.")


def plot_curves(curves: dict[str, dict[str, list]], path: Path) -> None:
    plt = _plot.pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
    for ax, (task, methods) in zip(axes[0], curves.items(), strict=True):
        for name, pts in methods.items():
            pts = sorted(pts, key=lambda p: p["speedup_b32"])
            ax.plot([p["speedup_b32"] for p in pts], [p["score"] for p in pts],
                    marker="o" if name != "ALBERT" else "*", label=name)
        ax.set_title(f"{task} dev: score vs speed-up over ALBERT (batch 32)")
        ax.set_xlabel("speed-up")
        ax.set_ylabel("score x 100")
        ax.legend(fontsize=7)
    _plot.save(fig, path)


def plot_speed(speed: dict, path: Path) -> None:
    plt = _plot.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    buckets = speed["length_buckets"]
    a.bar([x["tokens"] for x in buckets], [x["speedup_b1"] for x in buckets])
    a.set_title("ALBERTa speed-up over ALBERT by length (batch 1)")
    a.set_xlabel("tokens")
    for name, g in speed["groups"].items():
        ks = sorted(int(k) for k in g["histogram"])
        total = sum(g["histogram"].values())
        b.plot(ks, [g["histogram"][str(k)] / total for k in ks], marker="o", label=name)
    b.set_title("layers run (γ = 0.5)")
    b.set_xlabel("layers")
    b.set_ylabel("share of inputs")
    b.legend(fontsize=7)
    _plot.save(fig, path)


def main() -> None:
    global ROOT  # where the runs live: --runs, or the smoke check's folder
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timing-rows", type=int, default=300,
                   help="dev rows timed at batch 1 (batch 32: the whole dev set)")
    p.add_argument("--tasks", nargs="+", default=["sst2", "cola"])
    p.add_argument("--only", nargs="+", default=["glue", "ablation", "speed"],
                   choices=["glue", "ablation", "speed", "exitfit"])
    p.add_argument("--report-only", action="store_true", help="train nothing")
    p.add_argument("--train-only", action="store_true",
                   help="train the runs --only needs, measure nothing")
    p.add_argument("--runs", type=Path, default=ROOT, help=f"where the runs live ({ROOT})")
    p.add_argument("--pretrain-batch", type=int, default=None,
                   help="MLM pre-training blocks per update (default: the config's, 16); "
                        "on a GPU a larger batch costs little more time per update")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="train.precision of every run (bf16: autocast, on a GPU)")
    p.add_argument("--parallel", type=int, default=1,
                   help="train this many runs at once, each in its own process (for an "
                        "accelerator; default 1)")
    p.add_argument("--smoke", action="store_true",
                   help="a check of the script: 3 updates per run in runs/bench/depth_smoke")
    _lib.add_results_arg(p)
    args = p.parse_args()
    if args.parallel < 1:
        p.error(f"--parallel must be at least 1, got {args.parallel}")
    torch.set_num_threads(2)
    v = _lib.variants_file("depth")
    ROOT = args.runs
    if args.smoke:
        ROOT = _lib.RUNS / "depth_smoke"
        v["smoke"] = ["train.max_steps=3", "train.valid_every=3", "train.save_every=3",
                      "train.warmup_steps=1", "model.depth.depth_start_step=0"]
        v["head_prune"]["importance_rows"] = 50
    if not args.report_only:
        train_runs(v, needed_runs(v, args.only), args.tasks, args)
        for task in args.tasks:
            if run_dir(task, v["head_prune"]["run"]).exists():
                head_prune(v, task)
    if args.train_only:
        return
    with torch.no_grad():
        glue = glue_report(v, args.tasks, args) if "glue" in args.only else None
        abl = ablation_report(v, args) if "ablation" in args.only else None
        speed = speed_report(v, args) if "speed" in args.only else None
        fit = exit_fit_report(v, args) if "exitfit" in args.only else None
    write_reports(v, glue, abl, speed, args)
    if fit is not None:
        write_exit_fit(fit, args)


if __name__ == "__main__":
    main()
