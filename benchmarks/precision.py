"""Benchmark `precision`: bfloat16 against float32, for training (``train.precision``) and for
inference (``dynaseq.load(..., precision=)``, ``--precision``), side by side in one process.

Three parts (``--only``):

- ``train``: the time of one optimizer update (forward, loss, backward, AdamW step) of the
  same model in float32 and under bfloat16 autocast, the two taking turns round by round:
  the MLM pre-training of ``configs/wikitext2_mlm_small.yaml`` (16 blocks of 128 tokens),
  a ``small`` classifier (32 sentences of 48 tokens) and the dense Multi30k ``small``
  translation model (64 pairs of 30 -> 30 tokens). Random tokens; what is timed is the
  arithmetic, not the data.
- ``curve``: does bfloat16 train as well? The MLM pre-training run twice through the
  training loop, ``--curve-steps`` updates each (same seed, data, masks and schedule),
  in float32 and in bfloat16: validation loss at each validation, and minutes.
- ``infer``: a trained translation run (``--run``, default the Multi30k CCT of
  ``cct_quality``) loaded in both precisions: fixed-length 30 -> 30 decoding through the
  lean step, greedy and beam 4, batch 1 and 32, at budget 1 and 0.5, interleaved rounds;
  and test BLEU (sacreBLEU, greedy) of both at each budget. A ``small`` classifier's lean
  pass (random weights) at batch 1 and 32, 32 and 128 tokens, interleaved.

    python benchmarks/precision.py [--only train curve infer] [--rounds 7]
                                   [--curve-steps 400] [--run RUN] [--test-src F --test-ref F]

Writes benchmarks/results/precision.{json,md}. Run from the repository root, one heavy job
at a time: the ratios are what compare, not the milliseconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

import _lib

PARTS = ("train", "curve", "infer")
BUDGETS = ((1.0, 1.0), (0.5, 0.5))


def _update(model: torch.nn.Module, loss_of, bf16: bool):
    """One optimizer update of ``model`` (its own AdamW) as a zero-argument callable."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = loss_of(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def train_part(rounds: int) -> list[dict[str, Any]]:
    from torch.nn.functional import cross_entropy

    from dynaseq.tasks.encoder.model import MLM, build_encoder_model
    from dynaseq.tasks.registry import load_config
    from dynaseq.tasks.translation.model import build_seq2seq

    gen = torch.Generator().manual_seed(0)

    def tokens(*shape: int, vocab: int = 8000) -> torch.Tensor:
        return torch.randint(5, vocab, shape, generator=gen)

    mlm_cfg = load_config("configs/wikitext2_mlm_small.yaml", ["run_dir=/nonexistent"])
    x = tokens(16, 128)
    select = torch.rand(16, 128, generator=gen) < 0.15

    def mlm_loss(m):
        return cross_entropy(m(x, None, None, select=select).logits.float(), x[select])

    cls_cfg = load_config("configs/sst2_small.yaml", ["run_dir=/nonexistent"])
    xc, yc = tokens(32, 48), torch.randint(0, 2, (32,), generator=gen)

    def cls_loss(m):
        return cross_entropy(m(xc, torch.zeros_like(xc), None).logits.float(), yc)

    mt_cfg = load_config("configs/multi30k_small.yaml", ["run_dir=/nonexistent"])
    src, tgt = tokens(64, 30), tokens(64, 31)

    def mt_loss(m):
        logits = m(src, tgt[:, :-1]).logits.float()
        return cross_entropy(logits.reshape(-1, logits.size(-1)), tgt[:, 1:].reshape(-1))

    cases = {
        "MLM small, 16 x 128": (lambda: build_encoder_model(mlm_cfg.model, 8000, MLM, 0),
                                mlm_loss),
        "classify small, 32 x 48": (lambda: build_encoder_model(cls_cfg.model, 8000, 2, 0),
                                    cls_loss),
        "translation small, 64 x 30": (lambda: build_seq2seq(mt_cfg.model, 8000), mt_loss)}
    rows = []
    for name, (build, loss_of) in cases.items():
        fns = {}
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            fns[precision] = _update(build().train(), loss_of, precision == "bf16")
        sec = _lib.interleaved_seconds(fns, rounds)
        rows.append({"workload": name, "fp32_ms": round(1000 * sec["fp32"], 1),
                     "bf16_ms": round(1000 * sec["bf16"], 1),
                     "speedup": round(sec["fp32"] / sec["bf16"], 3)})
        print(rows[-1], flush=True)
    return rows


