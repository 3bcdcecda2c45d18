"""Helpers shared by the benchmark scripts; the scripts import this module, never each other.

What lives here is what two or more scripts need: the paths they agree on, the machine and
command a result records, reading a run's ``log.jsonl``, carrying committed result rows into
a new report, Markdown tables, writing the ``.json`` + ``.md`` pair of a result atomically,
the variant registries (YAML under ``benchmarks/variants/``) and a training loop over configs.
Plot helpers are in :mod:`_plot`.

Scripts run as ``python benchmarks/NAME.py`` from the repository root, so the relative paths
below are relative to it, and ``benchmarks/`` is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULTS = Path("benchmarks/results")
RUNS = Path("runs/bench")
MULTI30K = Path("../shared/data/multi30k")
VARIANTS_DIR = Path(__file__).resolve().parent / "variants"


# ---------------------------------------------------------------- command line and machine


def add_results_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--results DIR``: where the result files are written (and committed rows read)."""
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help=f"folder of the result files (default {RESULTS}); committed rows "
                             "a report carries over are read from there too")


def command(argv: list[str] | None = None) -> str:
    """The command as run, ``python benchmarks/SCRIPT.py ARGS`` (``argv``: default
    ``sys.argv``), each argument shell-quoted where it needs to be."""
    argv = sys.argv if argv is None else argv
    if not argv:
        raise ValueError("argv is empty: no script name")
    return " ".join(["python", f"benchmarks/{Path(argv[0]).name}",
                     *map(shlex.quote, argv[1:])])


def code_state(where: Path | None = None) -> dict[str, Any]:
    """The code a result was made with: ``commit`` (the git HEAD of the checkout holding
    ``where``, default this script's) and ``dirty`` (True when that checkout has any
    uncommitted change or untracked file anywhere in its tree, benchmarks included; None
    outside a git checkout)."""
    import subprocess

    where = Path(__file__).resolve().parent if where is None else Path(where)

    def git(*args: str) -> str | None:
        proc = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else None

    root = git("rev-parse", "--show-toplevel")
    if root is None:
        return {"commit": None, "dirty": None}
    status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=all"],
                            capture_output=True, text=True).stdout
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status.strip())}


