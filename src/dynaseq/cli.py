"""The ``dynaseq`` command: train, translate, evaluate, profile, average, demo; for language
models also generate, prune, quantize (QAT), cache-search and distill-data; for encoders
classify, calibrate and prune-heads (early exit: ``--gamma``/``--depth`` of an
adaptive-depth run, ``--exit-rule`` of a multi-exit one, ``--keep-layers``); serve.

Language-model pipeline (MicroNet), each step a new run directory::

    dynaseq train configs/wikitext2_tiny.yaml
    dynaseq distill-data runs/teacher --out runs/teacher_top30 --k 30
    dynaseq prune runs/lm --out runs/lm_p40 --sparsity 0.4 --steps 200
    dynaseq quantize runs/lm_p40 --out runs/lm_p40_q9 --bits 9 --steps 200
    dynaseq cache-search runs/lm_p40_q9 --out runs/lm_final --cache-sizes 3000
    dynaseq evaluate runs/lm_final --split test --json     # ppl, ppl_cache
    dynaseq profile runs/lm_final --json                   # ... micronet score

Bad input (missing files, bad configs, corrupt checkpoints) prints one line on stderr and
exits with status 2; an interrupted training run exits 130 (SIGINT) or 143 (SIGTERM) after
writing a checkpoint it can resume from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import signal
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from dynaseq import __version__
from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import os_reason, user_path
from dynaseq.core.rundir import check_not_shipped

EXIT_BAD_INPUT = 2


def _std(which: str, files: bool = True) -> Any:
    """``sys.stdin`` (``which="input"``) or ``sys.stdout`` (``"output"``); a DynaseqError
    when the process was started with it closed (cron, a daemon): Python sets it to None.
    ``files``: the command takes ``--input``/``--output`` instead (the error says so)."""
    stream = sys.stdin if which == "input" else sys.stdout
    if stream is None:
        flag = "--input" if which == "input" else "--output"
        raise DynaseqError(f"standard {which} is closed" + (f": give {flag} FILE" if files
                                                            else ""))
    return stream


def _read_input(path: str | None, strip: bool = True) -> list[str]:
    """The lines of ``path`` or of standard input (``None``/``-``), split by one rule
    (:func:`~dynaseq.data.text.decode_lines`; ``strip``: each line stripped)."""
    from dynaseq.data.text import decode_lines, read_lines

    if path is None or path == "-":
        return decode_lines(_std("input").buffer.read(), "stdin", strip=strip)
    return read_lines(path, strip=strip)


def _check_output(out: str | None, *inputs: str | None, run_dir: str | None = None,
                  folder: bool = False) -> None:
    """Refuse an output file that is one of the inputs, that lies in the run directory
    ``run_dir`` (it would overwrite the model's files, or add one that a later load reads),
    or that is a directory (unless the output is a ``folder``), or that cannot be written
    (:func:`~dynaseq.core.files.check_writable`), before anything is read or written."""
    from dynaseq.core.files import check_writable, inside, same_file

    if out is None or out == "-":
        _std("output")  # standard output it is: refused now if closed, not after the work
        return
    if not folder and Path(out).is_dir():
        raise DynaseqError(f"the output {out} is a directory: give a file")
    if folder and Path(out).exists() and not Path(out).is_dir():
        raise DynaseqError(f"the output {out} is a file: give a folder")
    for inp in inputs:
        if inp is not None and inp != "-" and same_file(out, inp):
            raise DynaseqError(f"the output {out} is the input {inp}: choose another file")
    if run_dir is not None and inside(out, run_dir):
        raise DynaseqError(f"the output {out} is inside the run directory {run_dir}: write "
                           "it elsewhere")
    check_writable(Path(out) / "_" if folder else out)  # not hours of work, then refused


def _print_result(args: argparse.Namespace, result: object, text: Callable[[], str]) -> int:
    """A command's report on stdout: ``result`` as indented JSON with ``--json``, else
    ``text()``, the human-readable lines (a closed stdout: an error, not a report lost).
    Returns the exit status, 0."""
    print(json.dumps(result, indent=1) if args.json else text(), file=_std("output"))
    return 0


def _write_output(lines: list[str], path: str | None) -> None:
    """Standard output, or ``path`` written atomically (a failure leaves the old file)."""
    if path is None or path == "-":
        out = _std("output")
        out.write("".join(line + "\n" for line in lines))
        out.flush()
    else:
        from dynaseq.data import write_lines

        write_lines(path, lines)


def cmd_train(args: argparse.Namespace) -> int:
    from dynaseq.tasks.registry import load_config
    from dynaseq.train.loop import train

    overrides = list(args.overrides)
    if args.run_dir is not None:  # as a string ("yes", "1" too); an empty one is refused
        overrides.append(f"run_dir={json.dumps(args.run_dir)}")
    cfg = load_config(args.config, overrides)
    if args.print_config:  # the resolved config, defaults included; nothing is written
        import yaml

        from dynaseq.core.config import to_dict

        sys.stdout.write(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    result = train(cfg, progress=not args.quiet)  # the config's task (task: lm or seq2seq)
    if result.stopped_by_signal is not None:
        print(f"stopped by signal at step {result.state.step}; checkpoint saved in "
              f"{result.run_dir} (run the same command to resume)", file=sys.stderr)
        return 128 + int(result.stopped_by_signal)
    print(f"trained to step {result.state.step}: {result.run_dir}", file=sys.stderr)
    return 0


def _translator(args: argparse.Namespace):
    from dynaseq.tasks.translation.predictor import Translator

    return Translator.load(args.run_dir, checkpoint=args.checkpoint, device=args.device,
                           precision=args.precision)


def cmd_translate(args: argparse.Namespace) -> int:
    if args.stream:
        return _translate_stream(args)
    _check_output(args.output, args.input, run_dir=args.run_dir)
    lines = _read_input(args.input)
    t = _translator(args)
    out = t.translate(lines, beam=args.beam, length_penalty=args.length_penalty,
                      batch_size=args.batch_size, budget=args.budget, progress=not args.quiet)
    _write_output(out, args.output)
    return 0


def _translate_stream(args: argparse.Namespace) -> int:
    def answerer() -> Callable[[str], str]:
        t = _translator(args)
        return lambda line: t.translate([line], beam=args.beam, batch_size=1,
                                        length_penalty=args.length_penalty,
                                        budget=args.budget)[0]

    return _stream(args, "translate", answerer)


def _stream(args: argparse.Namespace, command: str,
            answerer: Callable[[], Callable[[str], str]], strip: bool = True) -> int:
    """``COMMAND --stream``: each line of standard input answered as soon as it is read (batch
    1) and the answer printed at once, for interactive use (a terminal, or a pipe whose
    other end waits for each answer), where the end of input never comes. ``answerer``
    loads the model (after the options are checked) and gives the one-line function;
    ``strip``: each line stripped (:func:`~dynaseq.data.text.decode_lines`)."""
    from dynaseq.data.text import decode_lines

    for flag, value in (("--input", args.input), ("--output", args.output)):
        if value not in (None, "-"):
            raise DynaseqError(f"{command} --stream reads standard input and writes standard "
                               f"output: drop {flag} {value}")
    stdin, stdout = _std("input", False), _std("output", False)  # before the model loads
    answer = answerer()
    for n, raw in enumerate(iter(stdin.buffer.readline, b""), start=1):
        (line,) = decode_lines(raw, "stdin", first_line=n, strip=strip)
        stdout.write(answer(line) + "\n")
        stdout.flush()
    return 0


def _evaluate_seq2seq(args: argparse.Namespace) -> int:
    from dynaseq.data import read_lines

    _refuse_classify_exits(args)
    _refuse_given(args, ("data",), "classification and MLM")
    _refuse_given(args, ("split",), "language-model and MLM")
    if args.src is None or args.ref is None:
        raise DynaseqError("evaluate: --src and --ref are required for translation runs")
    src, ref = read_lines(args.src), read_lines(args.ref)
    if len(src) != len(ref):
        raise DynaseqError(f"{args.src} has {len(src)} lines but {args.ref} has {len(ref)}")
    if not src:
        raise DynaseqError(f"evaluate: {args.src} has no lines to evaluate")
    t = _translator(args)
    result = t.evaluate(src, ref, beam=args.beam, length_penalty=args.length_penalty,
                        batch_size=args.batch_size, budget=args.budget,
                        progress=not args.quiet)
    _print_result(args, result, lambda: (
        f"BLEU {result['bleu']:.2f}  loss {result['loss']:.4f}  ppl {result['ppl']:.2f}  "
        f"PTR {result['ptr']:.2f}  ({result['n_sentences']} sentences)\n{result['signature']}"))
    if result.get("collapsed"):
        from dynaseq.techniques.branching.usage import COLLAPSE_SHARE

        n, names = len(result["branch_usage"]), result["collapsed"]
        print(f"dynaseq: warning: routing collapsed in {len(names)} of {n} gating units (one "
              f"branch ran over {COLLAPSE_SHARE:.0%} of their tokens): {', '.join(names)}",
              file=sys.stderr)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dynaseq.data import read_lines

    _refuse_given(args, ("data",), "classification")
    if args.src is None or args.ref is None:
        raise DynaseqError("calibrate: --src and --ref are required for translation runs")
    src, ref = read_lines(args.src), read_lines(args.ref)
    if len(src) != len(ref):
        raise DynaseqError(f"{args.src} has {len(src)} lines but {args.ref} has {len(ref)}")
    with _calibration_lock(args):
        t = _translator(args)
        fitted = t.calibrate(src[: args.lines], ref[: args.lines], budgets=args.budgets,
                             tol=args.tol, progress=not args.quiet)
        path = t.save_calibration(args.run_dir, {"src": args.src, "ref": args.ref,
                                                 "lines": min(args.lines, len(src))})
    print("budget (enc, dec)  control  offset enc  offset dec  realized before -> after")
    for c in fitted:
        before, after = c.uncalibrated, c.realized
        print(f"({c.budget[0]:g}, {c.budget[1]:g})".ljust(19) + f"{c.control:>7}  "
              f"{c.offsets['encoder']:>+10.3f}  {c.offsets['decoder']:>+10.3f}  "
              f"({before['encoder']:.3f}, {before['decoder']:.3f}) -> "
              f"({after['encoder']:.3f}, {after['decoder']:.3f})")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _at_precision(model, args: argparse.Namespace):
    """``profile CONFIG``'s freshly built ``model`` at ``--precision`` (a run directory's
    model gets it from its loader); returns the model."""
    from dynaseq.core.distributed import pick_dtype

    return model.to(pick_dtype(args.precision))


def cmd_profile(args: argparse.Namespace) -> int:
    from dynaseq.metrics.profile import profile_model
    from dynaseq.tasks.translation.predictor import budget_pair, control_for_budget

    target = Path(args.target)
    if args.latency_table:
        _refuse_exit(args)
        if args.budget is not None:
            raise DynaseqError("profile: --latency-table times every trained and calibrated "
                               "budget; --budget is for a profile at one")
        given = [f"--{n.replace('_', '-')}" for n in ("src_len", "tgt_len", "batch")
                 if getattr(args, n) is not None]
        if given:  # they would be ignored
            raise DynaseqError(f"profile: --latency-table times --table-lengths x "
                               f"--table-batches; {', '.join(given)} "
                               f"{'is' if len(given) == 1 else 'are'} for one profile")
        return _profile_latency_table(args)
    if target.is_dir() and _run_dir_kind(str(target)) == "lm":
        return _profile_lm(args)
    if target.is_dir() and _run_dir_kind(str(target)) in ENCODER_KINDS:
        return _profile_encoder(args)
    if target.is_dir():
        args.run_dir = str(target)
        t = _translator(args)
        model, model_cfg = t.model, t.config.model
        budget_ctx = t.at_budget(args.budget)  # with the run's calibration, if any
    elif target.is_file():
        from dynaseq.tasks.registry import load_config
        from dynaseq.tasks.translation.model import build_seq2seq
        from dynaseq.techniques.branching import merge_shared_

        cfg = load_config(target, args.overrides)
        if getattr(cfg, "task", None) == "lm":  # random weights, vocabulary of data.train
            return _profile_lm(args, cfg)
        if getattr(cfg, "task", None) in ENCODER_KINDS:  # random weights
            return _profile_encoder(args, cfg)
        model, model_cfg = build_seq2seq(cfg.model, cfg.data.vocab_size).eval(), cfg.model
        merge_shared_(model)  # DMB: as Translator.load runs it
        _at_precision(model, args)
        budget_ctx = contextlib.nullcontext(control_for_budget(cfg.model, args.budget))
    else:
        raise DynaseqError(f"profile: {target} is neither a run directory nor a config file")
    _refuse_exit(args)
    args.src_len, args.tgt_len = args.src_len or 30, args.tgt_len or 30
    args.batch = args.batch or 1
    longest = max(args.src_len, args.tgt_len + 1)  # the decoder reads bos + the target
    if longest > model_cfg.max_positions:
        raise DynaseqError(f"profile: {longest} positions (--src-len, or --tgt-len + 1 for "
                           f"the decoder's bos) exceed the model's max_positions="
                           f"{model_cfg.max_positions}")
    with budget_ctx as control:
        result = profile_model(model, args.src_len, args.tgt_len, args.repeats, args.batch,
                               control=control)
    if args.budget is not None:  # what the flop counter's count and the latencies ran at
        result["budget"] = list(budget_pair(args.budget))
        offsets = getattr(control, "offsets", None)
        result["gate_offsets"] = None if offsets is None else {
            k: "+inf" if v == math.inf else v for k, v in offsets.items()}

    def text() -> str:
        mpt, fc = result["macs_per_token"], result["macs_per_token_flop_counter"]
        # dense models: the counter confirms the analytic count; CCT models: the analytic
        # count is the all-gates-on maximum and the counter measures what ran at this budget
        label = "ran at this budget" if model.n_controls else "flop counter"
        pair, lat = result["macs_pair"], result["latency_ms"]
        return "\n".join([
            f"params            {result['params']:,}",
            *(f"MACs/token {part:<8} {mpt[part] / 1e6:9.3f} M  ({label} {fc[part] / 1e6:.3f} M)"
              for part in ("encoder", "decoder", "total")),
            f"MACs {pair['src_tokens']}->{pair['tgt_tokens']} pair   {pair['total'] / 1e6:9.3f} M"
            "  (DMB paper convention: whole pass, output layer included)",
            f"latency {args.src_len}->{args.tgt_len} tokens, batch {lat['batch']}: "
            f"greedy {lat['greedy']:.1f} ms, beam 4 {lat['beam4']:.1f} ms"])

    return _print_result(args, result, text)


def _profile_latency_table(args: argparse.Namespace) -> int:
    """``dynaseq profile RUN --latency-table``: service time per budget x batch size x
    length, written to RUN/latency_table.json (what ``dynaseq serve`` predicts from); a
    translation run's decoding, or a classification run's classifying (``--table-src``:
    the lines to time, as ``dynaseq classify`` reads them; default the run's validation
    sentences)."""
    from dynaseq.metrics.latency_table import LATENCY_TABLE_FILE, budget_key

    target = Path(args.target)
    kind = _run_dir_kind(str(target)) if target.is_dir() else None
    if kind not in ("seq2seq", "classify"):
        raise DynaseqError(f"profile --latency-table: {target} is not a translation or "
                           "classification run directory")
    for name in ("table_batches", "table_lengths"):
        values = getattr(args, name)
        if not values or min(values) < 1:
            raise DynaseqError(f"--{name.replace('_', '-')} must be integers >= 1")
    check_not_shipped(target, LATENCY_TABLE_FILE)
    args.run_dir = str(target)
    table = (_translate_latency_table if kind == "seq2seq" else _classify_latency_table)(args)
    path = table.save(target / LATENCY_TABLE_FILE)

    def text() -> str:
        head = "budget".ljust(12) + "".join(f"{f'b{b} L{n}':>10}" for b in table.batch_sizes
                                            for n in table.lengths) + "   fit err"
        rows = [("(" + ", ".join(f"{x:g}" for x in p) + ")").ljust(12)
                + "".join(f"{v:>10.1f}" for r in table.service_ms[budget_key(p)]
                          for v in r) + f"{100 * table.fit_error(p):>9.0f}%"
                for p in table.budgets]
        what = f"beam {table.beam}, " if kind == "seq2seq" else ""
        return "\n".join([f"service ms ({what}{table.threads} threads), batch x "
                          "source length; fit err: the median distance of the cells from "
                          f"the fitted model (predictions: {table.predict}):", head, *rows])

    _print_result(args, table.to_json(), text)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _translate_latency_table(args: argparse.Namespace):
    from dynaseq.metrics.latency_table import measure_latency_table

    t = _translator(args)
    longest = max(args.table_lengths)
    if longest + 2 > t.config.model.max_positions:
        raise DynaseqError(f"profile: length {longest} exceeds the model's max_positions="
                           f"{t.config.model.max_positions}")
    cct = t.config.model.cct
    pairs = [(1.0, 1.0)] if cct is None else list(dict.fromkeys(
        [*cct.controls, *(c.budget for c in t.calibrations)]))
    controls = {p: t.control_for(None if cct is None else p) for p in pairs}
    beam = args.beam or t.config.decode.beam
    sources = None
    if args.table_src is not None:
        from dynaseq.data import read_lines

        sources = t.tokenizer.encode_kept(read_lines(args.table_src))[1]
    d = t.config.decode
    after, timed = None, "decode"
    if not args.no_compute:  # time what dynaseq serve runs: the decode, then each line's
        from dynaseq.serve.compute import ServedCompute  # realized compute

        after = ServedCompute(t.model)
        timed = "decode + realized compute per line (dynaseq serve's default)"
    return measure_latency_table(t.model, controls, sorted(set(args.table_batches)),
                                 sorted(set(args.table_lengths)), beam=beam,
                                 repeats=args.repeats, checkpoint=str(t.checkpoint),
                                 sources=sources, max_len_a=d.max_len_a,
                                 max_len_b=d.max_len_b, progress=not args.quiet,
                                 after=after, timed=timed, predict=args.table_predict)


def _classify_latency_table(args: argparse.Namespace):
    """A classification run's table: each trained and calibrated budget (a dense encoder:
    one row, ``(1,)``) over real sentences, with each row's realized compute as the server
    reports it unless ``--no-compute``."""
    from dynaseq.data import read_lines
    from dynaseq.serve.compute import encoder_compute_per_row
    from dynaseq.tasks.classify.latency_table import measure_classify_latency_table

    if args.beam is not None:
        raise DynaseqError("--beam is for translation runs")
    c = _classifier(args)
    longest = max(args.table_lengths)
    if longest > c.config.data.max_len:
        raise DynaseqError(f"profile: length {longest} exceeds the run's data.max_len="
                           f"{c.config.data.max_len}")
    if args.table_src is not None:  # read as classify reads it (empty lines skipped there)
        lines = read_lines(args.table_src, strip=False)
    else:
        from dynaseq.data.datasets import resolve_data_path
        from dynaseq.tasks.classify.glue import read_table

        ex = read_table(resolve_data_path(c.config.data.valid), c.layout, labelled=False)
        lines = ex.text_a if ex.text_b is None else list(zip(ex.text_a, ex.text_b,
                                                             strict=True))
    rows, _ = c.encode(lines)
    cct = c.config.model.cct
    budgets = [None] if cct is None else list(dict.fromkeys(
        float(b[0] if isinstance(b, tuple) else b)
        for b in [*cct.controls, *(cal.budget for cal in c.calibrations)]))
    after, timed = None, "classify"
    if not args.no_compute:
        def after(batch, budgets, compute) -> None:
            encoder_compute_per_row(c.model, batch, compute if cct is not None else None)

        timed = "classify + realized compute per line (dynaseq serve's default)"
    return measure_classify_latency_table(c, budgets, sorted(set(args.table_batches)),
                                          sorted(set(args.table_lengths)), rows,
                                          repeats=args.repeats, checkpoint=str(c.checkpoint),
                                          progress=not args.quiet, after=after, timed=timed,
                                          predict=args.table_predict)


def cmd_serve(args: argparse.Namespace) -> int:
    """``dynaseq serve RUN --host 127.0.0.1 --port 8000``: the budget-aware HTTP server."""
    import importlib.util

    from dynaseq.serve.config import ServeConfig
    from dynaseq.serve.server import serve

    missing = [m for m in ("fastapi", "uvicorn", "pydantic", "prometheus_client")
               if importlib.util.find_spec(m) is None]
    if missing:  # the server's libraries are an extra: say which, not a traceback
        raise DynaseqError(f"serve needs the serve extra (missing {', '.join(missing)}): "
                           "pip install 'dynaseq[serve]'")

    if _run_dir_kind(args.run_dir) != "seq2seq":
        _refuse_given(args, ("beam", "continuous"), "translation")
    cfg = ServeConfig(
        host=args.host, port=args.port, batch_window_ms=args.batch_window_ms,
        max_batch_rows=args.max_batch_lines, max_queue_rows=args.max_queue_lines,
        max_in_flight=args.max_in_flight,
        max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s,
        max_lines=args.max_lines,
        max_line_chars=args.max_line_chars, max_tokens=args.max_tokens, beam=args.beam,
        overload=args.overload, slack=args.slack, batch_margin=args.batch_margin,
        max_utilization=args.max_utilization,
        report_compute=not args.no_compute,
        access_log=not args.no_access_log, default_budget=args.default_budget,
        workers=args.workers, early_answers=not args.answer_at_batch_end,
        batch_nice=args.batch_nice, batch_by_budget=not args.mixed_batches,
        scale_by_size=args.scale_by_size,
        precision=args.precision, continuous=bool(args.continuous))
    return serve(args.run_dir, cfg, checkpoint=args.checkpoint, device=args.device,
                 latency_table=args.latency_table, threads=args.threads)


def cmd_average(args: argparse.Namespace) -> int:
    from dynaseq.core.checkpoint import average_checkpoints, list_checkpoints
    from dynaseq.core.run_lock import RunDirLock

    if not Path(args.run_dir).is_dir():
        raise DynaseqError(f"run directory not found: {args.run_dir}")

    def picked() -> list[Path]:
        found = list_checkpoints(args.run_dir)
        if not found:
            raise DynaseqError(f"no step checkpoints (checkpoints/step_*) to average in "
                               f"{args.run_dir}")
        return found[-args.k:]

    picked()  # refused before the lock file is made
    # the run's lock: a training run or another `average` writing here is refused, one line
    with RunDirLock(Path(args.run_dir)):
        chosen = picked()
        out = average_checkpoints(chosen, Path(args.run_dir) / "averaged")
    fewer = f" (-k {args.k}: the run has {len(chosen)})" if len(chosen) < args.k else ""
    print(f"averaged {len(chosen)} checkpoints into {out}{fewer}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dynaseq.workflows.demo import run_demo

    _check_output(args.out, folder=True)
    for held in ("config.yaml", "config.json"):  # the demo's folder holds data/ and run/
        if (Path(args.out) / held).is_file():
            raise DynaseqError(f"--out {args.out} is a run or model directory ({held}): give "
                               "the demo a folder of its own")
    run_demo(args.out, train_new=args.train, minutes=args.minutes, steps=args.steps,
             seed=args.seed, progress=not args.quiet)
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from dynaseq.data import read_lines
    from dynaseq.workflows.analyze import analyze, output_names, write_analysis

    if args.max_lines is not None and args.max_lines < 1:
        raise DynaseqError("--max-lines must be >= 1")
    _check_output(args.out, run_dir=args.run_dir, folder=True)
    for name in output_names():
        _check_output(str(Path(args.out) / name), args.src, args.ref)
    src = read_lines(args.src)
    ref = None if args.ref is None else read_lines(args.ref)
    t = _translator(args)
    result = analyze(t, src, ref, budgets=args.budget, beam=args.beam,
                     max_lines=args.max_lines, progress=not args.quiet)
    result = {"run_dir": str(args.run_dir), "src": args.src, "ref": args.ref, **result}
    paths = write_analysis(result, args.out)
    print(f"analyzed {result['n_sentences']} sentences at {len(result['budgets'])} budgets: "
          f"{len(paths)} files in {args.out}", file=sys.stderr)
    return 0


def _run_dir_kind(run_dir: str) -> str:
    """``"seq2seq"`` or ``"lm"``: the task of a run directory (a clear error if it is none)."""
    from dynaseq.tasks.registry import run_kind

    return run_kind(run_dir)  # a bad config fails here, with its own message


def _quantize_seq2seq(args: argparse.Namespace) -> int:
    """``dynaseq quantize RUN_DIR --out NEW_DIR``: int8 weights (translation runs)."""
    from dynaseq.workflows.quantize import quantize_run

    if args.bits is not None or args.steps or args.lr is not None:
        raise DynaseqError("quantize: --bits, --steps and --lr are for language-model runs "
                           "(translation runs are quantized to int8)")

    rep = quantize_run(args.run_dir, args.out, checkpoint=args.checkpoint)

    def mb(n: int) -> str:
        return f"{n / 1e6:.2f} MB"

    print(f"int8 run written to {rep.out_dir}\n"
          f"weights  {mb(rep.weights_before)} -> {mb(rep.weights_after)}  "
          f"({rep.weights_before / max(rep.weights_after, 1):.1f}x smaller; from "
          f"{rep.checkpoint})\n"
          f"run dir  {mb(rep.run_before)} -> {mb(rep.run_after)}")
    if rep.calibrated:
        print(f"calibration of {rep.calibrated} budget(s) carried over, as fitted on the float "
              f"model (dynaseq calibrate {rep.out_dir} fits it to the int8 one)")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    """``dynaseq data check [ROOT] [--dataset NAME]``: every file of the datasets against its
    sha256; exit 1 when one is missing or differs."""
    from dynaseq.data.datasets import DATASETS, check_data, data_root

    root = Path(args.root) if args.root else data_root()
    if args.root and not root.is_dir():  # the default one lists what to get, and where
        raise DynaseqError(f"data root {root} is not a directory")
    checks = check_data(root, args.dataset)
    bad = 0
    for name in dict.fromkeys(c.dataset for c in checks):
        mine = [c for c in checks if c.dataset == name]
        missing = [c for c in mine if c.status == "missing"]
        differ = [c for c in mine if c.status == "mismatch"]
        ok = len(mine) - len(missing) - len(differ)
        line = f"{name}: {ok}/{len(mine)} files ok"
        if missing:
            line += f"; missing {len(missing)} (e.g. {missing[0].path})"
        if differ:
            line += f"; {len(differ)} differ from their sha256 ({differ[0].path})"
        if missing or differ:
            line += f"; get it from {DATASETS[name].upstream}"
        print(line)
        bad += len(missing) + len(differ)
    print(f"data root {root}: " + ("all files present and verified" if not bad else
                                   f"{bad} file(s) missing or different (see docs/data.md)"))
    return 1 if bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    """``dynaseq export RUN --out DIR``: a self-contained model directory."""
    from dynaseq.workflows.export import export_model

    rep = export_model(args.run_dir, args.out, checkpoint=args.checkpoint)
    print(f"model directory written to {rep.out_dir} (from {rep.checkpoint}): "
          f"{', '.join(rep.files)}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """``dynaseq plot RUN... --out FILE.png``: training and validation curves."""
    from dynaseq.analysis.curves import plot_curves, read_curves

    if Path(args.out).suffix.lower() != ".png":
        raise DynaseqError(f"--out {args.out} must be a .png file")
    for run in args.runs:
        _check_output(args.out, run_dir=run)
    out = plot_curves(read_curves(args.runs), args.out)
    print(f"curves of {len(args.runs)} run(s) written to {out}")
    return 0


def _quantize_lm(args: argparse.Namespace) -> int:
    """``dynaseq quantize LM_RUN --out NEW_DIR --bits 9 --steps 200``: QAT fine-tuning,
    conversion and an exact-representability check."""
    from dynaseq.workflows.lm_runs import qat_lm_run

    if args.bits is None:
        args.bits = 9
    rep = qat_lm_run(args.run_dir, args.out, args.bits, args.steps, args.lr,
                     checkpoint=args.checkpoint, progress=not args.quiet)
    kept = (f", kept step {rep['kept_step']}" if rep.get("kept_step") else
            ", kept the calibrated start" if "kept_step" in rep else "")
    print(f"{args.bits}-bit QAT run written to {args.out} ({rep['steps']} fine-tuning steps"
          f"{kept}): valid ppl {rep['valid_ppl_before']:.2f} -> "
          f"{rep['valid_ppl_calibrated']:.2f} calibrated -> {rep['valid_ppl_after']:.2f}; all "
          f"{len(rep['representable'])} quantized matrices exactly representable")
    return 0


def _check_lr(args: argparse.Namespace) -> None:
    if args.lr is not None and args.lr <= 0:
        raise DynaseqError(f"--lr must be > 0, got {args.lr}")


def _check_quantize(args: argparse.Namespace) -> None:
    _check_lr(args)
    if args.bits is not None:  # checked before anything is read or written
        from dynaseq.compress.qat import check_bits

        check_bits(args.bits)


def _check_prune(args: argparse.Namespace) -> None:
    from dynaseq.compress.prune import _check_sparsity

    _check_lr(args)
    _check_sparsity(args.sparsity)  # before anything is read or written


def cmd_prune(args: argparse.Namespace) -> int:
    """``dynaseq prune LM_RUN --out NEW_DIR --sparsity 0.4 --steps 200``."""
    from dynaseq.workflows.lm_runs import prune_lm_run

    rep = prune_lm_run(args.run_dir, args.out, args.sparsity, args.steps, args.grid,
                       args.valid_tokens, args.lr, checkpoint=args.checkpoint,
                       progress=not args.quiet, sensitivity=args.sensitivity,
                       distill=args.distill)
    print(f"pruned run written to {args.out}: sparsity {rep['achieved_sparsity']:.3f} "
          f"(target {rep['target']}, plan {rep['planned_sparsity']:.3f}); valid ppl "
          f"{rep['baseline_ppl']:.2f} -> {rep['valid_ppl_after']:.2f} after "
          f"{rep['steps']} fine-tuning steps (report: prune_report.json)")
    return 0


def _check_prune_heads(args: argparse.Namespace) -> None:
    from dynaseq.compress.head_prune import check_keep

    check_keep(args.keep)  # before anything is read or written


def cmd_prune_heads(args: argparse.Namespace) -> int:
    """``dynaseq prune-heads CLASSIFY_RUN --data dev.tsv --keep 0.5 --out NEW_DIR``."""
    from dynaseq.workflows.head_prune import REPORT_FILE, prune_heads_run

    rep = prune_heads_run(args.run_dir, args.out, args.data, args.keep,
                          checkpoint=args.checkpoint, batch_size=args.batch_size,
                          normalize=not args.no_normalize, device=args.device)
    scores = "  ".join(f"{m} {rep['before'][m]:.4f} -> {rep['after'][m]:.4f}"
                       for m in rep["before"])
    return _print_result(args, rep, lambda: (
        f"pruned run written to {args.out}: heads {rep['heads_before']} -> "
        f"{rep['heads_after']} (per layer {rep['layer_heads']}), params "
        f"{rep['params_before']:,} -> {rep['params_after']:,}; on {args.data}: {scores} "
        f"(report: {REPORT_FILE})"))


def cmd_cache_search(args: argparse.Namespace) -> int:
    """``dynaseq cache-search LM_RUN --out NEW_DIR --cache-sizes 3000 --max-evals 40``."""
    from dynaseq.workflows.lm_runs import cache_search_run

    rep = cache_search_run(args.run_dir, args.out, args.cache_sizes, args.max_evals,
                           args.valid_tokens, checkpoint=args.checkpoint, n_cache=args.n_cache,
                           progress=not args.quiet)
    b, a = rep["before"], rep["after"]
    print(f"valid ppl {rep['valid_ppl']:.2f} ({rep['valid_tokens']:,} tokens)\n"
          f"before: ppl_cache {b['ppl_cache']:.2f}  theta {b['theta']:.4g}  lam "
          f"{b['lam']:.4g}  n_cache {b['n_cache']}\n"
          f"after:  ppl_cache {a['ppl_cache']:.2f}  theta {a['theta']:.4g}  lam "
          f"{a['lam']:.4g}  n_cache {a['n_cache']}  ({len(rep['evaluations'])} evaluations)\n"
          f"written to {args.out}")
    return 0


def _distill_data_lm(args: argparse.Namespace) -> int:
    """``dynaseq distill-data TEACHER_LM --out DIR --k 30``: the teacher's top-k over the
    training stream in the student's order (its --batch-size and --window; default the
    teacher config's data.batch_size and model.extended_context)."""
    from dynaseq.compress.lm_distill import dump_lm_teacher

    _refuse_given(args, ("beam", "budget"), "translation")
    if args.k is None:
        args.k = 30
    if Path(args.out).exists():
        raise DynaseqError(f"{args.out} already exists (choose a new --out)")
    _check_output(args.out, run_dir=args.run_dir, folder=True)
    lm = _language_model(args)
    topk = dump_lm_teacher(lm, args.out, args.k, args.batch_size, args.window, args.src,
                           progress=not args.quiet)
    print(f"wrote the teacher's top-{topk.k} for {topk.n_tokens:,} training tokens to "
          f"{args.out} (train the student with train.distill.topk_dir={args.out} and the "
          f"same data.batch_size / model.extended_context)", file=sys.stderr)
    return 0


