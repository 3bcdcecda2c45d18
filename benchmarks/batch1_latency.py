"""Benchmark `batch1_latency`: dense decoding against CTranslate2 and the machine's limits,
DMB / MoE against dense (issue 28).

Every cell translates ``batch`` random 30-token sentences into exactly 30 tokens (eos is
forbidden before and forced after, :func:`dynaseq.metrics.latency.decode_latency_ms`), greedy
and beam 4, at batch 1, 8 and 32, on ``--threads`` threads. The systems of one row take turns
round by round (the machine's noise then hits them alike); a cell is the median of the
per-round medians, and every ratio is of two cells measured in the same rounds.

* **dense** ``tiny`` (d=128, 3+3 layers), ``small`` (256, 6+6), ``base`` (512, 6+6), vocabulary
  8000, random weights (seed 0): dynaseq's general decoding step, its lean step
  (:class:`dynaseq.models.lean.LeanDecoder`), and CTranslate2 (float32, the same weights
  converted: fused q/k/v, the same sinusoid table; ``pip install ctranslate2``, a
  benchmark-only extra) with ``intra_threads`` = ``--threads``, in a worker process of its
  own that imports no torch and takes its turns on request (:class:`CT2Process`). Before
  timing, the greedy tokens of the converted model are compared with dynaseq's on a model
  with peaked outputs.
* **limits** (measured in the same run): the weight-reading limit of a batch-1 step (bytes of
  decoder and output weights a step must read ÷ the read rate of a large matrix-vector
  product) and the SGEMM rate of a large float32 matrix product; each dense cell at batch 1
  is reported against the first, each at batch 32 against the second (FLOPs of the decode
  from the analytic MAC count, :func:`dynaseq.metrics.macs.count_macs`).
* **dmb / moe**: ``configs/multi30k_dmb_tiny.yaml`` and ``multi30k_moe_tiny.yaml`` (and the
  same at ``small``), untrained, shared parts merged, against the dense model of their size
  (lean step), at batch 1 and 32 (``--branching-batches``): DMB with its lean step (the
  branch each router picks, :mod:`dynaseq.techniques.branching.lean_step`), the same lean
  step as it ran before rows were laid out in blocks ("grouped": the source through the
  modules' own pass, every call of several rows in the router's grouped layout) and its
  general step; MoE has only the general step. Beside them, "dmb one branch": the same DMB
  model with every decoder router set to pick branch 0 for every token (its projection
  zeroed, one bias up), so a step reads one weight matrix per projection as the dense model
  does whatever its rows are; and the mean number of distinct branches one lean call of a
  router's sub-layer reads (counted over one decode of the DMB model as it routes): at beam
  4 the rows of a step are four different prefixes, each routed on its own.
* **cct**: ``configs/multi30k_cct_small.yaml`` untrained (control symbol 0) at fixed gate
  patterns, lean and general step, against the dense model of its shape (``small``, 3+3):
  every gate open with one offset of +inf (the decisions need no control network), every
  gate open and every gate closed as the control networks decide (offsets ±10⁶), every gate
  closed with -inf (the floor the ungated parts set: embeddings, the encoder's share, the
  output layer). An untrained model has no trained budgets; its patterns bound what any
  budget's mix of open and closed gates costs; "mixed (offset 0)" lets its untrained
  control nets decide (about half of the gates, differing by row). With ``--cct-run RUN`` (a
  trained CCT, e.g. ``runs/bench/cct_quality_cct`` of ``cct_quality.py``), that model at each
  of its (b, b) budgets as ``translate --budget b`` runs it (calibrated offsets where the run
  has them), with every gate closed by its control net (the floor, as ``cct_speed``
  measures it: the control nets run, as they do at any budget below 1) and with no decision
  at all (offset -inf), against the same dense model: each budget's time ÷ budget 1's
  beside the estimate ``floor + b·(1 − floor)`` and how far above it it is (issue 28's
  target: at most 0.05), and budget 1 ÷ the dense model. ``--only cct`` (or ``--only
  branching``) re-measures that section and keeps the others as committed (each section
  records the command, code and machine that made it); ``--only dense`` re-measures the
  dense rows and the limits and keeps the DMB / MoE and CCT sections.

    python benchmarks/batch1_latency.py [--sizes tiny small base] [--batches 1 8 32]
        [--branching-batches 1 32] [--rounds 3] [--repeats 1] [--threads 2] [--no-ct2]
        [--no-branching] [--no-cct] [--only dense|cct|branching] [--cct-run RUN]

Writes benchmarks/results/batch1_latency.{json,md}. Run from the repository root, alone.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dynaseq.metrics.latency import decode_latency_ms
from dynaseq.metrics.macs import count_macs
from dynaseq.models.lean import LeanDecoder
from dynaseq.models.search import greedy_search
from dynaseq.tasks.registry import load_config
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.branching import merge_shared_
from dynaseq.techniques.branching.routing import Router

import _lib
from _ct2_worker import VOCAB
from _ct2_worker import vocabulary as ct2_vocabulary

SRC_LEN = TGT_LEN = 30
LAYERS = {"tiny": 3, "small": 6, "base": 6}
BEAMS = {"greedy": 1, "beam4": 4}
SETTLE_S = 0.3
BRANCHING = {"dmb": "configs/multi30k_dmb_{size}.yaml", "moe": "configs/multi30k_moe_{size}.yaml"}
# decoder and encoder gate offsets of each CCT pattern (see the module docstring)
# a trained CCT's floor as cct_speed measures it (and issue 28 defines it): every gate closed
# by its control net, which still runs; and the bare floor, where nothing is decided
FLOOR_OFFSET, BARE_OFFSET = -1e6, -math.inf
CCT_PATTERNS = {"open (+inf)": math.inf, "open by control": 1e6, "mixed (offset 0)": 0.0,
                "closed by control": FLOOR_OFFSET, "closed (-inf)": BARE_OFFSET}


def dense(size: str, seed: int = 0, **kw) -> torch.nn.Module:
    """An untrained dense model of ``size`` (3+3 layers at tiny, 6+6 above; ``kw``: more
    :class:`ModelConfig` fields), eval mode."""
    torch.manual_seed(seed)
    n = LAYERS[size]
    cfg = ModelConfig(size=size, encoder_layers=n, decoder_layers=n, dropout=0.0, **kw)
    return build_seq2seq(cfg, VOCAB).eval()


def branched(kind: str, size: str) -> torch.nn.Module:
    """The untrained DMB or MoE model of the shipped tiny config at ``size``, shared parts
    merged (as :meth:`Translator.load` does), eval mode."""
    torch.manual_seed(0)
    overrides = [] if size == "tiny" else [f"model.size={size}", "model.d_model=null",
                                           "model.ffn_dim=null", "model.n_heads=null"]
    cfg = load_config(BRANCHING[kind].format(size="tiny"), overrides).model
    model = build_seq2seq(cfg, VOCAB)
    merge_shared_(model)
    return model.eval()


# ------------------------------------------------------------------ CTranslate2 conversion


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().numpy()


def _linear(spec, *mods: torch.nn.Linear) -> None:
    """One CTranslate2 linear spec from one or several (fused, stacked) ``nn.Linear``."""
    spec.weight = np.concatenate([_np(m.weight) for m in mods])
    if mods[0].bias is not None:
        spec.bias = np.concatenate([_np(m.bias) for m in mods])


def _norm(spec, norm: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _np(norm.weight), _np(norm.bias)


def _layer(spec, layer, cross: bool) -> None:
    sa = layer.self_attn
    _norm(spec.self_attention.layer_norm, layer.self_attn_norm)
    _linear(spec.self_attention.linear[0], sa.q_proj, sa.k_proj, sa.v_proj)
    _linear(spec.self_attention.linear[1], sa.out_proj)
    if cross:
        ca = layer.cross_attn
        _norm(spec.attention.layer_norm, layer.cross_attn_norm)
        _linear(spec.attention.linear[0], ca.q_proj)
        _linear(spec.attention.linear[1], ca.k_proj, ca.v_proj)
        _linear(spec.attention.linear[2], ca.out_proj)
    _norm(spec.ffn.layer_norm, layer.ffn_norm)
    _linear(spec.ffn.linear_0, layer.ffn.fc1)
    _linear(spec.ffn.linear_1, layer.ffn.fc2)


def to_ctranslate2(model: torch.nn.Module, out_dir: str, threads: int) -> CT2Process:
    """CTranslate2 running the same weights as the dense ``model`` (converted and saved to
    ``out_dir``), in a :class:`CT2Process` on ``threads`` threads."""
    from ctranslate2.specs import transformer_spec

    enc, dec = model.encoder, model.decoder
    n_heads = enc.layers[0].self_attn.n_heads
    spec = transformer_spec.TransformerSpec.from_config(
        (len(enc.layers), len(dec.layers)), n_heads, pre_norm=True)
    spec.encoder.embeddings[0].weight = _np(enc.embed.weight)
    spec.encoder.position_encodings.encodings = _np(enc.positions.table)
    _norm(spec.encoder.layer_norm, enc.norm)
    for s, layer in zip(spec.encoder.layer, enc.layers, strict=True):
        _layer(s, layer, cross=False)
    spec.decoder.embeddings.weight = _np(dec.embed.weight)
    spec.decoder.position_encodings.encodings = _np(dec.positions.table)
    _norm(spec.decoder.layer_norm, dec.norm)
    spec.decoder.projection.weight = _np(dec.output_proj.weight)
    for s, layer in zip(spec.decoder.layer, dec.layers, strict=True):
        _layer(s, layer, cross=True)
    vocab = ct2_vocabulary()
    assert (model.pad_id, model.bos_id, model.eos_id) == (0, 2, 3), "ids of the vocabulary"
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    spec.validate()
    spec.optimize(quantization=None)
    spec.save(out_dir)
    return CT2Process(out_dir, threads)


class CT2Process:
    """A CTranslate2 translator of the model saved in ``model_dir``, in a process of its own
    that decodes on request (``benchmarks/_ct2_worker.py``, which imports no torch), so that
    CTranslate2 and dynaseq take turns without sharing one.

    Why a process: on an Intel Xeon (session 50) one CTranslate2 decode in this process left
    torch's decoding slow for good (the dense ``tiny`` lean step at batch 1: 20 ms before,
    94-108 ms after; no thread spun, no affinity changed), and CTranslate2 itself ran 2x
    slower in a process that had imported torch (the worker's docstring)."""

    def __init__(self, model_dir: str, threads: int) -> None:
        worker = Path(__file__).with_name("_ct2_worker.py")
        self.proc = subprocess.Popen([sys.executable, str(worker), model_dir, str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, *msg: object) -> object:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the CTranslate2 worker ended (exit {self.proc.wait()})")
        return json.loads(line)

    def time_ms(self, batch: int, beam: int, repeats: int) -> float:
        """The median ms of ``repeats`` fixed-length decodes of ``batch`` of
        :func:`sources`: 31 tokens, 31 decoder steps, as many as dynaseq's fixed-length
        decode runs (30 tokens, then eos; CTranslate2 counts no step for an eos it is forced
        to stop at)."""
        return float(self.ask("time", sources(batch).tolist(), beam, TGT_LEN + 1, repeats))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def sources(batch: int, seed: int = 0) -> torch.Tensor:
    """``batch`` random sentences of ``SRC_LEN`` tokens, the last one eos."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (batch, SRC_LEN), generator=gen)
    src[:, -1] = 3
    return src


def agreement(threads: int) -> dict[str, float]:
    """Share of greedy tokens CTranslate2 and dynaseq agree on, for a ``tiny`` model whose
    outputs are made peaked (an untied output layer, scaled), 8 sentences."""
    model = dense("tiny", seed=1, tie_output=False)
    with torch.no_grad():
        model.decoder.output_proj.weight.mul_(8)
    with tempfile.TemporaryDirectory() as tmp:
        ct2 = to_ctranslate2(model, tmp, threads)
        src = sources(8, seed=1)
        ours = greedy_search(model, src, max_len_a=0, max_len_b=TGT_LEN + 1, min_len=TGT_LEN)
        theirs = ct2.ask("translate", src.tolist(), TGT_LEN)
        ct2.close()
    same = sum(a == b for x, y in zip(ours, theirs, strict=True)
               for a, b in zip(x, y, strict=True))
    return {"tokens": same / (8 * TGT_LEN), "distinct_tokens": len({t for x in ours for t in x})}


# ------------------------------------------------------------------------------ limits


def read_rate_gbs(rounds: int) -> float:
    """GB/s a large float32 matrix-vector product reads its matrix at (best of ``rounds``;
    a 64 MB matrix, larger than the caches)."""
    w = torch.randn(8192, 2048)
    x = torch.randn(2048)
    best = min(_lib.timed(lambda: [torch.mv(w, x) for _ in range(10)]) / 10
               for _ in range(rounds))
    wt = w.t().contiguous()
    best_t = min(_lib.timed(lambda: [x @ wt for _ in range(10)]) / 10 for _ in range(rounds))
    return w.numel() * 4 / min(best, best_t) / 1e9


def sgemm_gflops(rounds: int) -> float:
    """GFLOP/s of a 2048 × 2048 × 2048 float32 matrix product (best of ``rounds``)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = min(_lib.timed(lambda: a @ b) for _ in range(rounds))
    return 2 * 2048 ** 3 / best / 1e9


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decoder step must read: every decoder layer's except the
    cross-attention keys/values (projected once per sentence), and the output layer."""
    dec = model.decoder
    skip = {id(p) for layer in dec.layers
            for p in (*layer.cross_attn.k_proj.parameters(), *layer.cross_attn.v_proj.parameters())}
    params = [p for p in dec.layers.parameters() if id(p) not in skip]
    params += [dec.output_proj.weight]
    return sum(p.numel() * p.element_size() for p in params)


def decode_flops(model: torch.nn.Module, batch: int, beam: int) -> float:
    """FLOPs of the fixed-length decode of ``batch`` sentences: 2 × the analytic MACs of a
    30 → 31 pair, the decoder's counted once per beam (beam search's first step runs one row
    per sentence, so this counts 1/31 of the decoder work too much at beam 4)."""
    macs = count_macs(model, SRC_LEN, TGT_LEN + 1)
    return 2.0 * batch * (macs.encoder_total + beam * macs.decoder_total)


# ------------------------------------------------------------------------------- timing


def interleaved(systems: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median over rounds of each system's per-round time (ms), the systems taking turns,
    the first of a round moving on by one each round (no system always runs after the
    same one, whose weights or threads it might find warm).

    Each turn starts after a pause of :data:`SETTLE_S`: thread pools spin for a while after
    their last task (Intel OpenMP's default block time, CTranslate2's, is 200 ms), and a
    system that starts while the other's threads spin on the same two cores runs up to twice
    as slow."""
    per: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(SETTLE_S)
            per[name].append(systems[name]())
    return {name: round(statistics.median(v), 2) for name, v in per.items()}


def dense_rows(args, rates: dict[str, float]) -> list[dict]:
    """One row per (size, batch, search): general, lean and CTranslate2 ms and ratios."""
    rows = []
    for size in args.sizes:
        model = dense(size)
        tmp = tempfile.TemporaryDirectory()
        ct2 = None if args.no_ct2 else to_ctranslate2(model, tmp.name, args.threads)
        for batch in args.batches:
            for search, beam in BEAMS.items():
                def ours(lean: bool, model=model, batch=batch, beam=beam
                         ) -> Callable[[], float]:
                    return lambda: decode_latency_ms(model, SRC_LEN, TGT_LEN, beam=beam,
                                                     batch=batch, repeats=args.repeats,
                                                     lean=lean)
                systems = {"general": ours(False), "lean": ours(True)}
                if ct2 is not None:
                    systems["ctranslate2"] = (lambda ct2=ct2, batch=batch, beam=beam:
                                              ct2.time_ms(batch, beam, args.repeats))
                ms = interleaved(systems, args.rounds)
                row = {"size": size, "batch": batch, "search": search, "ms": ms,
                       "lean_vs_general": round(ms["lean"] / ms["general"], 3)}
                if ct2 is not None:
                    row["lean_vs_ct2"] = round(ms["lean"] / ms["ctranslate2"], 3)
                    row["general_vs_ct2"] = round(ms["general"] / ms["ctranslate2"], 3)
                if batch == 1:
                    limit = step_bytes(model) / (rates["read_gbs"] * 1e9) * 1000 * (TGT_LEN + 1)
                    # beams share a step's weights: the limit is the same for beam 4
                    row["weight_read_limit_ms"] = round(limit, 2)
                    row["lean_vs_limit"] = round(ms["lean"] / limit, 3)
                row["lean_gflops"] = round(decode_flops(model, batch, beam)
                                           / (ms["lean"] / 1000) / 1e9, 1)
                row["lean_share_of_sgemm"] = round(row["lean_gflops"] / rates["sgemm_gflops"], 3)
                rows.append(row)
                print(f"{size} b{batch} {search}: {ms}", flush=True)
        if ct2 is not None:
            ct2.close()
        tmp.cleanup()
    return rows


def grouped_lean(model: torch.nn.Module) -> LeanDecoder:
    """The DMB model's lean step as it ran before blocks (code 7dcfc6e): the source through
    the modules' own pass, and calls of several rows (the memory's keys and values) in the
    router's grouped layout."""
    lean = LeanDecoder.prepare(model)
    assert lean is not None, "a DMB model has a lean step"
    lean.encoder_layers = None
    for layer in lean.layers:
        for part in (layer.self_attn, layer.cross_attn, layer.ffn):
            part.blocks = False
    return lean


def one_branch(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the DMB ``model`` whose decoder routers pick branch 0 for every token."""
    one = copy.deepcopy(model)
    with torch.no_grad():
        for router in one.decoder.modules():
            if isinstance(router, Router):
                router.proj.weight.zero_()
                router.proj.bias.zero_()
                router.proj.bias[0] = 1.0
    return one


class CountBranches:
    """Wraps a lean DMB part's ``pick``: counts its small-step calls and the distinct
    branches each reads."""

    def __init__(self, pick: Callable[[torch.Tensor], list[int] | None]) -> None:
        self.pick, self.calls, self.branches = pick, 0, 0

    def __call__(self, x: torch.Tensor) -> list[int] | None:
        picks = self.pick(x)
        if picks is not None:
            self.calls += 1
            self.branches += len(set(picks))
        return picks


def branches_read(model: torch.nn.Module, beam: int, batch: int) -> float | None:
    """Mean distinct branches per small-step call of the lean DMB parts over a timed
    decode and its warm-up (beam search's one-row first step included); None when every
    call took the blocked path (more rows than a small step)."""
    lean = LeanDecoder.prepare(model)
    assert lean is not None, "a DMB model has a lean step"
    counters = []
    for layer in lean.layers:
        for part in (layer.self_attn, layer.cross_attn, layer.ffn):
            part.pick = CountBranches(part.pick)
            counters.append(part.pick)
    decode_latency_ms(model, SRC_LEN, TGT_LEN, beam=beam, batch=batch, repeats=1, lean=lean)
    calls = sum(c.calls for c in counters)
    return round(sum(c.branches for c in counters) / calls, 3) if calls else None


def branching_rows(args) -> list[dict]:
    """DMB (lean and general step) and MoE ÷ the dense model of their size, at each of
    ``--branching-batches``."""
    rows = []
    for size in [s for s in args.sizes if s in ("tiny", "small")]:
        base = build_dense_like(size)
        models = {kind: branched(kind, size) for kind in BRANCHING}
        models["dmb one branch"] = one_branch(models["dmb"])
        for batch, (search, beam) in itertools.product(args.branching_batches, BEAMS.items()):
            def t(model, lean=False, beam=beam, batch=batch) -> Callable[[], float]:
                return lambda: decode_latency_ms(model, SRC_LEN, TGT_LEN, beam=beam,
                                                 batch=batch, repeats=args.repeats, lean=lean)
            systems = {"dense lean": t(base, True), "dense general": t(base),
                       "dmb lean": t(models["dmb"], LeanDecoder.prepare(models["dmb"])),
                       "dmb lean grouped": t(models["dmb"], grouped_lean(models["dmb"])),
                       "dmb general": t(models["dmb"]), "moe": t(models["moe"]),
                       "dmb one branch": t(models["dmb one branch"],
                                           LeanDecoder.prepare(models["dmb one branch"]))}
            ms = interleaved(systems, args.rounds)
            row = {"size": size, "batch": batch, "search": search, "ms": ms,
                   "dmb_lean_vs_dense_lean": round(ms["dmb lean"] / ms["dense lean"], 3),
                   "dmb_general_vs_dense_general": round(ms["dmb general"]
                                                         / ms["dense general"], 3),
                   "dmb_lean_vs_general": round(ms["dmb lean"] / ms["dmb general"], 3),
                   "dmb_lean_vs_grouped": round(ms["dmb lean"] / ms["dmb lean grouped"], 3),
                   "moe_vs_dense_lean": round(ms["moe"] / ms["dense lean"], 3),
                   "dmb_one_branch_vs_dense_lean": round(ms["dmb one branch"]
                                                         / ms["dense lean"], 3),
                   "branches_read": branches_read(models["dmb"], beam, batch)}
            rows.append(row)
            print(f"branching {size} b{batch} {search}: {ms}", flush=True)
    return rows


def cct_section(args, made_by: dict) -> dict:
    """The CCT section: untrained gate patterns, and a trained run's budgets if given."""
    out = {"made_by": made_by, "rows": cct_rows(args)}
    if args.cct_run:
        out["trained_run"] = args.cct_run
        out["trained"] = trained_cct_rows(args)
    return out


def cct_rows(args) -> list[dict]:
    """The untrained CCT at each of :data:`CCT_PATTERNS`, lean and general step, against the
    dense model of its shape; one row per (batch, search)."""
    from dynaseq.techniques.cct.gating import BudgetControl

    cct = _lib.untrained_cct(VOCAB)
    base = build_dense_like("small")
    rows = []
    for batch in args.batches:
        for search, beam in BEAMS.items():
            def t(model, lean: bool, control=None, beam=beam, batch=batch
                  ) -> Callable[[], float]:
                return lambda: decode_latency_ms(model, SRC_LEN, TGT_LEN, beam=beam,
                                                 batch=batch, repeats=args.repeats,
                                                 control=control, lean=lean)
            systems = {"dense lean": t(base, True), "dense general": t(base, False)}
            for name, off in CCT_PATTERNS.items():
                control = BudgetControl(0, {"encoder": off, "decoder": off})
                systems[f"cct {name} lean"] = t(cct, True, control)
                systems[f"cct {name} general"] = t(cct, False, control)
            ms = interleaved(systems, args.rounds)
            row = {"batch": batch, "search": search, "ms": ms}
            for name in CCT_PATTERNS:
                row[f"{name} lean_vs_dense_lean"] = round(
                    ms[f"cct {name} lean"] / ms["dense lean"], 3)
                row[f"{name} lean_vs_general"] = round(
                    ms[f"cct {name} lean"] / ms[f"cct {name} general"], 3)
            rows.append(row)
            print(f"cct b{batch} {search}: {ms}", flush=True)
    return rows


def trained_cct_rows(args) -> list[dict]:
    """The trained CCT ``args.cct_run`` at each of its (b, b) budgets and with every gate
    closed, lean step, against the dense model of its shape; one row per (batch, search)."""
    from dynaseq.tasks.translation.predictor import Translator
    from dynaseq.techniques.cct.gating import BudgetControl

    t = Translator.load(args.cct_run, device="cpu")
    budgets = sorted({e for e, d in t.config.model.cct.controls if e == d}, reverse=True)
    assert budgets[0] == 1.0, "a budget-1 control symbol"
    base = build_dense_like("small")
    closed = BudgetControl(0, {"encoder": FLOOR_OFFSET, "decoder": FLOOR_OFFSET})
    undecided = BudgetControl(0, {"encoder": BARE_OFFSET, "decoder": BARE_OFFSET})
    rows = []
    for batch in args.batches:
        for search, beam in BEAMS.items():
            def ms(model, control=None, beam=beam, batch=batch) -> Callable[[], float]:
                return lambda: decode_latency_ms(model, SRC_LEN, TGT_LEN, beam=beam,
                                                 batch=batch, repeats=args.repeats,
                                                 control=control)
            systems = {"dense lean": ms(base), "floor": ms(t.model, closed),
                       "floor, no decisions": ms(t.model, undecided),
                       **{f"b={b:g}": ms(t.model, t.control_for(b)) for b in budgets}}
            got = interleaved(systems, args.rounds)
            full, floor = got["b=1"], got["floor"] / got["b=1"]
            bare = got["floor, no decisions"] / full
            ratio = {f"{b:g}": round(got[f"b={b:g}"] / full, 3) for b in budgets}
            estimate = {f"{b:g}": round(floor + b * (1 - floor), 3) for b in budgets}
            row = {"batch": batch, "search": search, "ms": got,
                   "budget1_vs_dense_lean": round(full / got["dense lean"], 3),
                   "floor": round(floor, 3), "floor_no_decisions": round(bare, 3),
                   "ratio": ratio, "estimate": estimate,
                   "estimate_no_decisions": {f"{b:g}": round(bare + b * (1 - bare), 3)
                                             for b in budgets},
                   "above_estimate": {k: round(ratio[k] - estimate[k], 3) for k in ratio}}
            rows.append(row)
            print(f"trained cct b{batch} {search}: {got}", flush=True)
    return rows


def build_dense_like(size: str) -> torch.nn.Module:
    """The dense model of the DMB / MoE configs' shape (3+3 layers) at ``size``
    (:func:`_lib.dense_like`)."""
    return _lib.dense_like(size, VOCAB)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "small", "base"], choices=LAYERS)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--branching-batches", nargs="+", type=int, default=[1, 32],
                   help="batch sizes of the DMB / MoE section")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--repeats", type=int, default=1, help="timed decodes per system and round")
    p.add_argument("--threads", type=int, default=2, help="torch and CTranslate2 threads")
    p.add_argument("--no-ct2", action="store_true", help="skip CTranslate2")
    p.add_argument("--no-branching", action="store_true", help="skip DMB / MoE")
    p.add_argument("--no-cct", action="store_true", help="skip the CCT")
    p.add_argument("--cct-run", help="a trained CCT run: time its budgets too")
    p.add_argument("--only", choices=["dense", "cct", "branching"],
                   help="measure this section only; keep the others as committed")
    _lib.add_results_arg(p)
    args = p.parse_args()
    if args.only and not (args.results / "batch1_latency.json").exists():
        # the other sections are kept as committed: without them there is no table to write
        p.error(f"--only {args.only} updates {args.results / 'batch1_latency.json'}, "
                "which does not exist (copy the committed one there, or run every section)")
    torch.set_num_threads(args.threads)
    made_by = {**_lib.provenance(), "machine": _lib.machine(processor=True),
               "rounds": args.rounds, "repeats": args.repeats}
    if args.only in ("cct", "branching"):
        path = args.results / "batch1_latency.json"
        out = json.loads(path.read_text()) if path.exists() else {}
        out[args.only] = (cct_section(args, made_by) if args.only == "cct"
                          else {"made_by": made_by, "rows": branching_rows(args)})
        lines = markdown(out)
        _lib.write_results(args.results, "batch1_latency", out, lines, json_newline=True)
        print("\n".join(lines))
        return
    out = dense_section(args)
    if args.only == "dense":  # the other sections as committed
        kept = json.loads((args.results / "batch1_latency.json").read_text())
        out.update({k: kept[k] for k in ("branching", "cct") if k in kept})
    else:
        if not args.no_branching:
            out["branching"] = {"made_by": made_by, "rows": branching_rows(args)}
        if not args.no_cct:
            out["cct"] = cct_section(args, made_by)
    lines = markdown(out)
    _lib.write_results(args.results, "batch1_latency", out, lines, json_newline=True)
    print("\n".join(lines))


