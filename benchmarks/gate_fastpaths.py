"""Benchmark `gate_fastpaths`: do gated-off sub-layers cost nothing at batch 1? (issue 28, item 2)

Times batch-1 decoding of a 30-token sentence into exactly 30 tokens
(:func:`dynaseq.metrics.latency.decode_latency_ms`, greedy and beam 4), in one process,
the systems taking turns round by round (the machine's noise then hits them alike), the
median of each system's per-round medians:

* an untrained CCT of the trained Multi30k CCT's shape (``configs/multi30k_cct_small.yaml``:
  d=256, 3+3 layers, 4 FFN pieces, control nets of width 64; vocabulary 8000, seed 0) with
  its gates all off (offsets -inf), all on (+inf) and mixed (offset 0: the untrained control
  nets open about half of them), each with the inference fast paths (``fast`` ) and with the
  general gather/pack/scatter path forced (``model.cct.fast_paths=false``, same weights);
  and the dense ``small`` model of the same shape;
* an untrained Transformer-DMB ``tiny`` (``configs/multi30k_dmb_tiny.yaml``, shared parts
  merged as for inference) with the single-branch fast path and with the grouped path forced
  (``model.dmb.fast_paths=false``), against the dense ``tiny`` model.

Each CCT setting also reports the fraction of the gated sub-layers' MACs that ran (teacher
forced on the same kind of random 30 → 30 pair). Random weights are fine here: the timing
depends on the shapes and on which gates are open, not on what the model has learned.

    python benchmarks/gate_fastpaths.py [--rounds 5] [--repeats 3] [--threads 2]

Writes benchmarks/results/gate_fastpaths.{json,md}. Run from the repository root, alone.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from dynaseq.metrics.latency import decode_latency_ms
from dynaseq.tasks.registry import load_config
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.branching import merge_shared_
from dynaseq.techniques.cct.layers import BudgetControl, realized_fraction

import _lib

VOCAB = 8000
SRC_LEN = TGT_LEN = 30
CCT_CONFIG = "configs/multi30k_cct_small.yaml"
DENSE_CCT_SIZE = ("configs/multi30k_small.yaml", ["model.encoder_layers=3",
                                                   "model.decoder_layers=3"])
DMB_CONFIG = "configs/multi30k_dmb_tiny.yaml"
DENSE_TINY = "configs/multi30k_tiny.yaml"
#: CCT setting -> gate offset of every gate (encoder and decoder)
GATES = {"all off": -math.inf, "all on": math.inf, "mixed": 0.0}
SETTINGS = ("greedy_b1", "beam4_b1")


def build(config: str, overrides: list[str]) -> torch.nn.Module:
    """An untrained (seed 0) translation model of ``config`` + ``overrides``, eval mode,
    DMB shared parts merged."""
    torch.manual_seed(0)
    model = build_seq2seq(load_config(config, overrides).model, VOCAB)
    merge_shared_(model)
    return model.eval()


def twins(config: str, section: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model of ``config`` with its fast paths, and the same weights with the general
    path forced (``model.SECTION.fast_paths=false``)."""
    fast = build(config, [])
    general = build(config, [f"model.{section}.fast_paths=false"])
    general.load_state_dict(fast.state_dict())
    return fast, general


def control(offset: float) -> BudgetControl:
    """Control symbol 0 (budget (1, 1)) with every gate's offset ``offset``."""
    return BudgetControl(0, {"encoder": offset, "decoder": offset})


def systems() -> dict[str, tuple[torch.nn.Module, BudgetControl | None]]:
    """name -> (model, control) of every timed system."""
    cct_fast, cct_general = twins(CCT_CONFIG, "cct")
    dmb_fast, dmb_general = twins(DMB_CONFIG, "dmb")
    out: dict[str, tuple[torch.nn.Module, BudgetControl | None]] = {
        "dense small": (build(*DENSE_CCT_SIZE), None)}
    for gates, offset in GATES.items():
        out[f"cct {gates}, fast"] = (cct_fast, control(offset))
        out[f"cct {gates}, general"] = (cct_general, control(offset))
    out.update({"dense tiny": (build(DENSE_TINY, []), None), "dmb tiny, fast": (dmb_fast, None),
                "dmb tiny, general": (dmb_general, None)})
    return out


def latency(model: torch.nn.Module, ctl: BudgetControl | None, repeats: int) -> dict[str, float]:
    """ms of a 30 → 30-token batch-1 translation, greedy and beam 4."""
    return {f"{'greedy' if beam == 1 else 'beam4'}_b1": decode_latency_ms(
        model, SRC_LEN, TGT_LEN, beam=beam, batch=1, repeats=repeats, control=ctl)
        for beam in (1, 4)}


