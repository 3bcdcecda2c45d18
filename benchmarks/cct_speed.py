"""Benchmark `cct_speed`: is a CCT budget a wall-clock saving? (2 CPU cores)

For the CCT of benchmarks/cct_quality.py at each budget (b, b), and for the dense `small`
model of the same size trained as long (benchmarks/cct_quality.py), measures in one process, interleaved
round by round (these machines are noisy; the ratios come from the same rounds):

* teacher-forced scoring of Multi30k test_2016_flickr (1000 sentences, batches of
  ``data.max_tokens`` tokens);
* batched beam-4 decoding of the same sentences (batches of 64).

* the scoring pass's output projection and loss alone (``output layer + loss only``), the
  part of scoring no gate can skip;

* beam-4 decoding of the same sentences forced to exactly ``--fixed-len`` tokens each
  (``min_len``; no early end): every system then runs the same number of steps, so the
  ratios hold compute per step apart from how long each system's translations are.

Times are reported as ratios to the CCT at budget 1 (median over rounds). Also measured:
the CCT with every gate forced off (``force_gates(model, 0.0)``: embeddings, output layer,
control nets and gating overhead only), scored and decoded at the fixed length: the
ungated floor. ``floor + b·(1 − floor)`` is an *estimate* of the time at budget b (the
gated part scaled by b), not a bound: a budget can measure below it (the floor's run also
pays gating overhead that partly scales with the gates left on).

Targets, each reported beside the ratio it is held against: budget b < 1 scores in at most
b + 0.10 and beam-decodes in at most b + 0.25 of budget 1's time (the latter defined for
free beam decoding; the fixed-length column is held against the same b + 0.25 and labelled
so); budget 1 scores and decodes in at most 1.10× the dense model's time.

    python benchmarks/cct_speed.py [--rounds 3] [--decode-lines 1000] [--fixed-len 16]
                                   [--variants cct_nonorm ...]
                                   [--cct RUN --dense RUN --score-lines N --no-free-beam
                                    --name cct_speed_base]

``--variants`` also times CCT variants of ``cct_quality.py`` (runs/bench/cct_quality_NAME,
calibrated by its report) at every budget, in the same rounds: their ratios to their own
budget 1, and their budget 1 against the dense model.

Each budget runs as the CCT run's calibration.json sets it (written by
``cct_quality.py report``): with the gate offsets that make its realized compute meet it.

``--cct`` / ``--dense`` time other runs (e.g. the untrained, calibrated base- or big-size pairs of
``cct_untrained.py``; ``--no-free-beam`` then skips the free beam decoding, whose
lengths mean nothing for an untrained model) and ``--name`` names the result files.

Writes benchmarks/results/cct_speed.{json,md} (``--name``). Run from the repository root,
alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from math import nan

import torch

from dynaseq.core.checkpoint import read_meta
from dynaseq.data import collate, make_corpus, read_lines, token_batches
from dynaseq.nn.losses import label_smoothed_loss
from dynaseq.tasks.translation.predictor import Translator, decode_corpus
from dynaseq.techniques.cct.layers import force_gates

import _lib
from _lib import timed

DATA = _lib.MULTI30K
CCT_RUN = _lib.cct_quality_run("cct")
DENSE_RUN = _lib.cct_quality_run("small")
BUDGETS = [(1.0, 1.0), (0.5, 0.5), (0.33, 0.33), (0.2, 0.2)]


def fixed_length_beam4(t: Translator, lines: list[str], budget, length: int) -> None:
    """Beam-4 decoding of ``lines`` (batches of 64) to exactly ``length`` tokens each."""
    with t.at_budget(budget) as control:
        decode_corpus(t.model, t.tokenizer.encode(lines), beam=4, max_len_a=0.0,
                      max_len_b=length, min_len=length - 1, batch_size=64, device=t.device,
                      control=control)


OUTPUT_ONLY = "output layer + loss only"


@torch.no_grad()
def score_output_layer_only(t: Translator, src: list[str], ref: list[str]) -> None:
    """The scoring pass's output projection and loss alone, on the same batches as
    ``Translator.score`` (the decoder's states replaced by zeros): the part of scoring
    that no gate can skip."""
    m = t.model
    corpus, _ = make_corpus(t.tokenizer.encode(src), t.tokenizer.encode(ref),
                            t.config.data.max_len, long_lines="truncate")
    for idx in token_batches(corpus.src_lengths(), corpus.tgt_lengths(),
                             t.config.data.max_tokens, seed=0, epoch=0, shuffle=False):
        b = collate(corpus, idx, m.pad_id, m.bos_id, m.eos_id)
        h = torch.zeros(*b.tgt_in.shape, m.decoder.output_proj.in_features)
        label_smoothed_loss(m.decoder.output_proj(h), b.tgt_out, 0.0, m.pad_id)


def time_system(t: Translator, budget, forced: float | None, src: list[str], ref: list[str],
                dec_src: list[str], fixed_len: int, free_beam: bool = True
                ) -> tuple[float, float, float]:
    """Seconds to score ``src``/``ref``, beam-decode ``dec_src`` and beam-decode it to
    ``fixed_len`` tokens (no free decoding with forced gates, or without ``free_beam``:
    its lengths mean nothing there)."""
    ctx = force_gates(t.model, forced) if forced is not None else contextlib.nullcontext()
    with ctx:
        s = timed(lambda: t.score(src, ref, budget=budget))
        d = nan if forced is not None or not free_beam else timed(
            lambda: t.translate(dec_src, beam=4, budget=budget))
        f = timed(lambda: fixed_length_beam4(t, dec_src, budget, fixed_len))
    return s, d, f


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-lines", type=int, default=1000)
    p.add_argument("--fixed-len", type=int, default=16,
                   help="tokens per sentence (eos included) of the fixed-length decoding")
    p.add_argument("--variants", nargs="*", default=[],
                   help="CCT variants of cct_quality.py to time too (e.g. cct_nonorm)")
    p.add_argument("--cct", default=CCT_RUN, help="the CCT run (calibrated) to time")
    p.add_argument("--dense", default=DENSE_RUN, help="the dense run of the CCT's size")
    p.add_argument("--score-lines", type=int, default=None,
                   help="score only the first N test sentences (default all)")
    p.add_argument("--no-free-beam", action="store_true",
                   help="skip free beam decoding (fixed-length only), e.g. untrained models")
    p.add_argument("--name", default="cct_speed", help="result file name (no suffix)")
    p.add_argument("--render", action="store_true",
                   help="measure nothing: write NAME.md again from the committed NAME.json, "
                        "brought to the current fields (see upgrade)")
    _lib.add_results_arg(p)
    args = p.parse_args()
    if args.render:
        out = upgrade(json.loads((args.results / f"{args.name}.json").read_text()))
        _lib.write_results(args.results, args.name, out, markdown(out))
        return
    src = read_lines(DATA / "test_2016_flickr.en.gz")[: args.score_lines]
    ref = read_lines(DATA / "test_2016_flickr.fr.gz")[: args.score_lines]
    dec_src = src[: args.decode_lines]
    cct, dense = Translator.load(args.cct), Translator.load(args.dense)
    # name -> (translator, budget, gates forced to)
    systems = {f"cct {b[0]:g},{b[1]:g}": (cct, b, None) for b in BUDGETS}
    systems["cct all gates off"] = (cct, BUDGETS[0], 0.0)
    dense_name = "dense small" if str(args.dense) == str(DENSE_RUN) else "dense, same size"
    systems[dense_name] = (dense, None, None)
    systems[OUTPUT_ONLY] = (cct, None, None)
    variant_of: dict[str, str] = {}  # system name -> the variant it times
    for v in args.variants:
        tv = Translator.load(_lib.cct_quality_run(v))
        for b in BUDGETS:
            systems[f"{v} {b[0]:g},{b[1]:g}"] = (tv, b, None)
            variant_of[f"{v} {b[0]:g},{b[1]:g}"] = v
    times = {name: {"score": [], "beam4": [], "beam4_fixed": []} for name in systems}
    for r in range(args.rounds + 1):  # round 0 warms up and is not counted
        for name, (t, budget, forced) in systems.items():
            if name == OUTPUT_ONLY:
                s, d, f = timed(lambda: score_output_layer_only(cct, src, ref)), nan, nan
            else:
                s, d, f = time_system(t, budget, forced, src, ref, dec_src, args.fixed_len,
                                      not args.no_free_beam)
            if r:
                for key, value in (("score", s), ("beam4", d), ("beam4_fixed", f)):
                    times[name][key].append(value)
            print(f"round {r} {name}: score {s:.2f}s beam4 {d:.2f}s fixed {f:.2f}s",
                  file=sys.stderr, flush=True)
    med = {n: {k: statistics.median(v) for k, v in m.items()} for n, m in times.items()}
    base = med["cct 1,1"]
    floor = {k: med["cct all gates off"][k] / base[k] for k in ("score", "beam4_fixed")}
    rows = []
    for name in systems:
        row = {"system": name, "seconds": {k: round(v, 3) for k, v in med[name].items()},
               "ratio_to_cct_budget_1": {k: round(med[name][k] / base[k], 3) for k in base}}
        budget = systems[name][1]
        variant = variant_of.get(name)
        if variant is not None:
            own = med[f"{variant} 1,1"]
            row["ratio_to_own_budget_1"] = {k: round(med[name][k] / own[k], 3) for k in own}
        if (name.startswith("cct ") or variant) and systems[name][2] is None:
            b = budget[0]
            row["budget"] = list(budget)
            if tuple(budget) == (1.0, 1.0):  # held against the dense model, not against b
                row["ratio_to_dense"] = {k: round(med[name][k] / med[dense_name][k], 3)
                                         for k in base}
                row["target"] = {"vs_dense": 1.10}
            else:  # beam4_fixed: the free-beam target b + 0.25, applied at the fixed length
                row["target"] = {"score": round(b + 0.10, 3), "beam4": round(b + 0.25, 3),
                                 "beam4_fixed": round(b + 0.25, 3)}
            if variant is None:  # the floor was measured on the CCT, not its variants
                row["floor_estimate"] = {k: round(f + b * (1 - f), 3)
                                         for k, f in floor.items()}
        rows.append(row)
    dense_vs_cct = {k: round(base[k] / med[dense_name][k], 3) for k in base}
    variants_vs_dense = {v: {k: round(med[f"{v} 1,1"][k] / med[dense_name][k], 3)
                             for k in base} for v in args.variants}
    out = {"benchmark": args.name,
           "command": _lib.command(),
           "runs": {"cct": str(args.cct), "dense": str(args.dense)},
           # weights never trained (cct_untrained.py): timings only, no quality
           "untrained": [str(r) for r, t in ((args.cct, cct), (args.dense, dense))
                         if read_meta(t.checkpoint).get("untrained", False)],
           "machine": _lib.machine(),
           "test_set": f"multi30k test_2016_flickr en->fr: {len(src)} sentences scored, "
                       f"{len(dec_src)} decoded (beam 4, batches of 64), also to exactly "
                       f"{args.fixed_len} tokens each",
           "calibrated_budgets": [list(c.budget) for c in cct.calibrations],
           "rows": rows, "cct_budget_1_time_over_dense": dense_vs_cct,
           "variant_budget_1_time_over_dense": variants_vs_dense,
           "floor_all_gates_off": {k: round(v, 3) for k, v in floor.items()},
           "floor_output_layer_scoring": round(med[OUTPUT_ONLY]["score"] / base["score"], 3)}
    lines = markdown(out)
    _lib.write_results(args.results, args.name, out, lines)
    print("\n".join(lines))


def upgrade(out: dict) -> dict:
    """Results ``out`` written before the script named the floor's estimate and each ratio's
    target, brought to the current fields; no value changes. ``amdahl_limit`` becomes
    ``floor_estimate`` (an estimate, not a bound). A budget-1 row is held against the dense
    model: its ``ratio_to_dense`` is the run's ``cct_budget_1_time_over_dense`` (a variant's:
    ``variant_budget_1_time_over_dense``), the same medians' ratio the script now writes per
    row, and its target ``vs_dense`` 1.10. A budget b < 1 gets the fixed-length column's
    target, the free beam's b + 0.25."""
    for r in out["rows"]:
        if "amdahl_limit" in r:
            r["floor_estimate"] = r.pop("amdahl_limit")
        budget, target = r.get("budget"), r.get("target", {})
        if budget is None or "vs_dense" in target or "beam4_fixed" in target:
            continue
        if tuple(budget) == (1.0, 1.0):
            variant = r["system"].rsplit(" ", 1)[0]
            r["ratio_to_dense"] = (out["cct_budget_1_time_over_dense"] if variant == "cct"
                                   else out["variant_budget_1_time_over_dense"][variant])
            r["target"] = {"vs_dense": 1.10}
        else:
            r["target"] = {**target, "beam4_fixed": round(budget[0] + 0.25, 3)}
    return out