def _distill_data_seq2seq(args: argparse.Namespace) -> int:
    from dynaseq.data import read_lines
    from dynaseq.workflows.distill_data import write_distill_data

    if args.src is None:
        raise DynaseqError("distill-data: --src is required for translation runs")
    _refuse_given(args, ("k", "window"), "language-model")
    if args.beam is None:
        args.beam = 4
    _check_output(args.out, args.src, run_dir=args.run_dir)
    read_lines(args.src)  # a missing source fails before the model loads
    t = _translator(args)
    n = write_distill_data(t, args.src, args.out, beam=args.beam, batch_size=args.batch_size,
                           budget=args.budget, progress=not args.quiet)
    print(f"wrote {n} teacher translations to {args.out} (train the student with "
          f"data.train_tgt={args.out})", file=sys.stderr)
    return 0


def _refuse_given(args: argparse.Namespace, names: tuple[str, ...], runs: str,
                  this: str | None = None) -> None:
    """Refuse (one line) the options in ``names`` that were given: they are for ``runs``
    only and would be silently dropped on this run (``this``: what it is; default the
    run directory's kind)."""
    given = [f"--{name.replace('_', '-')}" for name in names
             if getattr(args, name, None) is not None]
    if given:
        verb = "is" if len(given) == 1 else "are"
        this = this or f"{args.run_dir} is a {KIND_NAMES[_run_dir_kind(args.run_dir)]} run"
        raise DynaseqError(f"{args.command}: {', '.join(given)} {verb} for {runs} runs; {this}")