def gated_fraction(model: torch.nn.Module, ctl: BudgetControl) -> dict[str, float]:
    """Fraction of the gated sub-layers' MACs that ran on a random 30 → 30 pair."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, VOCAB, (1, SRC_LEN), generator=gen)
    tgt = torch.randint(4, VOCAB, (1, TGT_LEN), generator=gen)
    frac = realized_fraction(model, [(src, tgt)], ctl)["fraction"]
    return {k: round(v, 3) for k, v in frac.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    p.add_argument("--repeats", type=int, default=3, help="timed decodes per system and round")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    _lib.add_results_arg(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    timed = systems()
    per: dict[str, list[dict[str, float]]] = {name: [] for name in timed}
    for r in range(args.rounds):
        for name, (model, ctl) in timed.items():
            per[name].append(latency(model, ctl, args.repeats))
        print(f"round {r + 1}/{args.rounds}", flush=True)
    ms = {name: {k: round(statistics.median(run[k] for run in runs), 2) for k in SETTINGS}
          for name, runs in per.items()}
    fractions = {gates: gated_fraction(timed[f"cct {gates}, fast"][0], control(offset))
                 for gates, offset in GATES.items()}
    out = {"benchmark": "gate_fastpaths", **_lib.provenance(), "machine": _lib.machine(),
           "rounds": args.rounds, "repeats": args.repeats, "ms": ms,
           "ratios": ratios(ms), "cct_gated_fraction": fractions}
    lines = markdown(out)
    _lib.write_results(args.results, "gate_fastpaths", out, lines, json_newline=True)
    print("\n".join(lines))


def ratios(ms: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The ratios the report holds side by side, per setting: fast ÷ general path of each
    CCT gate setting and of DMB, each CCT setting ÷ the dense model of its size (fast
    path), all-off ÷ all-on (the ungated floor), DMB ÷ dense tiny (fast and general)."""
    def r(a: str, b: str) -> dict[str, float]:
        return {k: round(ms[a][k] / ms[b][k], 3) for k in SETTINGS}

    out = {}
    for gates in GATES:
        out[f"cct {gates}: fast ÷ general"] = r(f"cct {gates}, fast", f"cct {gates}, general")
    for gates in GATES:
        out[f"cct {gates} (fast) ÷ dense small"] = r(f"cct {gates}, fast", "dense small")
    out["cct all off ÷ all on (fast)"] = r("cct all off, fast", "cct all on, fast")
    out["cct all off ÷ all on (general)"] = r("cct all off, general", "cct all on, general")
    out["dmb tiny: fast ÷ general"] = r("dmb tiny, fast", "dmb tiny, general")
    out["dmb tiny (fast) ÷ dense tiny"] = r("dmb tiny, fast", "dense tiny")
    out["dmb tiny (general) ÷ dense tiny"] = r("dmb tiny, general", "dense tiny")
    return out


def markdown(out: dict) -> list[str]:
    """The lines of gate_fastpaths.md for the results ``out``."""
    code = (out["commit"] or "no git checkout")[:12] + (
        " (with uncommitted changes)" if out["dirty"] else "")
    lines = _lib.md_head(
        "gate_fastpaths: batch-1 decoding with the gate fast paths against the general path "
        "(30 → 30 tokens, ms)", out["command"], f"Code: {code} ({out['date']} UTC)",
        f"Machine: {out['machine']}",
        f"{out['rounds']} interleaved rounds of {out['repeats']} timed decodes per system "
        "(after a warm-up); the median of the per-round medians. Untrained models (seed 0), "
        "vocabulary 8000. `general`: the same weights with `fast_paths=false` (the general "
        "gather/pack/scatter path for every call, also where the code before the fast paths "
        "already took a shortcut, so it is not the old code).")
    lines += ["## Times (ms)", ""]
    lines += _lib.md_table(["system", *SETTINGS], "l" + "r" * len(SETTINGS),
                           [[name, *(row[k] for k in SETTINGS)] for name, row in out["ms"].items()])
    lines += ["", "## Ratios", ""]
    lines += _lib.md_table(["ratio", *SETTINGS], "l" + "r" * len(SETTINGS),
                           [[name, *(f"{row[k]:.3f}" for k in SETTINGS)]
                            for name, row in out["ratios"].items()])
    lines += ["", "## Share of the CCT's gated MACs that ran", "",
              *_lib.md_table(["gates", "encoder", "decoder", "total"], "lrrr",
                             [[g, f["encoder"], f["decoder"], f["total"]]
                              for g, f in out["cct_gated_fraction"].items()])]
    return lines


if __name__ == "__main__":
    main()