def provenance(argv: list[str] | None = None, where: Path | None = None) -> dict[str, Any]:
    """What made a result row, recorded in the row (``made_by``) so that any row can be made
    again: the ``command`` as run (:func:`command`), the code's ``commit`` and ``dirty`` flag
    (:func:`code_state`) and the UTC ``date`` (``YYYY-MM-DD HH:MM``)."""
    return {"command": command(argv), **code_state(where),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def stamp(rows: Iterable[dict], made_by: dict[str, Any]) -> None:
    """Record ``made_by`` (:func:`provenance`) in each of ``rows`` (the rows measured now)."""
    for r in rows:
        r["made_by"] = made_by


def made_by_lines(rows: Iterable[dict], key: str) -> list[str]:
    """Markdown lines saying which command, commit and date made each row (named by
    ``row[key]``): one bullet per distinct ``made_by`` record, in order of first use, and one
    for the rows made before rows recorded it."""
    groups: dict[str, tuple[dict | None, list[str]]] = {}
    for r in rows:
        m = r.get("made_by")
        groups.setdefault(json.dumps(m, sort_keys=True), (m, []))[1].append(str(r[key]))
    lines = ["## How each row was made", ""]
    for m, names in groups.values():
        if m is None:
            lines.append(f"- {', '.join(names)}: made before result rows recorded their command "
                         "and commit.")
            continue
        if m.get("reconstructed"):
            lines.append(f"- {', '.join(names)}: `{m['command']}` (reconstructed from git "
                         f"history: the row as it is now was first committed in commit "
                         f"{m['commit'][:12]}, {m['date']} UTC; the state of the tree it ran "
                         "in is not known)")
            continue
        code = "no git checkout" if m["commit"] is None else (
            f"commit {m['commit'][:12]}" + (" with uncommitted changes" if m["dirty"] else ""))
        lines.append(f"- {', '.join(names)}: `{m['command']}` ({code}, {m['date']} UTC)")
    return lines


def made_by_from_git(path: Path, key: str, script: str,
                     report_args: Callable[[dict], list[str]]) -> dict[str, Any]:
    """The committed results file ``path`` with each row that has no ``made_by`` given one
    reconstructed from the file's git history (the caller writes it, with its Markdown).

    Rows measured before :func:`provenance` existed say nothing of what made them; git still
    knows when each reached the file. For each such row (named by ``row[key]``) this walks the
    commits that changed ``path``, newest first, while the row there agrees with the row now:
    every field both hold, ``made_by`` and ``measured`` aside, is equal (a report that carried
    the row over may have dropped a field, such as latencies that belong to another run, or
    added the ``measured`` date). The oldest such commit is where the row as it is now was
    first committed, with the script that made it. The record is ``{"command", "commit",
    "dirty": None, "date", "reconstructed": "git"}``: the command is ``python script
    report_args(row)`` (without its ``--only ...`` where the script at that commit had no
    ``--only`` for ``report``), the date the commit's (UTC), and ``dirty`` None because
    whether the tree had uncommitted changes when the row was measured is not known.

    Raises ``ValueError`` when a row without ``made_by`` differs from the file as last
    committed (measure it again instead: the report stamps what it measures)."""
    import subprocess

    path = Path(path).resolve()
    root = subprocess.run(["git", "-C", str(path.parent), "rev-parse", "--show-toplevel"],
                          capture_output=True, text=True, check=True).stdout.strip()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                              check=True).stdout

    rel = path.relative_to(root).as_posix()
    history = [line.split("\t") for line in
               git("log", "--format=%H\t%ct", "--", rel).splitlines()]
    data = json.loads(path.read_text())
    cache: dict[str, dict[str, dict]] = {}

    def show(spec: str) -> str:  # "" where the commit has no such file
        try:
            return git("show", spec)
        except subprocess.CalledProcessError:
            return ""

    def rows_at(commit: str) -> dict[str, dict]:
        if commit not in cache:
            try:
                old = json.loads(show(f"{commit}:{rel}") or "{}")
            except json.JSONDecodeError:
                old = {}
            cache[commit] = {str(r[key]): r for r in old.get("rows", [])
                             if isinstance(r, dict) and key in r}
        return cache[commit]

    def agrees(old: dict | None, row: dict) -> bool:
        shared = (set(old or {}) & set(row)) - {"made_by", "measured", key}
        return old is not None and bool(shared) and all(old[k] == row[k] for k in shared)

    for row in data["rows"]:
        if "made_by" in row:
            continue
        first = None
        for commit, when in history:
            if not agrees(rows_at(commit).get(str(row[key])), row):
                break
            first = (commit, int(when))
        if first is None:
            raise ValueError(f"{path}: row {row[key]!r} differs from the file's last commit: "
                             "measure it again")
        commit, when = first
        args = report_args(row)
        if "--only" in args and not _report_has_only(show(f"{commit}:{script}")):
            args = args[:args.index("--only")]
        row["made_by"] = {"command": command([script, *args]), "commit": commit,
                          "dirty": None,
                          "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(when)),
                          "reconstructed": "git"}
    return data


def add_made_by_command(sub: Any, func: Callable[[argparse.Namespace], None]) -> None:
    """Add the ``made-by-from-git`` subcommand (running ``func``, with ``--results``) to a
    script's subparsers ``sub``: see :func:`made_by_from_git`."""
    g = sub.add_parser("made-by-from-git", help="record in each row measured before rows "
                       "recorded it what made it, reconstructed from git history")
    add_results_arg(g)
    g.set_defaults(func=func)


def _report_has_only(script_text: str) -> bool:
    """Whether the benchmark script ``script_text`` gives its ``report`` subcommand an
    ``--only`` option (the lines from ``add_parser("report")`` to the next ``add_parser``)."""
    start = script_text.find('add_parser("report")')
    if start < 0:
        return False
    end = script_text.find("add_parser(", start + 1)
    return '"--only"' in script_text[start:end if end > 0 else None]


def machine(*, processor: bool = False, torch_threads: bool = True,
            **extra: Any) -> dict[str, Any]:
    """What a result records of the machine: platform, (processor: its name, as
    ``platform.processor()`` or else Linux's ``/proc/cpuinfo`` gives it, and the vector
    instructions torch's CPU kernels use, e.g. ``AVX2`` or ``AVX512``,) torch version, the
    GPU's name where torch sees one, (torch's thread count,) then ``extra`` in the order given."""
    import torch

    out: dict[str, Any] = {"platform": platform.platform()}
    if processor:
        name = platform.processor()  # some Linux builds say only the architecture
        out["processor"] = _cpu_model() or name if name in ("", platform.machine()) else name
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    out["torch"] = torch.__version__
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    if torch_threads:
        out["threads"] = torch.get_num_threads()
    return {**out, **extra}


