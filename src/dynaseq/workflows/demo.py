"""``dynaseq demo``: one CCT on the built-in synthetic task, shown at several budgets.

"One model, many budgets" on one screen: per budget, the compute that really ran, the
quality (BLEU, accuracy on hard and easy target words) and the decoding latency at batch 1.

By default the demo evaluates the model shipped with dynaseq (:data:`DEMO_MODEL`, a
``dynaseq export`` directory of a few MB): the table appears in well under a minute. With
``train=True`` (``dynaseq demo --train``) it trains a new CCT first, for ``minutes`` of wall
time or a fixed number of ``steps`` (reproducible on one machine). The shipped model is made
by ``make demo-model``::

    dynaseq demo --train --steps 9000 --out runs/demo_model
    dynaseq export runs/demo_model/run --out src/dynaseq/workflows/demo_model

Leaves under ``out``: ``data/{train,valid,test}.{src,tgt}`` (the generated task),
``run/`` (a normal run directory, with ``train`` only) and ``summary.json`` (the table).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dynaseq.analysis.gates import sentence_traces, token_compute
from dynaseq.core.checkpoint import read_meta
from dynaseq.core.config import TrainConfig
from dynaseq.core.errors import DynaseqError
from dynaseq.core.run_lock import clear_run_dir
from dynaseq.data import hard_token_mask, read_lines, write_task
from dynaseq.metrics.profile import count_params
from dynaseq.tasks.translation.config import DataConfig, DecodeConfig, ModelConfig, RunConfig
from dynaseq.tasks.translation.predictor import Translator, bleu
from dynaseq.techniques.cct.config import CCTConfig
from dynaseq.train.loop import train

DEMO_BUDGETS = [(1.0, 1.0), (0.5, 0.5), (0.33, 0.33), (0.2, 0.2)]
"""The demo's trained (encoder, decoder) budgets, one control symbol each."""

DEMO_MODEL = Path(__file__).with_name("demo_model")
"""The shipped demo model: a ``dynaseq export`` directory made by ``make demo-model``."""

UPDATES_PER_MINUTE = 180.0
"""Updates a minute of demo training makes on 2 cores (the 4+4 model: 9000 in about 50
minutes): sets a timed run's schedule."""


def demo_config(out: Path, paths: dict[str, Path], seed: int, cct: CCTConfig | None = None,
                minutes: float | None = None, steps: int = 1_000_000) -> RunConfig:
    """A tiny (d=128) 4+4-layer model with small batches: many updates in a few CPU minutes.

    Four layers a side, not two or three: trained the same way (9000 updates), a 2+2 model
    translated only at (1, 1) and (.5, .5) and a 3+3 one down to (.33, .33), while at
    (.2, .2) both degenerated into outputs that ran longer than the full budget's, so the
    smallest budget was the slowest (``docs/results.md``, section "Batch-1 decoding
    (issue 28)", the demo entries).

    ``cct``: make it a Conditional Computation Transformer with these settings. Training
    stops after ``minutes`` of wall time (None: no limit) or ``steps`` updates.
    """
    return RunConfig(
        run_dir=str(out / "run"),
        model=ModelConfig(size="tiny", encoder_layers=4, decoder_layers=4, dropout=0.1,
                          cct=cct),
        data=DataConfig(train_src=str(paths["train.src"]), train_tgt=str(paths["train.tgt"]),
                        valid_src=str(paths["valid.src"]), valid_tgt=str(paths["valid.tgt"]),
                        vocab_size=400, max_tokens=2000, max_len=64),
        train=TrainConfig(seed=seed, lr=2e-3, warmup_steps=200, max_minutes=minutes,
                          max_steps=steps, log_every=50, valid_every=200, save_every=200,
                          keep_last=3, valid_bleu_lines=200, label_smoothing=0.1),
        decode=DecodeConfig(beam=4, batch_size=128),
    )


def demo_cct(steps: int) -> CCTConfig:
    """The demo's CCT for a run of about ``steps`` updates: M=4 FFN pieces, the
    :data:`DEMO_BUDGETS` (full budget drawn twice as often); noise at its maximum after 30%
    of the updates; every sequence at the full budget for the first 35%, then budgets drawn
    from the list, ramping in over 10%; the budget loss counts the gates inference will
    open (``budget_estimate="hard"``; see ``CCTConfig``)."""
    steps = max(steps, 10)
    return CCTConfig(ffn_pieces=4, control_hidden=64, noise_ramp_steps=int(0.3 * steps),
                     budget_start_step=int(0.35 * steps), budget_ramp_steps=int(0.1 * steps),
                     budget_estimate="hard",
                     budgets=[DEMO_BUDGETS[0], *DEMO_BUDGETS])