def dense_section(args) -> dict:
    """The file's top level: provenance, the machine's limits, CTranslate2's agreement and
    the dense rows."""
    rates = {"read_gbs": round(read_rate_gbs(5), 2), "sgemm_gflops": round(sgemm_gflops(5), 1)}
    print(f"limits: {rates}", flush=True)
    out = {"benchmark": "batch1_latency", **_lib.provenance(),
           "machine": _lib.machine(processor=True), "rounds": args.rounds,
           "repeats": args.repeats, "limits": rates}
    if not args.no_ct2:
        import ctranslate2

        out["ctranslate2"] = {"version": ctranslate2.__version__,
                              "agreement": agreement(args.threads)}
    out["dense"] = dense_rows(args, rates)
    return out


def markdown(out: dict) -> list[str]:
    """The lines of batch1_latency.md for the results ``out``."""
    code = (out["commit"] or "no git checkout")[:12] + (
        " (with uncommitted changes)" if out["dirty"] else "")
    lines = _lib.md_head(
        "batch1_latency: fixed-length 30 → 30 decoding against CTranslate2 and the limits",
        out["command"], f"Code: {code} ({out['date']} UTC)", f"Machine: {out['machine']}",
        f"{out['rounds']} interleaved rounds of {out['repeats']} timed decode(s) per system "
        "(after a warm-up), the median of the per-round medians. Untrained models, "
        f"vocabulary {VOCAB}. Limits measured in this run: a large matrix-vector product "
        f"reads {out['limits']['read_gbs']} GB/s, a large SGEMM runs at "
        f"{out['limits']['sgemm_gflops']} GFLOP/s.")
    if "ctranslate2" in out:
        a = out["ctranslate2"]["agreement"]
        lines += [f"CTranslate2 {out['ctranslate2']['version']} runs the same weights: greedy "
                  f"tokens agree {a['tokens']:.1%} with dynaseq's ({a['distinct_tokens']} "
                  "distinct tokens, peaked tiny model).", ""]
    lines += ["## Dense (ms; ratios of cells measured side by side)", "",
              "Targets: lean ≤ 1.0× CTranslate2 everywhere; at batch 1 ≤ 1.5× the "
              "weight-reading limit; at batch 32 ≥ 60% of the SGEMM rate.", ""]
    header = ["size", "batch", "search", "general", "lean", "CTranslate2", "lean ÷ general",
              "lean ÷ CT2", "general ÷ CT2", "limit ms", "lean ÷ limit", "share of SGEMM"]
    rows = [[r["size"], r["batch"], r["search"], r["ms"]["general"], r["ms"]["lean"],
             r["ms"].get("ctranslate2", "–"), r["lean_vs_general"], r.get("lean_vs_ct2", "–"),
             r.get("general_vs_ct2", "–"), r.get("weight_read_limit_ms", "–"),
             r.get("lean_vs_limit", "–"), r["lean_share_of_sgemm"]] for r in out["dense"]]
    lines += _lib.md_table(header, "lrl" + "r" * 9, rows)
    if out.get("branching"):
        lines += branching_markdown(out["branching"])
    if out.get("cct"):
        lines += cct_markdown(out["cct"])
    return lines