def _cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    names = [line.split(":", 1)[1].strip() for line in text.splitlines()
             if line.startswith("model name") and ":" in line]
    return names[0] if names else ""


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_seconds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each of ``fns`` over ``rounds`` rounds, the calls taking turns
    within each round (these machines are noisy: only side-by-side times compare), after
    one untimed warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn``, after one untimed warm-up call."""
    fn()
    return 1000.0 * statistics.median(timed(fn) for _ in range(repeats))


# ------------------------------------------------------------------------------- run logs


def cct_quality_run(name: str) -> Path:
    """Run directory of system ``name`` (``cct``, a CCT variant or a dense baseline) of
    ``benchmarks/cct_quality.py``; other scripts time or read those runs."""
    return RUNS / f"cct_quality_{name}"


def read_log(run: Path, missing_ok: bool = False) -> list[dict]:
    """The events of ``run``'s ``log.jsonl``, in order. A missing log raises
    :class:`FileNotFoundError`, or gives ``[]`` with ``missing_ok``."""
    log = Path(run) / "log.jsonl"
    if not log.exists():
        if missing_ok:
            return []
        raise FileNotFoundError(f"{log} does not exist: train the system first")
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def learning_curve(run: Path) -> list[dict[str, float]]:
    """One entry per validation event of ``run``: step, training minutes so far (from the last
    training event before it), validation BLEU (nan when not measured) and loss."""
    curve, elapsed = [], 0.0
    for rec in read_log(run):
        if rec["event"] == "train":
            elapsed = rec["elapsed_s"]
        if rec["event"] == "valid":
            curve.append({"step": rec["step"], "minutes": round(elapsed / 60, 2),
                          "valid_bleu": round(rec.get("bleu", float("nan")), 2),
                          "valid_loss": round(rec["loss"], 4)})
    return curve


def valid_curve(run: Path, every: int = 1, missing_ok: bool = False
                ) -> dict[int, dict[str, float]]:
    """step -> {"loss", "bleu"} of the validation events of ``run`` at steps divisible by
    ``every`` (a step validated twice, after a stop and resume, keeps its last entry)."""
    if every < 1:
        raise ValueError(f"every must be >= 1, not {every}")
    if missing_ok and not (Path(run) / "log.jsonl").exists():
        return {}
    return {int(v["step"]): {"loss": v["valid_loss"], "bleu": v["valid_bleu"]}
            for v in learning_curve(run) if v["step"] % every == 0}


def throughput(run: Path) -> dict[str, float | None]:
    """Training minutes and updates at the last stop, and the median target tokens/s of the
    training events after the first update (None where the log has none)."""
    recs = read_log(run)
    stop = [r for r in recs if r["event"] == "stop"]
    tps = [r["tokens_per_s"] for r in recs if r["event"] == "train" and r["step"] > 1]
    return {"train_minutes": round(stop[-1]["elapsed_s"] / 60, 2) if stop else None,
            "steps": stop[-1]["step"] if stop else None,
            "tgt_tokens_per_s": round(sorted(tps)[len(tps) // 2], 1) if tps else None}


def finished(run: Path, steps: int = 0) -> bool:
    """``run`` stopped on its update limit at ``steps`` updates or more (a run stopped by a
    signal, or one without a log, does not count)."""
    return any(e.get("event") == "stop" and e.get("reason") == "max_steps"
               and e.get("step", 0) >= steps for e in read_log(run, missing_ok=True))


def done(run: Path, cfg: Any = None) -> bool:
    """``run`` stopped on its update or time limit (not by a signal: that one resumes).
    Given its run config ``cfg``, the limits are ``cfg``'s: a run that stopped at fewer
    updates or minutes than ``cfg.train`` asks now is not done, and training it resumes
    from its last checkpoint (a longer schedule continues the run)."""
    stops = [e for e in read_log(run, missing_ok=True) if e.get("event") == "stop"
             and e.get("reason") in ("max_steps", "max_minutes")]
    if not stops or cfg is None:
        return bool(stops)
    last, tc = stops[-1], cfg.train
    if last["reason"] == "max_steps":
        return last["step"] >= tc.max_steps
    return tc.max_minutes is not None and last["elapsed_s"] >= tc.max_minutes * 60


def train_each(configs: Iterable[Any]) -> None:
    """Train each config in turn (``dynaseq.train.loop.train``, progress on stderr). A run a
    signal stopped ends the script, status 130, before anything measures unfinished runs (its
    checkpoint is written: run the command again to resume)."""
    from dynaseq.train.loop import train

    for cfg in configs:
        print(f"== training {cfg.run_dir}", file=sys.stderr, flush=True)
        if train(cfg, progress=True).stopped_by_signal is not None:
            print(f"stopped by a signal in {cfg.run_dir}: run the command again to resume",
                  file=sys.stderr)
            raise SystemExit(130)


def run_parallel(jobs: dict[str, list[str]], parallel: int, out_dir: Path) -> None:
    """Run each job's command (name -> argv) in a process of its own, ``parallel`` at a
    time, in the order given, its output in ``{out_dir}/{name}.out``. One accelerator is
    shared by the processes, whose small updates each leave it mostly idle; on a 2-core
    CPU, keep ``parallel`` at 1. Exits with status 1, printing the output's tail, when a
    process fails (the others run to their end first)."""
    assert parallel >= 1
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    pending, running, failed = list(jobs), {}, []
    while pending or running:
        while pending and len(running) < parallel:
            name = pending.pop(0)
            out = Path(out_dir) / f"{name}.out"
            with out.open("w") as log:
                running[name] = (subprocess.Popen(jobs[name], stdout=log,
                                                  stderr=subprocess.STDOUT), out)
            print(f"== {name}: training in process {running[name][0].pid} ({out})",
                  flush=True)
        time.sleep(1.0)
        for name, (proc, out) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            print(f"== {name}: exit status {proc.returncode}", flush=True)
            if proc.returncode:
                failed.append(name)
                print(out.read_text(errors="replace")[-3000:], file=sys.stderr)
    if failed:
        raise SystemExit(f"training failed for {', '.join(failed)}")


def train_in_processes(configs: Iterable[Any], parallel: int, out_dir: Path) -> None:
    """Train ``configs`` (run configs) ``parallel`` at a time, each in a process of its own
    (:func:`run_parallel`): each config written to ``{out_dir}/{run name}.yaml`` and trained
    by ``python -m dynaseq train`` (a finished run stops at once; an interrupted one
    resumes). For an accelerator that one small run leaves mostly idle."""
    from dynaseq.core.config import save_config

    jobs = {}
    for cfg in configs:
        name = Path(cfg.run_dir).name
        path = Path(out_dir) / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_config(cfg, path)
        jobs[name] = [sys.executable, "-m", "dynaseq", "train", str(path), "--quiet"]
    run_parallel(jobs, parallel, Path(out_dir))


UNLABELLED = RUNS / "glue_unlabelled.txt"


def write_unlabelled(configs: dict[str, str], path: Path = UNLABELLED) -> Path:
    """The training sentences of each GLUE task (name -> its fine-tuning config), both sides
    of a pair, one a line, labels dropped, written atomically to ``path`` (MLM pre-training
    text; dev sentences are never read); returns ``path``."""
    from dynaseq.core.files import atomic_write
    from dynaseq.tasks.classify.glue import GLUE_TASKS, read_table
    from dynaseq.tasks.registry import load_config

    lines = []
    for task, config in configs.items():
        cfg = load_config(config, [])
        ex = read_table(cfg.data.train, GLUE_TASKS[task], labelled=False)
        lines += ex.text_a + (ex.text_b or [])
    atomic_write(path, "\n".join(lines) + "\n")
    return path


# -------------------------------------------------------------------------------- results


def paired_diff_ci(metric: Callable[[list, list], float], gold: list, a: list, b: list,
                   n_resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of ``metric(gold, a) - metric(gold, b)`` over resampled rows,
    the same rows for both (``scipy.stats.bootstrap`` over the row indices): how far apart
    two methods' scores on one dev set could be by the draw of its rows."""
    import numpy as np
    from scipy.stats import bootstrap

    assert len(gold) == len(a) == len(b)

    def diff(rows: np.ndarray) -> float:
        g = [gold[i] for i in rows]
        return metric(g, [a[i] for i in rows]) - metric(g, [b[i] for i in rows])

    res = bootstrap((np.arange(len(gold)),), diff, vectorized=False, n_resamples=n_resamples,
                    method="percentile", random_state=seed)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def committed_rows(path: Path, key: str, date_field: str | None = None,
                   default_date: str | None = None) -> dict[str, dict]:
    """Rows of the committed result file ``path`` by ``row[key]`` ({} when there is none), to
    carry into a report that does not re-measure them. With ``date_field``, each row gets a
    ``measured`` date: its own, else the file's ``date_field``, else ``default_date``."""
    path = Path(path)
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    rows = {}
    for r in data["rows"]:
        if key not in r:
            raise ValueError(f"{path}: a row has no {key!r}: {r}")
        if date_field is not None:
            r = {**r, "measured": r.get("measured", data.get(date_field, default_date))}
        rows[r[key]] = r
    return rows


