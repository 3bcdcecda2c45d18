"""``dynaseq demo``: train a small model on the built-in synthetic task and show it.

Leaves under ``out``: ``data/{train,valid,test}.{src,tgt}`` (the generated task),
``run/`` (a normal run directory) and ``summary.json`` (the printed table).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dynaseq.config import DataConfig, DecodeConfig, ModelConfig, RunConfig, TrainConfig
from dynaseq.data import hard_token_mask, read_lines, write_task
from dynaseq.infer.translator import Translator, bleu
from dynaseq.metrics.profile import profile_model
from dynaseq.train.loop import train


def demo_config(out: Path, paths: dict[str, Path], minutes: float, seed: int) -> RunConfig:
    """A tiny (d=128) 2+2-layer model with small batches: many updates in a few CPU minutes."""
    return RunConfig(
        run_dir=str(out / "run"),
        model=ModelConfig(size="tiny", encoder_layers=2, decoder_layers=2, dropout=0.1),
        data=DataConfig(train_src=str(paths["train.src"]), train_tgt=str(paths["train.tgt"]),
                        valid_src=str(paths["valid.src"]), valid_tgt=str(paths["valid.tgt"]),
                        vocab_size=400, max_tokens=2000, max_len=64),
        train=TrainConfig(seed=seed, lr=2e-3, warmup_steps=200, max_minutes=minutes,
                          max_steps=1_000_000, log_every=50, valid_every=200, save_every=200,
                          keep_last=3, valid_bleu_lines=200, label_smoothing=0.1),
        decode=DecodeConfig(beam=4, batch_size=128),
    )


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


def run_demo(out: str | Path, minutes: float = 5.0, seed: int = 0, progress: bool = True,
             eval_lines: int | None = None) -> dict[str, Any]:
    """Generate the task, train for ``minutes``, evaluate on the test split (its first
    ``eval_lines`` lines if given), print the table and write ``summary.json``."""
    out = Path(out)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda m: None)
    say(f"[demo] writing the synthetic task to {out / 'data'}")
    paths = write_task(out / "data", seed=seed)
    cfg = demo_config(out, paths, minutes, seed)
    say(f"[demo] training a tiny Transformer for up to {minutes:g} min in {cfg.run_dir}")
    result = train(cfg, progress=progress)
    t = Translator.load(cfg.run_dir)
    src, ref = read_lines(paths["test.src"]), read_lines(paths["test.tgt"])
    if eval_lines is not None:
        src, ref = src[:eval_lines], ref[:eval_lines]
    prof = profile_model(t.model, 30, 30, repeats=5)
    rows = []
    for beam in (1, 4):
        hyps = t.translate(src, beam=beam)
        score, signature = bleu(hyps, ref)
        lat = prof["latency_ms"]["greedy" if beam == 1 else "beam4"]
        rows.append({"model": "transformer-tiny", "decode": "greedy" if beam == 1 else "beam4",
                     "bleu": round(score, 2), **{k: round(v, 4) for k, v in
                                                 token_accuracy(hyps, ref, src).items()},
                     "macs_per_token": prof["macs_per_token"]["total"],
                     "latency_ms_30tok": round(lat, 2)})
    summary = {
        "task": "synthetic (dynaseq.data.synthetic)", "test_sentences": len(src),
        "train_steps": result.state.step, "train_minutes": round(result.state.elapsed / 60, 2),
        "params": prof["params"], "checkpoint": str(t.checkpoint), "signature": signature,
        "rows": rows, "command": f"dynaseq demo --out {out} --minutes {minutes:g}",
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(format_table(summary))
    return summary


def format_table(summary: dict[str, Any]) -> str:
    lines = [f"synthetic task, {summary['test_sentences']} test sentences, "
             f"{summary['params']:,} params, {summary['train_steps']} updates in "
             f"{summary['train_minutes']} min",
             f"{'decode':<8} {'BLEU':>6} {'exact':>6} {'hard acc':>8} {'easy acc':>8} "
             f"{'MACs/tok':>9} {'ms/30tok':>9}"]
    for r in summary["rows"]:
        lines.append(f"{r['decode']:<8} {r['bleu']:>6.2f} {r['exact_match']:>6.3f} "
                     f"{r['hard_token_acc']:>8.3f} {r['easy_token_acc']:>8.3f} "
                     f"{r['macs_per_token'] / 1e6:>8.2f}M {r['latency_ms_30tok']:>9.1f}")
    return "\n".join(lines)