def _made_by(m: dict) -> str:
    """A section's provenance line: its command, code, machine and rounds."""
    code = (m["commit"] or "no git checkout")[:12] + (
        " (with uncommitted changes)" if m["dirty"] else "")
    return (f"Command: `{m['command']}`; code {code} ({m['date']} UTC); machine "
            f"{m['machine']}; {m['rounds']} interleaved rounds of {m['repeats']} decode(s).")


def branching_markdown(section: dict) -> list[str]:
    """The DMB / MoE section of batch1_latency.md."""
    lines = ["", "## DMB and MoE against dense (ms)", "", _made_by(section["made_by"]),
             "", "Target: DMB ≤ 1.05× the dense model at batch 1 (lean step against lean "
             "step), greedy and beam 4, tiny and small; no regression at batch 32.", ""]
    systems = ("dense lean", "dense general", "dmb lean", "dmb lean grouped", "dmb general",
               "moe", "dmb one branch")
    ratios = {"dmb lean ÷ dense lean": "dmb_lean_vs_dense_lean",
              "dmb general ÷ dense general": "dmb_general_vs_dense_general",
              "dmb lean ÷ general": "dmb_lean_vs_general",
              "dmb lean ÷ lean grouped": "dmb_lean_vs_grouped", "moe ÷ dense lean":
              "moe_vs_dense_lean", "dmb one branch ÷ dense lean": "dmb_one_branch_vs_dense_lean",
              "branches a small-step call reads": "branches_read"}
    rows = section["rows"]
    if not all("dmb lean grouped" in r["ms"] for r in rows):  # rows from before blocks
        systems = tuple(k for k in systems if k != "dmb lean grouped")
        del ratios["dmb lean ÷ lean grouped"]
    if not all("dmb one branch" in r["ms"] for r in rows):  # rows from before one branch
        systems = tuple(k for k in systems if k != "dmb one branch")
        del ratios["dmb one branch ÷ dense lean"], ratios["branches a small-step call reads"]
    return lines + _lib.md_table(
        ["size", "batch", "search", *systems, *ratios],
        "lrl" + "r" * (len(systems) + len(ratios)),
        [[r["size"], r.get("batch", 1), r["search"], *(r["ms"][k] for k in systems),
          *("–" if r[key] is None else r[key] for key in ratios.values())] for r in rows])