def curve_part(steps: int, root: Path) -> dict[str, Any]:
    from dynaseq.tasks.registry import load_config
    from dynaseq.train.loop import train

    out = {}
    every = max(steps // 4, 1)
    for precision in ("fp32", "bf16"):
        run = root / f"precision_mlm_{precision}"
        if not _lib.done(run):
            cfg = load_config("configs/wikitext2_mlm_small.yaml", [
                f"run_dir={run}", f"train.precision={precision}", f"train.max_steps={steps}",
                f"train.valid_every={every}", f"train.save_every={every}",
                f"train.warmup_steps={max(steps // 10, 1)}", "train.max_minutes=60"])
            train(cfg, progress=False)
        tp = _lib.throughput(run)
        out[precision] = {"minutes": tp.get("train_minutes"), "steps": tp.get("steps"),
                          "valid": [{"step": r["step"], "loss": round(r["loss"], 4),
                                     "accuracy": round(100 * r["accuracy"], 2)}
                                    for r in _lib.read_log(run) if r["event"] == "valid"]}
        print(precision, out[precision], flush=True)
    return out


def infer_part(run: Path, rounds: int, test_src: Path, test_ref: Path, lines: int
               ) -> dict[str, Any]:
    import dynaseq
    from dynaseq.metrics.latency import decode_latency_ms
    from dynaseq.models.lean_encoder import LeanEncoder
    from dynaseq.tasks.encoder.model import build_encoder_model
    from dynaseq.tasks.registry import load_config

    pred = {p: dynaseq.load(run, precision=p) for p in ("fp32", "bf16")}
    cct = pred["fp32"].config.model.cct is not None
    budgets = BUDGETS if cct else ((1.0, 1.0),)
    decode = []
    for budget in budgets:
        for beam in (1, 4):
            for batch in (1, 32):
                ms: dict[str, list[float]] = {"fp32": [], "bf16": []}
                controls = {p: t.control_for(budget if cct else None, batch)
                            for p, t in pred.items()}
                for _ in range(rounds):
                    for p, t in pred.items():
                        ms[p].append(decode_latency_ms(t.model, 30, 30, beam, batch, 1,
                                                       control=controls[p]))
                med = {p: sorted(v)[len(v) // 2] for p, v in ms.items()}
                decode.append({"budget": list(budget), "beam": beam, "batch": batch,
                               "fp32_ms": round(med["fp32"], 2),
                               "bf16_ms": round(med["bf16"], 2),
                               "speedup": round(med["fp32"] / med["bf16"], 3)})
                print(decode[-1], flush=True)
    src = test_src.read_text().splitlines()[:lines]
    ref = test_ref.read_text().splitlines()[:lines]
    bleu = []
    for budget in budgets:
        row: dict[str, Any] = {"budget": list(budget)}
        for p, t in pred.items():
            t0 = time.perf_counter()
            r = t.evaluate(src, ref, beam=1, budget=budget if cct else None)
            row[f"{p}_bleu"] = round(float(r["bleu"]), 2)
            row[f"{p}_s"] = round(time.perf_counter() - t0, 1)
        bleu.append(row)
        print(row, flush=True)
    cfg = load_config("configs/sst2_small.yaml", ["run_dir=/nonexistent"])
    lean = {}
    for p in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = build_encoder_model(cfg.model, 8000, 2, 0).eval().to(
            torch.bfloat16 if p == "bf16" else torch.float32)
        lean[p] = LeanEncoder.prepare(model)
    classify = []
    with torch.inference_mode():
        for s in (32, 128):
            for b in (1, 32):
                x = torch.randint(7, 8000, (b, s))
                seg = torch.zeros_like(x)
                sec = _lib.interleaved_seconds(
                    {p: (lambda enc=enc, x=x, seg=seg: enc(x, seg)) for p, enc in lean.items()},
                    rounds)
                classify.append({"tokens": s, "batch": b,
                                 "fp32_ms": round(1000 * sec["fp32"], 2),
                                 "bf16_ms": round(1000 * sec["bf16"], 2),
                                 "speedup": round(sec["fp32"] / sec["bf16"], 3)})
                print(classify[-1], flush=True)
    return {"run": str(run), "checkpoint": str(pred["fp32"].checkpoint), "decode": decode,
            "bleu": bleu, "bleu_lines": len(src), "classify": classify}


def markdown(out: dict) -> list[str]:
    lines = _lib.md_head("precision: bfloat16 against float32, side by side", out["command"],
                         f"Code: {out['code']}", f"Machine: {out['machine']}",
                         f"{out['rounds']} interleaved rounds; speed-up = fp32 time / bf16 time.")
    if "train" in out:
        lines += ["", "## One training update (forward, loss, backward, AdamW)", ""]
        lines += _lib.md_table(["workload", "fp32 ms", "bf16 ms", "speed-up"], "lrrr",
                               [[r["workload"], r["fp32_ms"], r["bf16_ms"], r["speedup"]]
                                for r in out["train"]])
    if "curve" in out:
        c = out["curve"]
        lines += ["", f"## MLM pre-training through the loop, {c['fp32']['steps']} updates "
                      "each (validation: masked-token loss / accuracy %)", ""]
        steps = [v["step"] for v in c["fp32"]["valid"]]
        by = {p: {v["step"]: v for v in c[p]["valid"]} for p in ("fp32", "bf16")}
        lines += _lib.md_table(
            ["update", "fp32 loss", "bf16 loss", "fp32 acc", "bf16 acc"], "rrrrr",
            [[s, by["fp32"][s]["loss"], by["bf16"].get(s, {}).get("loss"),
              by["fp32"][s]["accuracy"], by["bf16"].get(s, {}).get("accuracy")]
             for s in steps])
        lines += ["", f"Minutes: fp32 {c['fp32']['minutes']}, bf16 {c['bf16']['minutes']} "
                      "(sequential runs, not interleaved)."]
    if "infer" in out:
        inf = out["infer"]
        lines += ["", f"## Translation: `{inf['run']}` (lean step, fixed 30 -> 30 tokens)", ""]
        lines += _lib.md_table(["budget", "search", "batch", "fp32 ms", "bf16 ms", "speed-up"],
                               "llrrrr",
                               [[tuple(r["budget"]), "greedy" if r["beam"] == 1 else "beam4",
                                 r["batch"], r["fp32_ms"], r["bf16_ms"], r["speedup"]]
                                for r in inf["decode"]])
        lines += ["", f"Test BLEU, greedy, first {inf['bleu_lines']} lines (seconds to "
                      "translate and score them):", ""]
        lines += _lib.md_table(["budget", "fp32 BLEU", "bf16 BLEU", "fp32 s", "bf16 s"],
                               "lrrrr", [[tuple(r["budget"]), r["fp32_bleu"], r["bf16_bleu"],
                                          r["fp32_s"], r["bf16_s"]] for r in inf["bleu"]])
        lines += ["", "## Classification: a `small` encoder's lean pass (random weights)", ""]
        lines += _lib.md_table(["tokens", "batch", "fp32 ms", "bf16 ms", "speed-up"], "rrrrr",
                               [[r["tokens"], r["batch"], r["fp32_ms"], r["bf16_ms"],
                                 r["speedup"]] for r in inf["classify"]])
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--curve-steps", type=int, default=400)
    p.add_argument("--run", type=Path, default=_lib.cct_quality_run("cct"))
    p.add_argument("--test-src", type=Path, default=_lib.RUNS / "serve_data" / "test.en")
    p.add_argument("--test-ref", type=Path, default=_lib.RUNS / "serve_data" / "test.fr")
    p.add_argument("--lines", type=int, default=1000, help="test lines for BLEU")
    _lib.add_results_arg(p)
    args = p.parse_args()
    torch.set_num_threads(2)
    out: dict[str, Any] = {"benchmark": "precision", "command": _lib.command(),
                           "code": _lib.code_state(), "date": time.strftime("%Y-%m-%d"),
                           "machine": _lib.machine(processor=True), "rounds": args.rounds}
    if "train" in args.only:
        out["train"] = train_part(args.rounds)
    if "curve" in args.only:
        out["curve"] = curve_part(args.curve_steps, _lib.RUNS)
    if "infer" in args.only:
        out["infer"] = infer_part(args.run, args.rounds, args.test_src, args.test_ref,
                                  args.lines)
    lines = markdown(out)
    _lib.write_results(args.results, "precision", out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