def _language_model(args: argparse.Namespace):
    from dynaseq.tasks.lm.predictor import LanguageModel

    return LanguageModel.load(args.run_dir, checkpoint=args.checkpoint, device=args.device,
                              precision=args.precision)


def _evaluate_lm(args: argparse.Namespace) -> int:
    """``dynaseq evaluate LM_RUN --split valid|test [--json]``: perplexity without (``ppl``)
    and with the neural cache (``ppl_cache``: the run's cache parameters, or n_cache 2000,
    θ 0.016, λ 0.07 for a run without a cache)."""
    _refuse_given(args, ("src", "ref", "budget", "beam", "length_penalty"), "translation")
    _refuse_given(args, ("data",), "classification and MLM")
    _refuse_classify_exits(args)
    split = args.split or "valid"
    lm = _language_model(args)
    result = {"split": split,
              **lm.evaluate(split, batch_size=args.batch_size, with_cache=True,
                            progress=not args.quiet),
              "checkpoint": str(lm.checkpoint)}

    def text() -> str:
        c = result["cache"]
        return (f"{split} ppl {result['ppl']:.2f}  ppl_cache {result['ppl_cache']:.2f}  "
                f"loss {result['loss']:.4f}  ({result['tokens']:,} tokens, "
                f"{result['checkpoint']}; cache {c['source']}: n {c['n_cache']}, "
                f"theta {c['theta']:.4g}, lambda {c['lam']:.4g})")

    return _print_result(args, result, text)