def cct_markdown(cct: dict) -> list[str]:
    """The CCT section of batch1_latency.md."""
    lines = ["", "## CCT against dense (ms; untrained `multi30k_cct_small`, gate patterns)", "",
             _made_by(cct["made_by"]), "",
             "Targets (for a trained model's budgets): budget 1 ≤ 1.05× the dense model; a "
             "lower budget ≤ 0.05 above the floor that every gate closed sets.", ""]
    names = list(CCT_PATTERNS)
    header = ["batch", "search", "dense lean", "dense general",
              *(f"{n} lean / general" for n in names), *(f"{n} ÷ dense lean" for n in names)]
    lines += _lib.md_table(header, "ll" + "r" * (len(header) - 2), [
        [r["batch"], r["search"], r["ms"]["dense lean"], r["ms"]["dense general"],
         *(f"{r['ms'][f'cct {n} lean']} / {r['ms'][f'cct {n} general']}" for n in names),
         *(r[f"{n} lean_vs_dense_lean"] for n in names)] for r in cct["rows"]])
    if cct.get("trained"):
        rows = cct["trained"]
        budgets = list(rows[0]["ratio"])
        lines += ["", f"Trained CCT `{cct['trained_run']}`, lean step, each (b, b) budget as "
                  "`translate --budget b` runs it: time ÷ budget 1's, then in brackets the "
                  "estimate floor + b·(1 − floor) and how far above it the budget is (target: "
                  "≤ 0.05). The floor is every gate closed by its control net, which still "
                  "runs (as `cct_speed` measures it: the ungated parts of any budget below 1); "
                  "the floor of no decisions (offset -inf: no control net runs, which no "
                  "budget below 1 can do) and its estimate are given beside it. Budget 1 ÷ "
                  "the dense model's lean step.", ""]
        header = ["batch", "search", "dense lean ms", "budget 1 ms", "budget 1 ÷ dense",
                  "floor", "floor, no decisions", *(f"b={b}" for b in budgets[1:]),
                  *(f"b={b}, estimate without decisions" for b in budgets[1:])]
        lines += _lib.md_table(header, "ll" + "r" * (len(header) - 2), [
            [r["batch"], r["search"], r["ms"]["dense lean"], r["ms"]["b=1"],
             r["budget1_vs_dense_lean"], r["floor"], r["floor_no_decisions"],
             *(f"{r['ratio'][b]} ({r['estimate'][b]}; {r['above_estimate'][b]:+})"
               for b in budgets[1:]),
             *(r["estimate_no_decisions"][b] for b in budgets[1:])]
            for r in rows])
    return lines


if __name__ == "__main__":
    main()