def dense_like(size: str, vocab: int) -> Any:
    """The untrained dense model (seed 0, eval mode) of the DMB / MoE configs' shape (3+3
    layers of ``configs/multi30k_tiny.yaml``) at ``size``."""
    import torch

    from dynaseq.tasks.registry import load_config
    from dynaseq.tasks.translation.model import build_seq2seq

    torch.manual_seed(0)
    cfg = load_config("configs/multi30k_tiny.yaml", [] if size == "tiny" else [
        f"model.size={size}", "model.d_model=null", "model.ffn_dim=null",
        "model.n_heads=null"]).model
    return build_seq2seq(cfg, vocab).eval()


def untrained_cct(vocab: int) -> Any:
    """The untrained CCT of ``configs/multi30k_cct_small.yaml`` (seed 0, no dropout), eval
    mode."""
    import torch

    from dynaseq.tasks.registry import load_config
    from dynaseq.tasks.translation.model import build_seq2seq

    torch.manual_seed(0)
    cfg = load_config("configs/multi30k_cct_small.yaml", ["model.dropout=0.0"]).model
    return build_seq2seq(cfg, vocab).eval()


def md_head(title: str, command: str, *lines: str) -> list[str]:
    """The head of a result's Markdown: ``# title``, the command, then ``lines`` (one per line,
    Markdown line breaks between them), then a blank line."""
    body = [f"Command: `{command}`", *lines]
    return [f"# {title}", "", *(f"{x}  " for x in body[:-1]), body[-1], ""]


