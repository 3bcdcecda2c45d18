"""Benchmark `cct_gate_logits`: how far a trained CCT's gate logits sit from the threshold.

In training every gate is σ(logit + α·N(0, 1)) (CCT eq. 3, α = ``alpha_max`` once ramped);
at inference 1[logit ≥ 0]. A gate that inference opens is dropped in training with
probability Φ(−logit / α). This script runs each trained control symbol over the first
validation pairs (teacher forced, batch 1, inference gates, no calibration), collects the
logits of every gate at every position, and reports per budget the share of gates open, the
quantiles of the open gates' logits and the mean Φ(−logit / α) over them: the share of the
work inference runs that the training noise was switching off.

    python benchmarks/cct_gate_logits.py runs/bench/cct_quality_cct runs/bench/cct_quality_cct_long

Writes benchmarks/results/cct_gate_logits.{json,md}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dynaseq.core.errors import DynaseqError
from dynaseq.data import collate, make_corpus, read_lines
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.techniques.cct.gating import Gate

import _lib

DATA = _lib.MULTI30K
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def gate_logits(t: Translator, lines: int) -> dict[tuple[float, float], torch.Tensor]:
    """Each trained budget -> the logits (1-D) of every gate at every position, one pair at a
    time (batch 1: no padding to leave out)."""
    model = t.model.eval()
    src = t.tokenizer.encode(read_lines(DATA / "val.en.gz")[:lines])
    tgt = t.tokenizer.encode(read_lines(DATA / "val.fr.gz")[:lines])
    corpus, _ = make_corpus(src, tgt, t.config.data.max_len, "truncate")
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, inputs, _o: seen.append(inputs[0].flatten()))
             for m in model.modules() if isinstance(m, Gate)]
    out = {}
    try:
        for control, pair in enumerate(t.config.model.cct.controls):
            seen.clear()
            for i in range(len(corpus)):
                b = collate(corpus, [i], model.pad_id, model.bos_id, model.eos_id)
                with torch.no_grad():
                    model(b.src, b.tgt_in, torch.full((1,), control))
            out[pair] = torch.cat(seen)
    finally:
        for h in hooks:
            h.remove()
    return out


def summarize(logits: torch.Tensor, alpha: float) -> dict:
    on = logits[logits >= 0]
    q = torch.quantile(on, torch.tensor(QUANTILES))
    dropped = torch.distributions.Normal(0.0, 1.0).cdf(-on / alpha).mean() if alpha else 0.0
    return {"gates": logits.numel(), "open": round(float(on.numel() / logits.numel()), 3),
            "open_logit_quantiles": {f"{p:g}": round(float(v), 1)
                                     for p, v in zip(QUANTILES, q, strict=True)},
            "noise_drops_open": round(float(dropped), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="trained CCT run directories")
    p.add_argument("--lines", type=int, default=200, help="validation pairs (default 200)")
    _lib.add_results_arg(p)
    args = p.parse_args()
    torch.set_num_threads(2)
    rows = []
    for run in args.runs:
        try:
            t = Translator.load(run)
        except DynaseqError as e:
            raise SystemExit(f"error: {e}") from None
        if t.config.model.cct is None:
            raise SystemExit(f"error: {run} is not a CCT run")
        alpha = t.config.model.cct.alpha_max
        for pair, logits in gate_logits(t, args.lines).items():
            rows.append({"run": str(run), "budget": list(pair), "alpha": alpha,
                         **summarize(logits, alpha)})
    out = {"benchmark": "cct_gate_logits", "command": _lib.command(),
           "date": time.strftime("%Y-%m-%d"), "machine": _lib.machine(torch_threads=False),
           "data": f"first {args.lines} pairs of multi30k val en->fr, teacher forced",
           "rows": rows}
    lines = markdown(out)
    _lib.write_results(args.results, "cct_gate_logits", out, lines)
    print("\n".join(lines))


def markdown(out: dict) -> list[str]:
    """The lines of cct_gate_logits.md for the results ``out``."""
    cols = " / ".join(f"{q:g}" for q in QUANTILES)
    lines = _lib.md_head("cct_gate_logits: trained gate logits against the training noise",
                         out["command"], f"Machine: {out['machine']}", f"Data: {out['data']}")
    lines += ["open: share of gates inference opens (logit >= 0). Quantiles of the open gates' "
              "logits. noise drops: mean Φ(−logit/α) over the open gates, the share of their "
              "work the training noise α·N(0, 1) switched off.", ""]
    return lines + _lib.md_table(
        ["run", "budget (enc, dec)", "open", f"open-gate logit quantiles ({cols})",
         "noise drops"], "llrlr",
        ([Path(r["run"]).name, tuple(r["budget"]), r["open"],
          " / ".join(str(v) for v in r["open_logit_quantiles"].values()),
          r["noise_drops_open"]] for r in out["rows"]))


if __name__ == "__main__":
    main()