def token_accuracy(hyps: list[str], refs: list[str], srcs: list[str]) -> dict[str, float]:
    """Accuracy on hard (sum-result) and easy target words, position by position.

    A hypothesis of the wrong length counts all its reference words as wrong.
    """
    right = {True: 0, False: 0}
    total = {True: 0, False: 0}
    exact = 0
    for hyp, ref, src in zip(hyps, refs, srcs, strict=True):
        h, r = hyp.split(), ref.split()
        exact += h == r
        for pos, hard in enumerate(hard_token_mask(src, ref)):
            total[hard] += 1
            right[hard] += len(h) == len(r) and h[pos] == r[pos]
    return {"exact_match": exact / max(len(refs), 1),
            "hard_token_acc": right[True] / max(total[True], 1),
            "easy_token_acc": right[False] / max(total[False], 1)}


def run_demo(out: str | Path, train_new: bool = False, minutes: float | None = None,
             steps: int | None = None, seed: int = 0, progress: bool = True,
             eval_lines: int | None = None, model: str | Path = DEMO_MODEL,
             timing_lines: int = 50) -> dict[str, Any]:
    """Generate the task (test split drawn with ``seed``), then evaluate the demo model at
    every trained budget on the test split (its first ``eval_lines`` lines if given), print
    the table and write ``summary.json`` (one row per budget). The batch-1 timing decodes
    the first ``timing_lines`` test sentences.

    The model is ``model`` (default: the shipped one) unless ``train_new``: then a new CCT
    is trained in ``out/run`` for ``steps`` updates, or ``minutes`` of wall time (default 5).

    Raises:
        DynaseqError: ``minutes`` or ``steps`` without ``train_new``, both together,
            ``steps`` < 1, or a ``model`` directory that does not exist.
    """
    out = Path(out)
    say = _reporter(progress)
    if not train_new and (minutes is not None or steps is not None):
        raise DynaseqError("--minutes and --steps go with --train (the shipped model is "
                           "already trained)")
    if minutes is not None and steps is not None:
        raise DynaseqError("give --minutes or --steps, not both")
    if steps is not None and steps < 1:
        raise DynaseqError(f"--steps must be >= 1, got {steps}")
    if not train_new and not Path(model).is_dir():
        raise DynaseqError(f"no demo model at {model}: train one with `dynaseq demo --train`")
    say(f"[demo] writing the synthetic task to {out / 'data'}")
    paths = write_task(out / "data", seed=seed)
    if train_new:
        model = _train_demo(out, paths, seed, minutes, steps, progress)
    else:
        say(f"[demo] evaluating the shipped model {model}")
    # a new run: the model its --steps / --minutes made, its last checkpoint (as `make
    # demo-model` exports for the shipped one), not the best of its validations
    t = Translator.load(model, checkpoint="latest" if train_new else "auto")
    src, ref = read_lines(paths["test.src"]), read_lines(paths["test.tgt"])
    if eval_lines is not None:
        src, ref = src[:eval_lines], ref[:eval_lines]
    n_small = min(len(src), 200)
    ms = greedy_ms_by_budget(t, src[:timing_lines], DEMO_BUDGETS)
    rows = []
    for budget, ms_per_sentence in zip(DEMO_BUDGETS, ms, strict=True):
        say(f"[demo] evaluating budget {budget}")
        hyps = t.translate(src, beam=1, budget=budget)
        score, signature = bleu(hyps, ref)
        compute = t.realized_compute(src[:n_small], ref[:n_small], budget)
        by_word = hard_easy_compute(t, src[:n_small], ref[:n_small], budget)
        rows.append({"budget": list(budget), "bleu_greedy": round(score, 2),
                     **{k: round(v, 4) for k, v in token_accuracy(hyps, ref, src).items()},
                     "realized_fraction": round(compute["fraction"]["total"], 3),
                     "realized_macs_per_token": round(sum(compute["macs_per_token"].values())),
                     **{k: round(v, 3) for k, v in by_word.items()},
                     "ms_per_sentence": round(ms_per_sentence, 2)})
    meta = read_meta(t.checkpoint)
    how = ([] if not train_new else [f"--train --steps {steps}"] if steps is not None
           else [f"--train --minutes {minutes if minutes is not None else 5.0:g}"])
    layers = f"{t.config.model.encoder_layers}+{t.config.model.decoder_layers}"
    summary = {
        "task": "synthetic (dynaseq.data.synthetic)", "model": f"CCT tiny {layers} layers, M=4",
        "test_sentences": len(src), "compute_sentences": n_small,
        "train_steps": meta.get("step"), "trained_here": train_new,
        "params": count_params(t.model),
        "checkpoint": str(t.checkpoint if train_new or Path(model) != DEMO_MODEL
                          else DEMO_MODEL.relative_to(DEMO_MODEL.parents[2])),
        "signature": signature, "rows": rows,
        "command": " ".join(["dynaseq demo", *how, f"--out {out} --seed {seed}"]),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(format_table(summary))
    return summary


def _reporter(progress: bool) -> Any:
    """A function that prints a progress line to stderr, or does nothing."""
    return (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda m: None)


def _train_demo(out: Path, paths: dict[str, Path], seed: int, minutes: float | None,
                steps: int | None, progress: bool) -> Path:
    """Train a new demo CCT in ``out/run`` (see :func:`run_demo`); return the run dir."""
    say = _reporter(progress)
    if steps is None:
        minutes = 5.0 if minutes is None else minutes
        cfg = demo_config(out, paths, seed, demo_cct(int(minutes * UPDATES_PER_MINUTE)),
                          minutes=minutes)
    else:
        cfg = demo_config(out, paths, seed, demo_cct(steps), steps=steps)
    if Path(cfg.run_dir).exists():  # the demo's own scratch run: a fresh model every time
        say(f"[demo] removing the previous demo run {cfg.run_dir}")
        clear_run_dir(Path(cfg.run_dir))
    limit = f"{steps} updates" if steps is not None else f"{minutes:g} min"
    say(f"[demo] training one tiny CCT for {len(DEMO_BUDGETS)} budgets, {limit}, in "
        f"{cfg.run_dir}")
    train(cfg, progress=progress)
    return Path(cfg.run_dir)


def hard_easy_compute(t: Translator, src: list[str], ref: list[str],
                      budget: tuple[float, float]) -> dict[str, float]:
    """Mean decoder compute (fraction of gated MACs that ran, as in ``dynaseq analyze``) on
    the subword positions that predict hard (sum-result) vs easy reference words.

    Each reference is tokenized word by word, so every subword belongs to one word; the
    teacher-forced pass runs at batch 1 (no padding).
    """
    used = {True: 0.0, False: 0.0}
    count = {True: 0, False: 0}
    with t.at_budget(budget) as control:
        for line, target in zip(src, ref, strict=True):
            _count_sentence(t, line, target, control, used, count)
    return {"decoder_compute_hard": used[True] / max(count[True], 1),
            "decoder_compute_easy": used[False] / max(count[False], 1)}


def _count_sentence(t: Translator, line: str, target: str, control: int,
                    used: dict[bool, float], count: dict[bool, int]) -> None:
    """Add one pair's decoder compute per hard / easy reference subword to the tallies."""
    m, tok = t.model, t.tokenizer
    words = target.split()
    pieces = tok.encode(words) if words else []
    ids = [i for p in pieces for i in p]
    hard = [h for h, p in zip(hard_token_mask(line, target), pieces, strict=True)
            for _ in p]
    src_t = torch.tensor([tok.encode([line])[0] + [m.eos_id]], device=t.device)
    tgt_in = torch.tensor([[m.bos_id] + ids], device=t.device)
    with torch.no_grad():
        traces = sentence_traces(m, src_t, tgt_in, control)
    frac = token_compute(traces, "decoder", tgt_in.size(1)).fraction  # predicts ids, eos
    for h, f in zip(hard, frac[: len(ids)].tolist(), strict=True):
        used[h] += f
        count[h] += 1


def greedy_ms_by_budget(t: Translator, src: list[str], budgets: list[tuple[float, float]],
                        rounds: int = 3) -> list[float]:
    """Per budget, the median over ``rounds`` of the mean wall time of greedy-decoding
    ``src`` one sentence at a time (batch 1), in ms. The budgets take turns within each
    round, so a slow spell of a noisy machine falls on all of them alike."""
    for budget in budgets:  # warm-up
        t.translate(src[:2], beam=1, batch_size=1, budget=budget)
    times: list[list[float]] = [[] for _ in budgets]
    for _ in range(rounds):
        for i, budget in enumerate(budgets):
            t0 = time.perf_counter()
            t.translate(src, beam=1, batch_size=1, budget=budget)
            times[i].append((time.perf_counter() - t0) * 1000 / max(len(src), 1))
    return [statistics.median(x) for x in times]


def format_table(summary: dict[str, Any]) -> str:
    made = "trained here" if summary["trained_here"] else "the shipped model"
    lines = [f"synthetic task, {summary['test_sentences']} test sentences; one CCT "
             f"({made}), {summary['params']:,} params, {summary['train_steps']} updates; "
             "greedy decoding",
             f"{'budget':<12} {'compute':>7} {'MACs/tok':>9} {'BLEU':>6} {'exact':>6} "
             f"{'hard acc':>8} {'easy acc':>8} {'dec hard':>8} {'dec easy':>8} {'ms/sent':>8}"]
    for r in summary["rows"]:
        budget = f"({r['budget'][0]:g}, {r['budget'][1]:g})"
        lines.append(f"{budget:<12} {r['realized_fraction']:>7.3f} "
                     f"{r['realized_macs_per_token'] / 1e6:>8.3f}M {r['bleu_greedy']:>6.2f} "
                     f"{r['exact_match']:>6.3f} {r['hard_token_acc']:>8.3f} "
                     f"{r['easy_token_acc']:>8.3f} {r['decoder_compute_hard']:>8.3f} "
                     f"{r['decoder_compute_easy']:>8.3f} {r['ms_per_sentence']:>8.2f}")
    lines.append("compute: MACs the gated layers ran (teacher forced) over their all-on "
                 "maximum; dec hard/easy: the decoder's compute fraction on the words that are "
                 "sum results / all other words; ms/sent: greedy, batch 1 (median of interleaved "
                 "rounds)")
    return "\n".join(lines)