def recipe_lines(out: dict) -> list[str]:
    """The head line naming the commands that build every run and row of results ``out``
    (its ``recipe``); none for results written before they recorded one."""
    return [f"Recipe (all runs and rows): `{out['recipe']}`"] if out.get("recipe") else []


def md_table(header: Iterable[str], aligns: str, rows: Iterable[Iterable[object]]) -> list[str]:
    """Lines of a Markdown table: ``header``, the separator (one letter of ``aligns`` per
    column: ``l`` left, ``r`` right aligned) and one line per row of cells (``str()``-ed)."""
    header = list(header)
    if len(aligns) != len(header) or set(aligns) - {"l", "r"}:
        raise ValueError(f"aligns {aligns!r}: one of l/r per column of {header}")
    lines = ["| " + " | ".join(header) + " |",
             "|" + "".join("---:|" if a == "r" else "---|" for a in aligns)]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(header):
            raise ValueError(f"row {cells} has {len(cells)} cells, the header {len(header)}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename, so
    a reader (or an interrupted run) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_results(results: Path, stem: str, data: dict, md_lines: list[str] | None = None,
                  json_newline: bool = False) -> None:
    """Write ``results/stem.json`` (``data``, indent 1; a final newline with ``json_newline``)
    and, given ``md_lines``, ``results/stem.md`` (the lines, each ending in a newline)."""
    if not stem or "/" in stem:
        raise ValueError(f"stem must be a file name without suffix, not {stem!r}")
    write_atomic(Path(results) / f"{stem}.json",
                 json.dumps(data, indent=1) + ("\n" if json_newline else ""))
    if md_lines is not None:
        write_atomic(Path(results) / f"{stem}.md", "\n".join(md_lines) + "\n")


# ------------------------------------------------------------------------------- registries


def registry(name: str, section: str, fields: Iterable[str] = ()) -> dict[str, Any]:
    """Section ``section`` of ``benchmarks/variants/NAME.yaml``: a mapping of entry name ->
    entry, in file order, each entry a mapping holding at least ``fields``. Raises
    ``ValueError`` for a missing section or a malformed entry."""
    data = variants_file(name)
    if section not in data:
        raise ValueError(f"{VARIANTS_DIR / name}.yaml has no section {section!r}")
    entries = data[section]
    if not isinstance(entries, dict):
        raise ValueError(f"{name}.yaml: {section} must map names to entries")
    for entry, value in entries.items():
        missing = [f for f in fields if not isinstance(value, dict) or f not in value]
        if missing:
            raise ValueError(f"{name}.yaml: {section}.{entry} lacks {', '.join(missing)}")
    return entries


def variants_file(name: str) -> dict[str, Any]:
    """The whole of ``benchmarks/variants/NAME.yaml`` (a mapping)."""
    import yaml

    path = VARIANTS_DIR / f"{name}.yaml"
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping")
    return data
