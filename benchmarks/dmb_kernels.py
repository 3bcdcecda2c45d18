"""Where DMB's extra latency comes from: sub-layers and matmul kernels, dense vs branched.

For each model size and number of rows M (1 = a greedy step at batch 1, 30 = encoding one
sentence of 30 tokens, 32 = batch 32, 128 = beam 4 at batch 32, 960 = encoding 32 sentences
of 30 tokens), side by side in one
process, interleaved rounds, median of rounds:

* **sub-layers** (inference, DMB shared parts merged, random-init routers that spread the
  rows over the 4 branches): the dense FFN against the DMB FFN, and dense self-attention
  against DMB self-attention for one new token per sequence over 15 cached keys;
* **kernels** for one ``d -> ffn`` projection of rows already sorted by branch: one dense
  ``F.linear`` over all M rows; ``F.grouped_mm`` over the 4 groups (what the modules run);
  one ``F.linear`` per group (what they ran before); one ``torch.baddbmm`` over the rows laid
  out as 4 blocks of ``ceil(M/4)`` rows (what the lean parts run for calls of several rows
  whose blocks hold at most 64: :mod:`dynaseq.techniques.branching.blocks`). Their ratio to
  the dense ``F.linear`` is the floor of the DMB/dense latency ratio that no routing
  bookkeeping can go below with PyTorch's CPU kernels.

    python benchmarks/dmb_kernels.py [--sizes tiny small base] [--rounds 5]

Writes benchmarks/results/dmb_kernels.{json,md}. Run from the repository root, alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dynaseq.nn import FeedForward
from dynaseq.nn.attention import dense_attention
from dynaseq.tasks.translation.config import MODEL_SIZES
from dynaseq.techniques.branching import dmb_attention, dmb_feedforward, merge_shared_

import _lib

ROWS = (1, 30, 32, 128, 960)
N_BRANCHES = 4


def time_us(fn: Callable[[], object], min_time: float = 0.2) -> float:
    """Median per-call µs over 5 batches of calls, each batch running about ``min_time``/5 s."""
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.02:
        fn()
        n += 1
    per_batch = max(1, int(n * min_time / 5 / 0.02))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - t0) / per_batch * 1e6)
    return statistics.median(samples)


def cases(size: str, m: int) -> dict[str, Callable[[], object]]:
    """The timed callables for ``m`` rows at ``size``; all under ``no_grad``."""
    dims = MODEL_SIZES[size]
    d, ffn, heads = dims["d_model"], dims["ffn_dim"], dims["n_heads"]
    torch.manual_seed(0)
    ff_dense, ff_dmb = FeedForward(d, ffn).eval(), dmb_feedforward(d, ffn, N_BRANCHES).eval()
    at_dense, at_dmb = dense_attention(d, heads).eval(), dmb_attention(d, heads, N_BRANCHES).eval()
    merge_shared_(ff_dmb)
    merge_shared_(at_dmb)
    x = torch.randn(m, 1, d)  # m sequences, one new token each

    def self_attention(attn) -> Callable[[], object]:
        cache = attn.new_cache()
        attn(torch.randn(m, 15, d), cache=cache, is_causal=True)
        k, v = cache.k, cache.v

        def step() -> object:
            cache.k, cache.v = k, v  # the same 15 cached keys at every call
            return attn(x, cache=cache, is_causal=True)

        return step

    rows = torch.randn(m, d)
    weight, bias = torch.randn(N_BRANCHES, ffn, d), torch.randn(N_BRANCHES, ffn)
    sizes = [m // N_BRANCHES + (k < m % N_BRANCHES) for k in range(N_BRANCHES)]
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    w_t = weight.transpose(1, 2)
    per_block = -(-m // N_BRANCHES)  # P: the largest group
    blocks, bias_rows = torch.randn(N_BRANCHES, per_block, d), bias.unsqueeze(1)
    weights, biases = list(weight.unbind(0)), list(bias.unbind(0))
    return {
        "ffn dense": lambda: ff_dense(x),
        "ffn dmb": lambda: ff_dmb(x),
        "self-attn dense": self_attention(at_dense),
        "self-attn dmb": self_attention(at_dmb),
        "F.linear, all rows": lambda: F.linear(rows, weights[0], biases[0]),
        "F.grouped_mm, 4 groups": lambda: F.grouped_mm(rows, w_t, offs=ends),
        "F.linear per group + cat": lambda: torch.cat(
            [F.linear(p, weights[k], biases[k]) for k, p in enumerate(rows.split(sizes))]),
        "torch.baddbmm, 4 blocks": lambda: torch.baddbmm(bias_rows, blocks, w_t),
    }


@torch.no_grad()
def measure(sizes: list[str], rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    """size -> rows M -> case -> median µs per call over ``rounds`` interleaved rounds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for size in sizes:
        for m in ROWS:
            fns = cases(size, m)
            per: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    per[name].append(time_us(fn))
            out.setdefault(size, {})[str(m)] = {k: round(statistics.median(v), 1)
                                                for k, v in per.items()}
            print(size, m, out[size][str(m)], flush=True)
    return out


def markdown(result: dict) -> list[str]:
    """The lines of dmb_kernels.md for the results ``result``."""
    lines = _lib.md_head(
        "dmb_kernels: DMB vs dense, sub-layers and matmul kernels (µs per call; ratio)",
        result["command"], f"Measured: {result['measured']} on {result['machine']}",
        "Rows M: 1 = greedy step at batch 1, 30 = encoding one sentence of 30 tokens, "
        "32 = greedy at batch 32, 128 = beam 4 at batch 32, 960 = encoding 32 × 30 tokens. "
        "Interleaved rounds, median. Kernels: one `d → ffn` projection of rows already "
        "sorted into 4 equal groups (blocks: 4 × ceil(M/4) rows).")
    pairs = [("ffn dmb", "ffn dense"), ("self-attn dmb", "self-attn dense"),
             ("F.grouped_mm, 4 groups", "F.linear, all rows"),
             ("F.linear per group + cat", "F.linear, all rows"),
             ("torch.baddbmm, 4 blocks", "F.linear, all rows")]
    for i, (size, by_m) in enumerate(result["timings_us"].items()):
        dims = MODEL_SIZES[size]
        lines += [*([""] if i else []), f"## {size} (d={dims['d_model']}, ffn={dims['ffn_dim']})",
                  ""]
        lines += _lib.md_table(
            ["M", *(f"{a} ÷ {b}" for a, b in pairs)], "r" * (len(pairs) + 1),
            ([m, *(f"{t[a]} / {t[b]} = **{t[a] / t[b]:.2f}×**" for a, b in pairs)]
             for m, t in by_m.items()))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small", "base"],
                    choices=sorted(MODEL_SIZES))
    ap.add_argument("--rounds", type=int, default=5)
    _lib.add_results_arg(ap)
    args = ap.parse_args()
    timings = measure(args.sizes, args.rounds)
    result = {"benchmark": "dmb_kernels", "command": _lib.command(),
              "measured": time.strftime("%Y-%m-%d %H:%M"),
              "machine": _lib.machine(cpus=os.cpu_count()), "timings_us": timings}
    _lib.write_results(args.results, "dmb_kernels", result, markdown(result))


if __name__ == "__main__":
    main()