def _encoder_budget(args: argparse.Namespace) -> float | None:
    if isinstance(args.budget, tuple):
        raise DynaseqError("an encoder's budget is one fraction (e.g. --budget 0.5), not "
                           "ENC,DEC")
    return args.budget


def _classifier(args: argparse.Namespace):
    from dynaseq.tasks.classify.predictor import Classifier

    return Classifier.load(args.run_dir, checkpoint=args.checkpoint, device=args.device,
                           precision=args.precision)


def cmd_classify(args: argparse.Namespace) -> int:
    """``dynaseq classify RUN [-i FILE] [-o FILE] [--budget B]``: one sentence (a pair task:
    two tab-separated sentences) per line in, one label or score per line out (an empty line
    for an empty input line)."""
    budget = _encoder_budget(args)

    def classify(c, lines: list[str], batch_size: int | None, progress: bool) -> list[str]:
        out = c.classify(lines, budget=budget, batch_size=batch_size, progress=progress,
                         gamma=args.gamma, depth=args.depth, keep_layers=args.keep_layers,
                         **_layer_exit_args(args))
        return ["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in out]

    if args.stream:  # one line at a time: no progress bar
        def answerer() -> Callable[[str], str]:
            c = _classifier(args)
            return lambda line: classify(c, [line], 1, False)[0]

        return _stream(args, "classify", answerer, strip=False)
    _check_output(args.output, args.input, run_dir=args.run_dir)
    lines = _read_input(args.input, strip=False)  # a pair's fields are stripped one by one
    _write_output(classify(_classifier(args), lines, args.batch_size, not args.quiet),
                  args.output)
    return 0


def _refuse_translation_args(args: argparse.Namespace, what: str) -> None:
    given = [f"--{name.replace('_', '-')}" for name in ("src", "ref", "beam", "length_penalty")
             if getattr(args, name, None) is not None]
    if given:
        raise DynaseqError(f"evaluate: {', '.join(given)} are for translation runs; "
                           f"{args.run_dir} is {what} run")


def _evaluate_classify(args: argparse.Namespace) -> int:
    """``dynaseq evaluate RUN --data dev.tsv [--budget B] [--json]``: the task's official
    metrics (and, for CCT-BERT, the realized compute)."""
    _refuse_translation_args(args, "a classification")
    _refuse_given(args, ("split",), "language-model and MLM")
    if args.data is None:
        raise DynaseqError("evaluate: --data FILE (a labelled TSV in the run's layout) is "
                           "required for classification runs")
    budget = _encoder_budget(args)
    c = _classifier(args)
    result = c.evaluate(args.data, budget=budget, batch_size=args.batch_size,
                        progress=not args.quiet, gamma=args.gamma, depth=args.depth,
                        keep_layers=args.keep_layers, **_layer_exit_args(args))

    def text() -> str:
        metrics = "  ".join(f"{m} {result[m]:.4f}" for m in c.layout.metrics)
        extra = ""
        if "realized_fraction" in result:
            extra = (f"  budget {result['budget']}  realized {result['realized_fraction']:.3f}"
                     f" ({result['realized_macs_per_token'] / 1e6:.3f} M MACs/token)")
        if "exit_rule" in result:
            takes = "patience" if "patience" in result else "threshold"
            how = f"exit rule {result['exit_rule']} {takes} {result[takes]}"
        elif "keep_layers" in result:
            how = f"keep-layers {result['keep_layers']}"
        elif "avg_layers" in result:
            how = (f"gamma {result['gamma']}" if result["depth"] is None
                   else f"depth {result['depth']}")
        if "avg_layers" in result:
            extra += f"  {how}  layers run {result['avg_layers']:.2f} of {c.config.model.layers}"
        return (f"{result['task']} {metrics}  ({result['n_examples']} examples, "
                f"{result['skipped']} skipped){extra}")

    return _print_result(args, result, text)


def _evaluate_mlm(args: argparse.Namespace) -> int:
    """``dynaseq evaluate MLM_RUN [--data FILE] [--budget B] [--json]``: masked-token loss,
    perplexity and accuracy (fixed masks) of the run's valid file or FILE."""
    from dynaseq.tasks.mlm.predictor import MaskedLM

    _refuse_translation_args(args, "an MLM")
    _refuse_classify_exits(args)
    budget = _encoder_budget(args)
    if args.split == "test" and args.data is None:
        raise DynaseqError("evaluate: an MLM run's config has a valid file only; give "
                           "--data FILE for other text")
    m = MaskedLM.load(args.run_dir, checkpoint=args.checkpoint, device=args.device,
                      precision=args.precision)
    result = m.evaluate(args.data or "valid", budget=budget, batch_size=args.batch_size,
                        progress=not args.quiet)
    return _print_result(args, result, lambda: (
        f"MLM loss {result['loss']:.4f}  ppl {result['ppl']:.2f}  accuracy "
        f"{result['accuracy']:.4f}  ({result['n_masked']:,} masked tokens)"))


def _calibrate_classify(args: argparse.Namespace) -> int:
    """``dynaseq calibrate CLASSIFY_RUN --data dev.tsv [--budgets 0.5 0.4]``: one gate offset
    per budget so that its realized compute meets it (CCT-BERT)."""
    _refuse_given(args, ("src", "ref"), "translation")
    if args.data is None:
        raise DynaseqError("calibrate: --data FILE (a TSV in the run's layout) is required for "
                           "classification runs")
    budgets = None
    if args.budgets is not None:
        if any(isinstance(b, tuple) for b in args.budgets):
            raise DynaseqError("an encoder's budget is one fraction (e.g. 0.5), not ENC,DEC")
        budgets = list(args.budgets)
    from dynaseq.data.datasets import resolve_data_path

    if not resolve_data_path(args.data).is_file():
        raise DynaseqError(f"cannot read {args.data}: no such file")
    with _calibration_lock(args):
        c = _classifier(args)
        fitted = c.calibrate(args.data, budgets, lines=args.lines, tol=args.tol)
        path = c.save_calibration(args.run_dir, {"data": args.data, "lines": args.lines})
    print("budget  control  offset  realized before -> after")
    for cal in fitted:
        print(f"{cal.budget[0]:<7g} {cal.control:>7}  {cal.offsets['encoder']:>+6.3f}  "
              f"{cal.uncalibrated['encoder']:.3f} -> {cal.realized['encoder']:.3f}")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _profile_encoder(args: argparse.Namespace, cfg=None) -> int:
    """An encoder run directory, or an encoder config (random weights): params, MACs/token
    (analytic and flop counter), latency at batch 1 and throughput at batch 32 for 32- and
    128-token inputs (those the model's positions take; ``--src-len``: that length)."""
    from dynaseq.metrics.encoder_profile import profile_encoder
    from dynaseq.tasks.encoder.budget import control_for, exit_for, layer_exit_for, layers_for

    budget = _encoder_budget(args)
    _refuse_given(args, ("tgt_len", "batch"), "translation",
                  f"{args.target} is an encoder (batch 1 and 32 are timed)")
    calibrations = []
    if cfg is None:
        args.run_dir = args.target
        predictor = dynaseq_load(args)
        model, model_cfg = predictor.model, predictor.config.model
        calibrations = getattr(predictor, "calibrations", [])  # a classifier's
    else:
        from dynaseq.tasks.encoder.model import MLM, build_encoder_model

        model_cfg = cfg.model
        head = MLM if cfg.task == "mlm" else (cfg.data.layout().n_outputs or 2)
        model = _at_precision(build_encoder_model(model_cfg, cfg.data.vocab_size, head).eval(),
                              args)
    # --src-len, else 32 and 128 tokens where the model takes them (else its longest)
    longest = model_cfg.max_positions
    lengths = ((args.src_len,) if args.src_len is not None
               else tuple(n for n in (32, 128) if n <= longest) or (longest,))
    if max(lengths) > longest:
        raise DynaseqError(f"profile: {max(lengths)} tokens exceed the model's max_positions="
                           f"{longest}")
    control = control_for(model_cfg, budget, 1, next(model.parameters()).device, calibrations)
    exit = exit_for(model_cfg, args.gamma, args.depth)
    layers = layers_for(model_cfg, args.keep_layers)
    layer_exit = layer_exit_for(model_cfg, **_layer_exit_args(args))
    result = profile_encoder(model, lengths, (1, 32), args.repeats, control,
                             exit=exit if exit is not None else layer_exit, layers=layers)
    result["budget"] = budget
    if exit is not None:
        result.update(gamma=exit.gamma, depth=exit.depth)
    if layer_exit is not None:
        result.update(layer_exit.describe())
    if layers is not None:
        result.update(keep_layers=len(layers), layers_run=list(layers))
    label = "ran at this budget" if model_cfg.cct is not None else "flop counter"
    return _print_result(args, result, lambda: "\n".join([
        f"params            {result['params']:,}",
        *(f"{s:>4} tokens: MACs/token {row['macs_per_token'] / 1e6:.3f} M ({label} "
          f"{row['macs_per_token_flop_counter'] / 1e6:.3f} M); latency batch 1 "
          f"{row['latency_ms_b1']:.2f} ms; batch 32 {row['latency_ms_b32']:.1f} ms = "
          f"{row['sentences_per_s_b32']:.0f} sentences/s"
          for s, row in result["lengths"].items())]))


def dynaseq_load(args: argparse.Namespace):
    from dynaseq.tasks.registry import load

    return load(args.run_dir, checkpoint=args.checkpoint, device=args.device,
                precision=args.precision)


def _check_generate(args: argparse.Namespace) -> None:
    if args.tokens < 0 or args.temperature < 0:
        raise DynaseqError("--tokens and --temperature must be >= 0")
    if args.top_k is not None and args.top_k < 1:
        raise DynaseqError("--top-k must be >= 1")
    if args.seed < 0:
        raise DynaseqError("--seed must be >= 0")


def cmd_generate(args: argparse.Namespace) -> int:
    """``dynaseq generate LM_RUN``: sample text one token at a time."""
    lm = _language_model(args)
    print(lm.generate(args.prompt, args.tokens, args.temperature, args.seed, args.top_k))
    return 0


def _profile_lm(args: argparse.Namespace, cfg=None) -> int:
    """An LM run directory, or an LM config (``cfg``: random weights, vocabulary size from
    its data.train) -> params, MACs/token, ms/token at positions 100 and 10,000."""
    from dynaseq.metrics.lm_profile import profile_lm

    _refuse_exit(args)
    _refuse_given(args, ("budget", "keep_layers"), "translation and encoder",
                  f"{args.target} is a language model")
    _refuse_given(args, ("src_len",), "translation and encoder",
                  f"{args.target} is a language model (timed at positions 100 and 10,000)")
    _refuse_given(args, ("tgt_len", "batch"), "translation",
                  f"{args.target} is a language model (timed at positions 100 and 10,000)")
    if cfg is None:
        args.run_dir = args.target
        model = _language_model(args).model
    else:
        from dynaseq.data.lm_corpus import Vocab, read_lm_lines
        from dynaseq.tasks.lm.model import build_lm

        if cfg.data.train is None:
            raise DynaseqError("profile: an LM config needs data.train (for the vocabulary)")
        vocab = Vocab.build(read_lm_lines(cfg.data.train))
        model = _at_precision(build_lm(cfg.model, len(vocab)).eval(), args)
    result = profile_lm(model, steps=max(args.repeats, 5) * 4)

    def text() -> str:
        macs, mn = result["macs_per_token"], result["micronet"]
        ops = mn["ops_per_token"]
        return "\n".join([
            f"params            {result['params']:,}",
            f"MACs/token        {macs['total'] / 1e6:9.3f} M  (incremental, context "
            f"{result['context']}, full softmax)",
            *(f"ms/token at position {int(pos):>6,}: {ms:.3f}"
              for pos, ms in result["ms_per_token"].items()),
            f"ratio (last / first position): {result['ratio_last_first']:.3f}",
            f"MicroNet: storage {mn['params_storage'] / 1e6:.4f} M params (32-bit), ops/token "
            f"{ops['total'] / 1e6:.4f} M ({ops['mults'] / 1e6:.4f} M mults + "
            f"{ops['adds'] / 1e6:.4f} M adds), score {mn['score']:.5f}"])

    return _print_result(args, result, text)


def _number_list(kind: type, what: str) -> Callable[[str], list]:
    """An argparse ``type``: a comma-separated list of ``kind`` (``what``: its name in the
    error)."""

    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of {what}: {text!r}"
                                             ) from None

    return parse