def markdown(out: dict) -> list[str]:
    """The lines of the result's Markdown for the results ``out``."""
    lines = _lib.md_head(
        f"{out['benchmark']}: wall time at each budget, ratio to budget 1 (same run, "
        "interleaved)", out["command"],
        *([f"Runs: CCT `{out['runs']['cct']}`, dense `{out['runs']['dense']}`"
           + (f" ({', '.join(out['untrained'])}: untrained weights, built by "
              "`benchmarks/cct_untrained.py`, the CCT's gate offsets calibrated so each "
              "budget's realized compute meets it; these timings say nothing of quality)"
              if out.get("untrained") else "")] if "runs" in out else []),
        f"Machine: {out['machine']}", f"Test set: {out['test_set']}",
        f"Budgets run with calibrated gate offsets: {out['calibrated_budgets']}")

    def cells(r: dict) -> list:
        tg, est, sec = r.get("target", {}), r.get("floor_estimate", {}), r["seconds"]
        ratio = r.get("ratio_to_own_budget_1", r["ratio_to_cct_budget_1"])
        to_dense = r.get("ratio_to_dense")

        def held(k: str) -> tuple[object, object]:  # (the ratio, its target) of column k
            if to_dense is not None:  # budget 1: its time over the dense model's
                return f"{ratio[k]} ({to_dense[k]}× dense)", f"≤ {tg['vs_dense']}× dense"
            return ratio[k], tg.get(k, "")

        return [r["system"], *held("score"), est.get("score", ""), *held("beam4"),
                *held("beam4_fixed"), est.get("beam4_fixed", ""), sec["score"], sec["beam4"],
                sec["beam4_fixed"]]

    lines += _lib.md_table(
        ["system", "scoring ratio", "target", "estimate from floor", "beam-4 ratio", "target",
         "fixed-length beam-4 ratio", "target (free beam's b + 0.25)", "estimate from floor",
         "scoring s", "beam-4 s", "fixed s"],
        "l" + "r" * 11, (cells(r) for r in out["rows"]))
    dense, floor = out["cct_budget_1_time_over_dense"], out["floor_all_gates_off"]
    lines += ["", f"CCT at budget 1 takes {dense['score']}× the dense model's time to score, "
              f"{dense['beam4']}× to beam-decode and {dense['beam4_fixed']}× to beam-decode at "
              "the fixed length (target ≤ 1.10×).", "",
              "Targets: budget b < 1 at most b + 0.10 of budget 1's scoring time and b + 0.25 "
              "of its beam-4 decoding time; b + 0.25 is the target for free beam decoding and "
              "is applied unchanged to the fixed-length column. Budget 1: at most 1.10× the "
              "dense model's time (its ratio to dense in brackets).", ""]
    for v, vs in out.get("variant_budget_1_time_over_dense", {}).items():
        lines += [f"Variant `{v}` (its rows: ratios to its own budget 1) at budget 1 takes "
                  f"{vs['score']}× the dense model's time to score, {vs['beam4']}× to "
                  f"beam-decode and {vs['beam4_fixed']}× at the fixed length.", ""]
    lines += [
              "Estimate from floor: floor + b·(1 − floor), where the floor is the CCT's time "
              "with every gate forced off (the ungated embeddings, output layer and control "
              f"nets, plus gating overhead): {floor['score']} of budget 1's time to score, "
              f"{floor['beam4_fixed']} to decode at the fixed length. It is an estimate, not "
              "a bound: a budget can measure below it. The beam-4 column "
              "decodes each system's own translations, whose lengths differ by system; the "
              "fixed-length column runs every system the same number of steps.", "",
              f"Of budget 1's scoring time, {out['floor_output_layer_scoring']} is the output "
              "projection and loss alone (`output layer + loss only`: the same batches with "
              "the decoder states zeroed), which no gate can skip: if every other part "
              "scaled exactly with the budget, scoring at budget b would take "
              f"{out['floor_output_layer_scoring']} + "
              f"b·(1 − {out['floor_output_layer_scoring']}) of budget 1's time."]
    return lines


if __name__ == "__main__":
    main()
