"""Where does the cost of `dynaseq quantize` come from? Quantization without fine-tuning.

For each language-model run given: validation perplexity in float, then after inserting the
QAT structure of `dynaseq quantize` and calibrating the activation ranges on the first 8
training windows, without a single update (post-training quantization): weights only (per
output channel, the default), weights per tensor, and weights + activations. Also each
quantized Linear's input range (what the 9-bit activation scale must cover) against its
99.9th percentile. Compare with the `valid_curve` of the run's QAT fine-tuning in its
`quantize_report.json`: any gap between the two is the fine-tuning's, not the bit width's.

    python benchmarks/qat_probe.py runs/bench/micronet/prune35_5_long [--bits 9 6 4]

Writes benchmarks/results/qat_probe.{json,md}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dynaseq.compress.qat import QATConfig
from dynaseq.tasks.lm.predictor import LanguageModel, apply_qat_structure, evaluate_stream
from dynaseq.workflows.lm_runs import calibrate_activations, keep_pruned_zeros

import _lib

VALID_TOKENS = 40_000
SETTINGS: dict[str, dict] = _lib.registry("qat_probe", "settings")  # name -> QATConfig overrides


def valid_ppl(lm: LanguageModel) -> float:
    """Perplexity of ``lm`` on the first VALID_TOKENS validation tokens."""
    c = lm.config
    return evaluate_stream(lm.model, lm.ids("valid"), c.data.eval_batch_size,
                           c.model.extended_context, lm.device, VALID_TOKENS)["ppl"]


def quantized(run: str, bits: int, overrides: dict) -> LanguageModel:
    """The run as `dynaseq quantize` prepares it (with ``overrides``), calibrated."""
    lm = LanguageModel.load(run, device="cpu")
    keep_pruned_zeros(lm.model)
    apply_qat_structure(lm.model, QATConfig(bits=bits, **overrides), convert=False)
    calibrate_activations(lm)
    return lm


@torch.no_grad()
def input_ranges(run: str) -> dict[str, dict[str, float]]:
    """max |x| and its 99.9th percentile over the inputs of every Linear, 2 windows."""
    lm = LanguageModel.load(run, device="cpu")
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(name: str):
        return lambda _m, args: seen.setdefault(name, []).append(
            args[0].detach().abs().flatten())

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in lm.model.named_modules()
               if isinstance(m, torch.nn.Linear) and "emb" not in n]
    calibrate_activations(lm, n_windows=2)
    for h in handles:
        h.remove()
    out = {}
    for name, xs in seen.items():
        x = torch.cat(xs)[:4_000_000].float()
        out[name] = {"max": round(float(x.max()), 3),
                     "p99.9": round(float(torch.quantile(x, 0.999)), 3)}
    return out


def probe(run: str, bits: int) -> dict:
    """One result row: ``run``'s perplexity in float and under each of SETTINGS at ``bits``,
    its QAT fine-tuning's valid curve where one exists, its Linear input ranges."""
    row = {"run": run, "bits": bits,
           "float": round(valid_ppl(LanguageModel.load(run, device="cpu")), 2)}
    for name, overrides in SETTINGS.items():
        row[name] = round(valid_ppl(quantized(run, bits, overrides)), 2)
        print(f"{run}: {name}: {row[name]}", file=sys.stderr, flush=True)
    reports = {p: json.loads(p.read_text())
               for p in Path(run).parent.glob("*/quantize_report.json")}
    mine = [p for p, r in reports.items()  # QAT of this run at these bits
            if Path(r["source_run"]) == Path(run) and r["bits"] == bits]
    if mine:
        report = max(mine, key=lambda p: p.stat().st_mtime)
        rep = reports[report]
        row["qat_run"] = str(report.parent)
        row["qat_valid_curve"] = rep.get("valid_curve")
        row["qat_kept_step"] = rep.get("kept_step")
    row["input_ranges"] = input_ranges(run)
    return row


def markdown(out: dict) -> list[str]:
    """The lines of qat_probe.md for the results ``out``."""
    lines = _lib.md_head(
        "qat_probe: quantization without fine-tuning (post-training) vs QAT fine-tuning",
        out["command"], f"Machine: {out['machine']}",
        f"Measured: {out['measured']}; valid perplexity on the first {out['valid_tokens']} "
        "validation tokens; activation ranges calibrated on 8 training windows, no update.")

    def cells(r: dict) -> list:
        curve = ", ".join(f"{s}: {p:.2f}" for s, p in r.get("qat_valid_curve") or [])
        return [r["run"], r["bits"], r["float"], *(r[s] for s in SETTINGS), curve or "–",
                r.get("qat_kept_step", "–")]

    lines += _lib.md_table(
        ["run", "bits", "float", *SETTINGS, "QAT fine-tuning valid curve (step, ppl)",
         "kept step"], "lrr" + "r" * len(SETTINGS) + "lr", (cells(r) for r in out["rows"]))
    lines += ["", "Inputs of the quantized Linear layers (2 training windows): max |x| and "
              "99.9th percentile of |x|.", ""]
    # the ranges do not depend on the bits: one table row per run and layer
    return lines + _lib.md_table(
        ["run", "layer", "max", "p99.9"], "llrr",
        ([r["run"], name, v["max"], v["p99.9"]]
         for r in {r["run"]: r for r in out["rows"]}.values()
         for name, v in r["input_ranges"].items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="language-model run directories (float, maybe pruned)")
    p.add_argument("--bits", type=int, nargs="+", default=[9], help="bit widths, e.g. 9 6 4")
    _lib.add_results_arg(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = [probe(run, b) for run in args.runs for b in args.bits]
    out = {"command": _lib.command(), "machine": _lib.machine(torch_threads=False),
           "measured": time.strftime("%Y-%m-%d"), "valid_tokens": VALID_TOKENS, "rows": rows}
    lines = markdown(out)
    _lib.write_results(args.results, "qat_probe", out, lines, json_newline=True)
    print("\n".join(lines[:12 + len(rows)]))


if __name__ == "__main__":
    main()