_float_list = _number_list(float, "numbers")
_int_list = _number_list(int, "integers")


def parse_budget(text: str) -> float | tuple[float, float]:
    """``0.33`` (encoder and decoder) or ``1,0.33`` (encoder, decoder)."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a budget: {text!r}") from None
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return (parts[0], parts[1])
    raise argparse.ArgumentTypeError(f"a budget is F or ENC,DEC, got {text!r}")


EXIT_ARGS = ("gamma", "depth", "exit_rule", "threshold", "patience")
"""The early-exit options (adaptive-depth and multi-exit classifiers only)."""


def _refuse_classify_exits(args: argparse.Namespace) -> None:
    """``evaluate`` of a run that is not a classifier: refuse the early-exit options."""
    _refuse_given(args, EXIT_ARGS, "adaptive-depth classification or multi-exit")
    _refuse_given(args, KEEP_LAYERS_ARGS, "classification")


def _refuse_exit(args: argparse.Namespace) -> None:
    given = [f"--{name.replace('_', '-')}" for name in EXIT_ARGS
             if getattr(args, name, None) is not None]
    if given:
        raise DynaseqError(f"{args.command}: {', '.join(given)} "
                           f"{'is' if len(given) == 1 else 'are'} for adaptive-depth and "
                           "multi-exit encoders")


def _layer_exit_args(args: argparse.Namespace) -> dict[str, object]:
    """The per-layer exit options as keyword arguments (``exit_rule``, ``threshold``,
    ``patience``)."""
    return {"exit_rule": args.exit_rule, "threshold": args.threshold,
            "patience": args.patience}
    if getattr(args, "keep_layers", None) is not None:
        raise DynaseqError(f"{args.command}: --keep-layers is for encoder runs")


KEEP_LAYERS_ARGS = ("keep_layers",)
"""Pruning to a fixed depth (encoders without a structure predictor, e.g. LayerDrop)."""


def _add_keep_layers_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-layers", type=int, default=None, metavar="N",
                   help="encoders (e.g. trained with model.layerdrop): run N of the layers, "
                        "evenly spaced (LayerDrop's 'every other' pruning)")


def _add_exit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gamma", type=float, default=None,
                   help="adaptive-depth encoders: exit threshold in (0, 1) (0.1 slow and "
                        "accurate ... 0.9 fast; default the run's depth.gamma)")
    p.add_argument("--depth", type=int, default=None,
                   help="adaptive-depth encoders: run this many adaptive layers for every "
                        "input instead (the model's maximum: no early exit)")
    p.add_argument("--exit-rule", default=None, metavar="RULE",
                   help="multi-exit encoders (model.exits): branchynet (entropy), "
                        "shallow-deep (max probability) or pabee (patience); default the "
                        "run's exits.rule")
    p.add_argument("--threshold", type=float, default=None,
                   help="multi-exit encoders: branchynet's normalized-entropy or "
                        "shallow-deep's max-probability threshold in [0, 1]")
    p.add_argument("--patience", type=int, default=None,
                   help="multi-exit encoders: pabee's patience (>= 1; exit once the label "
                        "stayed the same over this many layers)")


def _add_budget_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=parse_budget, default=None,
                   help="compute budget of a CCT model: 0.33 or ENC,DEC (a trained one)")


def _add_stream_arg(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("--stream", action="store_true",
                   help=f"{verb} each stdin line as it arrives (batch 1) and print the answer "
                        "at once, for interactive use")


def _add_decode_args(p: argparse.ArgumentParser) -> None:
    _add_budget_arg(p)
    p.add_argument("--beam", type=int, default=None, help="beam size (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="sentences per batch")


def _add_run_args(p: argparse.ArgumentParser, precision: bool = True) -> None:
    """``--checkpoint``, ``--device``, ``--quiet`` and, unless ``precision`` is False (the
    commands whose workflow loads the run itself: prune-heads, cache-search), ``--precision``."""
    p.add_argument("--checkpoint", default="auto",
                   help="auto (averaged > best > latest), best, latest, averaged, a step or a path")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    if precision:
        p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                       help="bf16: the model's products in bfloat16 (on a CPU with "
                            "AVX512-BF16: 0.6-0.75x the time to classify; docs/techniques.md)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (one shows only when stderr is a terminal)")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``dynaseq: error: ...``, exit status 2), as every other
    refusal; ``--help`` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        where = self.prog.removeprefix("dynaseq").strip()  # the subcommand, if any
        self.exit(EXIT_BAD_INPUT, f"dynaseq: error: {where + ': ' if where else ''}{message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dynaseq", description="Sequence models whose computation is chosen at run time.")
    parser.add_argument("--version", action="version", version=f"dynaseq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("data", help="check the datasets under the data root (docs/data.md)")
    data_sub = p.add_subparsers(dest="action", required=True)
    q = data_sub.add_parser("check", help="verify each dataset file against its sha256")
    q.add_argument("root", nargs="?", default=None,
                   help="data root (default: $DYNASEQ_DATA, else data/, else ../shared/data)")
    q.add_argument("--dataset", action="append", default=None,
                   help="only this dataset (repeatable)")

    p = sub.add_parser("export", help="a self-contained model directory (config.json, "
                                      "weights, tokenizer, calibration, model card)")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="the model directory (must not exist, or be "
                                                "empty)")
    p.add_argument("--checkpoint", default="auto",
                   help="auto (averaged > best > latest), best, latest, averaged, a step or a path")

    p = sub.add_parser("plot", help="training and validation curves of runs, as a PNG")
    p.add_argument("runs", nargs="+", help="run directories (their log.jsonl)")
    p.add_argument("--out", "-o", required=True, help="the PNG to write")

    p = sub.add_parser("train", help="train a model from a YAML config")
    p.add_argument("config", help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=100")
    p.add_argument("--run-dir", default=None, help="same as run_dir=...")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (defaults included) as YAML and exit")

    p = sub.add_parser("translate", help="translate a file or stdin, one sentence per line")
    p.add_argument("run_dir")
    p.add_argument("--input", "-i", default=None, help="input file (default stdin)")
    p.add_argument("--output", "-o", default=None, help="output file (default stdout)")
    _add_stream_arg(p, "translate")
    _add_decode_args(p)
    _add_run_args(p)

    p = sub.add_parser("classify", help="classify sentences (pairs: tab-separated), one per "
                       "line, with a fine-tuned encoder")
    p.add_argument("run_dir")
    p.add_argument("--input", "-i", default=None, help="input file (default stdin)")
    p.add_argument("--output", "-o", default=None, help="output file (default stdout)")
    _add_stream_arg(p, "classify")
    p.add_argument("--batch-size", type=int, default=None, help="sentences per batch")
    _add_budget_arg(p)
    _add_exit_args(p)
    _add_keep_layers_arg(p)
    _add_run_args(p)

    p = sub.add_parser("evaluate", help="sacreBLEU and loss against references; "
                       "perplexity for language models; GLUE metrics for classifiers")
    p.add_argument("run_dir")
    p.add_argument("--src", default=None, help="source sentences (translation runs)")
    p.add_argument("--ref", default=None, help="references (translation runs)")
    p.add_argument("--split", default=None, choices=["valid", "test"],
                   help="language models (default valid): which data file of the run's "
                        "config; MLM runs: valid only (--data FILE for other text)")
    p.add_argument("--data", default=None,
                   help="classification runs: a labelled TSV in the run's layout (GLUE "
                        "dev.tsv); MLM runs: a text file (default the run's valid file)")
    p.add_argument("--json", action="store_true")
    _add_decode_args(p)
    _add_exit_args(p)
    _add_keep_layers_arg(p)
    _add_run_args(p)

    p = sub.add_parser(
        "calibrate", help="CCT: fit gate thresholds so each budget's realized compute meets it",
        description="Run the CCT teacher forced on held-out pairs (in batches, each pair "
                    "counted over its own tokens, as alone) and find, per "
                    "budget and sub-network, one offset for the inference threshold of its "
                    "gates that brings the realized compute fraction to the budget. Writes "
                    "RUN_DIR/calibration.json for the checkpoint used; translate, evaluate "
                    "and profile then run each calibrated budget with its offsets. A budget "
                    "that was not trained (--budgets) starts from the nearest trained one. "
                    "Example: dynaseq calibrate runs/cct --src val.en --ref val.fr; "
                    "CCT-BERT classifiers: dynaseq calibrate RUN --data dev.tsv")
    p.add_argument("run_dir")
    p.add_argument("--src", default=None, help="held-out source sentences (e.g. validation)")
    p.add_argument("--ref", default=None, help="their references")
    p.add_argument("--data", default=None,
                   help="classification runs (CCT-BERT): a TSV in the run's layout")
    p.add_argument("--budgets", type=parse_budget, nargs="+", default=None,
                   help="budgets to fit, each 0.33 or ENC,DEC (default: every trained one)")
    p.add_argument("--lines", type=int, default=300, help="calibrate on the first N pairs")
    p.add_argument("--tol", type=float, default=0.005,
                   help="stop once the realized fraction is this close (default 0.005)")
    _add_run_args(p)

    p = sub.add_parser("profile", help="parameters, MACs per token and decoding latency")
    p.add_argument("target", help="a run directory or a YAML config (random weights)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for a config")
    p.add_argument("--json", action="store_true")
    p.add_argument("--src-len", type=int, default=None,
                   help="translation: source tokens (default 30); encoders: the one input "
                        "length to time (default 32 and 128, as far as max_positions goes)")
    p.add_argument("--tgt-len", type=int, default=None,
                   help="translation: target tokens (default 30)")
    p.add_argument("--batch", type=int, default=None, help="translation: batch (default 1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--latency-table", action="store_true",
                   help="translation and classification runs: measure service time per "
                        "budget x batch size x source length and write "
                        "RUN/latency_table.json (for dynaseq serve's deadline policy)")
    p.add_argument("--table-batches", type=_int_list, default=[1, 2, 4, 8, 16],
                   help="--latency-table batch sizes (default 1,2,4,8,16)")
    p.add_argument("--table-lengths", type=_int_list, default=[8, 16, 32],
                   help="--latency-table source (= target) lengths (default 8,16,32)")
    p.add_argument("--beam", type=int, default=None,
                   help="--latency-table beam size of a translation run (default: the run's "
                        "decode.beam)")
    p.add_argument("--table-src", default=None,
                   help="--latency-table: time real sentences of this file (those nearest "
                        "each length); a translation run decodes them freely instead of "
                        "random fixed-length ones (recommended: a budget's outputs may run "
                        "longer); a classification run reads them as dynaseq classify does "
                        "(default: its validation sentences)")
    p.add_argument("--no-compute", action="store_true",
                   help="--latency-table: time the decode (or classification) alone, for "
                        "a server run with --no-compute (default: it and each line's "
                        "realized compute, as dynaseq serve runs them)")
    p.add_argument("--table-predict", choices=["fit", "grid"], default="fit",
                   help="--latency-table: how the server reads the cells: a model fitted "
                        "to them (default; smooth, never falling with batch size or "
                        "length) or linear interpolation between them")
    _add_budget_arg(p)
    _add_exit_args(p)
    _add_keep_layers_arg(p)
    _add_run_args(p)

    p = sub.add_parser("generate", help="sample text from a language model")
    p.add_argument("run_dir")
    p.add_argument("--prompt", default=None, help="text to continue (default: a new line)")
    p.add_argument("--tokens", type=int, default=50, help="words to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    _add_run_args(p)

    p = sub.add_parser(
        "serve", help="a budget-aware HTTP inference server for a run (FastAPI + uvicorn)",
        description="Serve RUN over HTTP: translation runs POST /v1/translate, language "
                    "models POST /v1/generate and /v1/score, classification runs POST "
                    "/v1/classify; GET /healthz, /readyz, /metrics (Prometheus), /docs. "
                    "Each request may carry a budget, or (translation and classification) "
                    "a deadline_ms instead (needs RUN/latency_table.json from dynaseq "
                    "profile RUN --latency-table). SIGTERM answers the requests in flight, "
                    "then exits. Example: dynaseq serve runs/demo/run --port 8000")
    from dynaseq.serve.config import BATCH_MARGINS, OVERLOAD_ACTIONS  # light: no server

    p.add_argument("run_dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="how long a batch waits for more requests (default 5)")
    p.add_argument("--max-batch-lines", type=int, default=32, help="lines per batch at most")
    p.add_argument("--max-queue-lines", type=int, default=4096,
                   help="queued lines at most; beyond, 503 + Retry-After")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="requests handled at once at most; beyond, 503 + Retry-After before "
                        "the body is read (default: no limit)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--body-timeout-s", type=float, default=10.0,
                   help="a body's next bytes must arrive within this, else 408 (default 10)")
    p.add_argument("--max-lines", type=int, default=32, help="lines per request at most")
    p.add_argument("--max-line-chars", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per request at most")
    p.add_argument("--beam", type=int, default=None, help="beam size (default: the run's)")
    p.add_argument("--default-budget", type=parse_budget, default=None,
                   help="budget of requests that give none (default: the largest trained)")
    p.add_argument("--latency-table", default=None,
                   help="latency table for deadline_ms (default RUN/latency_table.json)")
    p.add_argument("--overload", choices=OVERLOAD_ACTIONS, default="reject",
                   help="a deadline no budget can meet: 503 + Retry-After (reject) or run "
                        "at the fastest budget, normally the smallest")
    p.add_argument("--slack", type=float, default=0.9,
                   help="plan deadline requests to finish within SLACK x deadline")
    p.add_argument("--batch-margin", choices=BATCH_MARGINS, default="formation",
                   help="the margin a batch's own deadline lines keep when the batch is "
                        "formed: the errors of the predictions made on arrival (admission) "
                        "or of those made as batches were formed (formation, the default); "
                        "or no margin but at most 1%% of the lines expected late, by the "
                        "latter errors (risk)")
    p.add_argument("--max-utilization", type=float, default=None,
                   help="run a batch's deadline lines above the smallest budget only if the "
                        "arrival rate x that budget's time per line in a full batch stays "
                        "at most this (default: no limit)")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes on the one port, each loading the model (default "
                        "1); /metrics sums them")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per process (default: torch's; with --workers N, "
                        "the cores / N)")
    p.add_argument("--no-compute", action="store_true",
                   help="do not measure each line's realized compute")
    p.add_argument("--no-access-log", action="store_true")
    p.add_argument("--answer-at-batch-end", action="store_true",
                   help="answer a batch's translation requests when the whole batch is "
                        "done (default: each as soon as its own lines are)")
    p.add_argument("--mixed-batches", action="store_true",
                   help="always batch queued requests in arrival order, whatever their "
                        "budgets (default: a queue deeper than a batch runs single-budget "
                        "batches)")
    p.add_argument("--scale-by-size", action="store_true",
                   help="deadlines: predict each batch at the measured real/predicted time "
                        "of batches of its size class (powers of two of the lines), not at "
                        "one factor for all")
    p.add_argument("--continuous", action="store_true", default=None,
                   help="translation: continuous batching (greedy; a finished line's row "
                        "is taken over by a queued line at the next step); deadlines are "
                        "planned for its rows")
    p.add_argument("--batch-nice", type=int, default=10,
                   help="lower the batch thread's scheduling priority by this much (its "
                        "nice value, Linux; 0-19, default 10), so the event loop reads and "
                        "answers requests while a batch decodes on the same core")
    _add_run_args(p)

    p = sub.add_parser("average", help="average the last K checkpoints into run_dir/averaged")
    p.add_argument("run_dir")
    p.add_argument("-k", "--k", type=int, default=5, help="how many of the last checkpoints")

    p = sub.add_parser("demo", help="show one CCT at four budgets on the built-in synthetic "
                       "task: the shipped model, or one trained anew (--train)")
    p.add_argument("--train", action="store_true",
                   help="train a new demo model (default: evaluate the shipped one)")
    p.add_argument("--minutes", type=float, default=None,
                   help="with --train: training time budget (default 5)")
    p.add_argument("--steps", type=int, default=None,
                   help="with --train: train for this many updates instead (reproducible)")
    p.add_argument("--out", default="runs/demo", help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")

    p = sub.add_parser("analyze", help="CCT gate statistics and plots (paper fig. 9-13)")
    p.add_argument("run_dir")
    p.add_argument("--src", required=True, help="source sentences")
    p.add_argument("--ref", default=None,
                   help="references to analyze (default: the model's own translations)")
    p.add_argument("--out", required=True, help="output directory (analysis.json + PNGs)")
    p.add_argument("--budget", type=parse_budget, action="append", default=None,
                   help="a trained budget, 0.33 or ENC,DEC; repeat for more (default: all)")
    p.add_argument("--max-lines", type=int, default=None, help="analyze the first N lines")
    p.add_argument("--beam", type=int, default=1, help="beam size without --ref (1 = greedy)")
    _add_run_args(p)

    p = sub.add_parser(
        "quantize", help="write an int8 copy of a translation run, or a QAT-quantized "
                         "copy of a language-model run",
        description="Write NEW_DIR, a run directory holding the int8 version of RUN_DIR's "
                    "model (RUN_DIR is not modified). translate/evaluate/profile load it "
                    "like any run, on the CPU. Language-model runs: quantization-aware "
                    "fine-tuning at --bits for --steps updates (pruned zeros kept), then "
                    "conversion and an exact-representability check. Example: dynaseq "
                    "quantize runs/lm_p40 --out runs/lm_q9 --bits 9 --steps 200")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="new run directory (must not exist, or be empty)")
    p.add_argument("--checkpoint", default="auto",
                   help="auto (averaged > best > latest), best, latest, averaged, a step or a path")
    p.add_argument("--bits", type=int, default=None,
                   help="language models: QAT bit width, 2..16 (default 9)")
    p.add_argument("--steps", type=int, default=0,
                   help="language models: QAT fine-tuning updates (default 0)")
    p.add_argument("--lr", type=float, default=None,
                   help="language models: fine-tuning lr (default 0.1 x the run's train.lr)")
    p.add_argument("--quiet", action="store_true", help="no progress output")

    p = sub.add_parser(
        "prune", help="sensitivity-guided gradual pruning of a language model into a new run",
        description="Per-matrix sensitivity analysis on validation, per-matrix targets for "
                    "--sparsity by a binary search on a perplexity threshold, then gradual "
                    "pruning while fine-tuning --steps updates. Writes NEW_DIR (plain weights "
                    "with zeros, prune_report.json); RUN_DIR is not modified. Example: "
                    "dynaseq prune runs/lm --out runs/lm_p40 --sparsity 0.4 --steps 200")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="new run directory (must not exist, or be empty)")
    p.add_argument("--sparsity", type=float, required=True,
                   help="target overall sparsity of the prunable matrices, in [0, 1)")
    p.add_argument("--steps", type=int, default=0, help="fine-tuning updates (0: one shot)")
    p.add_argument("--grid", type=_float_list, default=None,
                   help="sensitivity sparsities, e.g. 0,0.2,0.4,0.6,0.8 (default 0.1..0.9)")
    p.add_argument("--valid-tokens", type=int, default=20_000,
                   help="validation tokens for the sensitivity analysis (default 20000)")
    p.add_argument("--lr", type=float, default=None,
                   help="fine-tuning lr (default 0.1 x the run's train.lr)")
    p.add_argument("--sensitivity", default=None, metavar="PRUNE_REPORT",
                   help="reuse the sensitivity curves of an earlier prune_report.json of the "
                        "same run instead of the sweep")
    p.add_argument("--distill", default=None, metavar="TOPK_DIR",
                   help="distill from this teacher top-k while fine-tuning, e.g. the run's "
                        "own: dynaseq distill-data RUN_DIR --out TOPK_DIR")
    _add_run_args(p)

    p = sub.add_parser(
        "prune-heads", help="prune a classifier's least important attention heads into a new "
                            "run (HeadPrune)",
        description="Measure each attention head's importance |dL/dxi_h| (Michel et al. 2019: "
                    "xi_h a mask on the head's output) with the task's loss on --data, keep "
                    "the --keep fraction of the heads that matter most (over all layers) and "
                    "remove the others from the weights, so the smaller matmuls really run. "
                    "Writes NEW_DIR (config with model.layer_heads, weights, "
                    "head_prune_report.json with the metrics on --data before and after); "
                    "RUN_DIR is not modified. Example: dynaseq prune-heads runs/sst2 --data "
                    "glue/SST-2/dev.tsv --keep 0.5 --out runs/sst2_h50")
    p.add_argument("run_dir")
    p.add_argument("--data", required=True,
                   help="a labelled TSV in the run's layout (held-out, e.g. GLUE dev.tsv)")
    p.add_argument("--keep", type=float, required=True,
                   help="fraction of the attention heads to keep, in (0, 1]")
    p.add_argument("--out", required=True, help="new run directory (must not exist, or be empty)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sentences per batch (default the run's data.batch_size)")
    p.add_argument("--no-normalize", action="store_true",
                   help="do not normalise the importance scores per layer (l2)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_run_args(p, precision=False)

    p = sub.add_parser(
        "cache-search", help="tune a language model's neural cache (theta, lambda, size) on "
                             "validation into a new run",
        description="Local search over the cache's theta and lambda (then each of "
                    "--cache-sizes) minimising validation perplexity with the cache; writes "
                    "NEW_DIR whose model.cache holds the best values. Example: dynaseq "
                    "cache-search runs/lm --out runs/lm_cache --cache-sizes 3000,4000")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="new run directory (must not exist, or be empty)")
    p.add_argument("--cache-sizes", type=_int_list, default=[],
                   help="larger cache sizes to search too, e.g. 500,1000,2000")
    p.add_argument("--n-cache", type=int, default=None,
                   help="cache size to start from and search at, instead of the run's own "
                        "(or 2000 for a run without a cache), e.g. a small cache to keep the "
                        "extra ops per token low")
    p.add_argument("--max-evals", type=int, default=40, help="evaluations at most (default 40)")
    p.add_argument("--valid-tokens", type=int, default=None,
                   help="search on the first N validation tokens (default: all)")
    _add_run_args(p, precision=False)

    p = sub.add_parser(
        "distill-data", help="knowledge distillation data: teacher beam outputs "
                             "(translation) or top-k labels (language models)",
        description="Translation: translate every line of --src with the teacher run and "
                    "write the outputs, one per line and aligned with --src, to --out (.gz: "
                    "gzip). Train the student with a normal config whose data.train_tgt is "
                    "--out (and data.train_src the same --src). Language models: write the "
                    "teacher's top --k next-word probabilities over the training text "
                    "(--src, default the teacher's data.train) to the directory --out, in "
                    "the order a student with --batch-size streams and --window tokens per "
                    "window reads it (default: the teacher config's); train the student "
                    "with train.distill.topk_dir=--out. Example: dynaseq distill-data "
                    "runs/teacher --out runs/teacher_top30 --k 30")
    p.add_argument("run_dir", help="the teacher run")
    p.add_argument("--src", default=None, help="source sentences (plain or .gz; required for "
                   "translation runs) / LM training text")
    p.add_argument("--out", required=True, help="output file (.gz: gzip-compressed) / LM: "
                   "output directory")
    p.add_argument("--beam", type=int, default=None, help="beam size (1 = greedy; default 4)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sentences per batch / LM: the student's data.batch_size")
    p.add_argument("--k", type=int, default=None,
                   help="LM: top-k labels per token (default 30)")
    p.add_argument("--window", type=int, default=None,
                   help="LM: the student's model.extended_context")
    _add_budget_arg(p)
    _add_run_args(p)
    return parser


@dataclass(frozen=True)
class Command:
    """One subcommand: the function per kind of run it takes (``"seq2seq"``/``"lm"``; the
    key ``None`` for commands that take no run directory), and an optional ``check`` of its
    arguments that runs before anything is read."""

    by_kind: dict[str | None, Callable[[argparse.Namespace], int]]
    check: Callable[[argparse.Namespace], None] | None = None

    def __call__(self, args: argparse.Namespace) -> int:
        if self.check is not None:
            self.check(args)
        if None in self.by_kind:
            return self.by_kind[None](args)
        kind = _run_dir_kind(args.run_dir)
        if kind not in self.by_kind:
            takes = " or ".join(KIND_NAMES[k] for k in self.by_kind)
            raise DynaseqError(f"{args.command}: {args.run_dir} is a {KIND_NAMES[kind]} run; "
                               f"{args.command} takes {takes} runs")
        return self.by_kind[kind](args)


def _calibration_lock(args: argparse.Namespace) -> Any:
    """The run's calibration lock, held from reading ``calibration.json`` (at load) to
    writing it, once the arguments and inputs are checked (a refused command writes not even
    the lock's file): a second ``calibrate`` of the run is refused in one line (two at once
    each wrote what it had read plus its own budgets, and one's were lost)."""
    from dynaseq.core.run_lock import CALIBRATE_LOCK, RunDirLock

    return RunDirLock(Path(args.run_dir), CALIBRATE_LOCK, "calibrated")


KIND_NAMES = {"seq2seq": "translation", "lm": "language-model", "mlm": "MLM",
              "classify": "classification"}
ENCODER_KINDS = ("mlm", "classify")

#: subcommand -> what runs it (the parser is :func:`build_parser`).
COMMANDS: dict[str, Command] = {
    "train": Command({None: cmd_train}),
    "data": Command({None: cmd_data}),
    "plot": Command({None: cmd_plot}),
    "export": Command({None: cmd_export}),
    "translate": Command({"seq2seq": cmd_translate}),
    "evaluate": Command({"seq2seq": _evaluate_seq2seq, "lm": _evaluate_lm,
                         "mlm": _evaluate_mlm, "classify": _evaluate_classify}),
    "classify": Command({"classify": cmd_classify}),
    "calibrate": Command({"seq2seq": cmd_calibrate, "classify": _calibrate_classify},
                         check=lambda args: check_not_shipped(args.run_dir,
                                                              "calibration.json")),
    "profile": Command({None: cmd_profile}),  # a run directory or a config file
    "generate": Command({"lm": cmd_generate}, check=_check_generate),
    "average": Command({None: cmd_average}),
    "serve": Command({"seq2seq": cmd_serve, "lm": cmd_serve, "classify": cmd_serve}),
    "demo": Command({None: cmd_demo}),
    "analyze": Command({"seq2seq": cmd_analyze}),
    "quantize": Command({"seq2seq": _quantize_seq2seq, "lm": _quantize_lm},
                        check=_check_quantize),
    "prune": Command({"lm": cmd_prune}, check=_check_prune),
    "prune-heads": Command({"classify": cmd_prune_heads}, check=_check_prune_heads),
    "cache-search": Command({"lm": cmd_cache_search}),
    "distill-data": Command({"seq2seq": _distill_data_seq2seq, "lm": _distill_data_lm}),
}


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed; ``key=value`` overrides of ``train``/``profile`` may also stand after
    the options (argparse alone reads them only before the first option)."""
    args, extra = parser.parse_known_args(argv)
    takes = hasattr(args, "overrides")
    unknown = [a for a in extra if not (takes and "=" in a and not a.startswith("-"))]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed (Python's, or torch's on any device)."""
    if isinstance(e, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom = None if torch is None else getattr(torch, "OutOfMemoryError",
                                             torch.cuda.OutOfMemoryError)  # torch < 2.5
    return (oom is not None and isinstance(e, oom)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


PATH_ARGS = ("run_dir", "runs", "config", "target", "root", "input", "output", "out", "src",
             "ref", "data", "checkpoint", "latency_table", "table_src", "sensitivity",
             "distill")
"""The arguments (``argparse`` names) that name files or folders: :func:`_expand_home`'s."""


def _expand_home(args: argparse.Namespace) -> None:
    """A leading ``~`` of every path argument (:data:`PATH_ARGS`) expanded, as a shell
    would have, before any command reads one: a check that an output is not its input, or
    not inside the run, compares the paths the command then uses (the library expands
    ``~`` where a path enters it too, but the checks here compare what was given: ``-i
    '~/in.txt' -o ~/in.txt`` overwrote its input). Other text (a prompt) is left as is."""
    for name in PATH_ARGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, str(user_path(value)))
        elif isinstance(value, list):
            setattr(args, name, [str(user_path(v)) if isinstance(v, str) and v.startswith("~")
                                 else v for v in value])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            parser.error(f"--{name.replace('_', '-')} must be a finite number, got {value}")
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            parser.error(f"--{name.replace('_', '-')} {value} is out of range (64-bit)")
    for name in ("beam", "batch_size", "k", "repeats", "src_len", "tgt_len", "batch",
                 "window", "max_evals", "valid_tokens", "lines"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "minutes", None) is not None and args.minutes <= 0:
        parser.error("--minutes must be > 0")
    _expand_home(args)
    try:
        for name in ("out", "output"):  # "" is the current folder to Path: never meant
            value = getattr(args, name, None)
            if isinstance(value, str) and not value.strip():
                raise DynaseqError(f"--{name}: an output path must not be empty")
        with warnings.catch_warnings():  # restored when the command ends
            warnings.showwarning = _one_line_warning
            return COMMANDS[args.command](args)
    except DynaseqError as e:
        print(f"dynaseq: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # a full disk, a folder not writable: what the OS said, in one line
        if isinstance(e, BrokenPipeError):
            return 0
        where = f" ({e.filename})" if e.filename else ""
        print(f"dynaseq: error: {os_reason(e)}{where}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("dynaseq: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except (MemoryError, RuntimeError) as e:  # sizes, batches or beams too large to fit
        if not _out_of_memory(e):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(e))
        size = f" ({int(asked.group(1)) / 2**30:.1f} GiB at once)" if asked else ""
        print(f"dynaseq: error: out of memory{size}: ask for smaller sizes, batches or beams",
              file=sys.stderr)
        return EXIT_BAD_INPUT


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as ``dynaseq: warning: <message>`` (no source line)."""
    text = " ".join(str(message).split())
    print(f"dynaseq: warning: {text}", file=sys.stderr if file is None else file)


def entry() -> None:
    """The ``dynaseq`` command (and ``python -m dynaseq``): :func:`main`, with a Ctrl-C
    while the arguments are read the same one line as during a command."""
    try:
        status = main()
    except KeyboardInterrupt:
        print("dynaseq: interrupted", file=sys.stderr)
        status = 128 + signal.SIGINT
    sys.exit(status)


if __name__ == "__main__":
    entry()
