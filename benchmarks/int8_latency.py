"""Int8 decoding latency: dynaseq's int8 path (``dynaseq.nn.int8``) against fp32 and against
the ``torch.ao`` dynamic quantization it replaced, interleaved in one process.

Untrained dense models of the configs' sizes (weights do not change latency), 30 -> 30
tokens, greedy and beam 4 at batch 1 and 32, one thread, medians. The ``torch.ao`` column is
``torch.ao.quantization.quantize_dynamic`` on every ``nn.Linear`` (per-channel qint8, what
dynaseq used before); it runs here only, as the bar, and its deprecation warnings are shown,
not silenced. Writes ``results/int8_latency.{json,md}``.

A second table times single linear layers of the ``base`` shapes (48 layers of each shape
called in turn, so their weights come from memory as in a model): fp32, ``torch.ao``
(fbgemm's ``quantized::linear_dynamic``), dynaseq's kernels, and torchao's
``Int8DynamicActivationInt8WeightConfig``. It records the warning torch gives when a
quantized tensor is created, the only route to fbgemm's kernel outside ``torch.ao``.

    python benchmarks/int8_latency.py [--sizes tiny,small,base] [--rounds 3] [--repeats 3]
                                      [--layer-rows 1,4,32] [--tag NAME]

``--tag NAME`` writes ``results/int8_latency_NAME.*`` instead (another machine's numbers
beside the committed ones). The dynaseq int8 model decodes through the lean step where it
has one (``dynaseq.models.lean``), as ``translate`` does; so does fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

from dynaseq.compress.int8 import quantize_int8
from dynaseq.metrics.latency import decode_latency_ms
from dynaseq.tasks.registry import load_config
from dynaseq.tasks.translation.model import build_seq2seq

import _lib

SETTINGS = [(1, 1), (1, 32), (4, 1), (4, 32)]  # (beam, batch)


def torch_ao_int8(model: nn.Module) -> nn.Module:
    """The removed path: torch.ao dynamic int8 on every nn.Linear (a quantized copy)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, inplace=False)


def measure(size: str, rounds: int, repeats: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    model = build_seq2seq(load_config("configs/multi30k_tiny.yaml", [f"model.size={size}"]).model,
                          8000).eval()
    variants = {"fp32": model, "torch.ao": torch_ao_int8(model), "dynaseq": quantize_int8(model)}
    times: dict[str, dict[tuple[int, int], list[float]]] = {
        v: {s: [] for s in SETTINGS} for v in variants}
    with warnings.catch_warnings():  # shown once when the models were built; not timed
        warnings.simplefilter("ignore")
        for _ in range(rounds):
            for s in SETTINGS:
                for name, m in variants.items():  # interleaved: the same moment for each
                    times[name][s].append(decode_latency_ms(m, 30, 30, beam=s[0], batch=s[1],
                                                            repeats=repeats))
    rows = {}
    for s in SETTINGS:
        med = {v: statistics.median(times[v][s]) for v in variants}
        rows[f"{'greedy' if s[0] == 1 else 'beam4'}_b{s[1]}"] = {
            **{f"{v}_ms": round(x, 1) for v, x in med.items()},
            "dynaseq/torch.ao": round(med["dynaseq"] / med["torch.ao"], 2),
            "dynaseq/fp32": round(med["dynaseq"] / med["fp32"], 2),
            "torch.ao/fp32": round(med["torch.ao"] / med["fp32"], 2)}
    return rows


#: (out, in) of the linear layers of a ``base`` model: attention projection, FFN in and out,
#: the 8000-word output layer
LAYER_SHAPES = [(512, 512), (2048, 512), (512, 2048), (8000, 512)]
N_LAYERS = 48  # layers of each shape called in turn: weights come from memory, not cache


def quantized_tensor_warning() -> str:
    """The warning torch gives when a quantized tensor is created (what a direct call of
    fbgemm's ``quantized::linear_prepack`` needs)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.quantize_per_channel(torch.randn(4, 4), torch.ones(4, dtype=torch.double),
                                   torch.zeros(4, dtype=torch.long), 0, torch.qint8)
    return " | ".join(str(w.message) for w in caught) or "(none)"


def layer_times(rows_list: list[int], rounds: int) -> list[dict]:
    """Microseconds per call of one linear layer, each kernel over the same ``N_LAYERS``
    weights in turn, interleaved over ``rounds``; medians."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    out = []
    for n_out, n_in in LAYER_SHAPES:
        torch.manual_seed(0)
        floats = [nn.Sequential(nn.Linear(n_in, n_out)) for _ in range(N_LAYERS)]
        kernels = {"fp32": floats, "torch.ao": [torch_ao_int8(m) for m in floats],
                   "dynaseq": [quantize_int8(m) for m in floats]}
        torchao_layers = [nn.Sequential(nn.Linear(n_in, n_out)) for _ in range(N_LAYERS)]
        for m, f in zip(torchao_layers, floats, strict=True):
            m.load_state_dict(f.state_dict())
            quantize_(m, Int8DynamicActivationInt8WeightConfig())
        kernels["torchao"] = torchao_layers
        for rows in rows_list:
            x = torch.randn(rows, n_in)
            times: dict[str, list[float]] = {k: [] for k in kernels}
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.ao's deprecation: shown once, not timed
                for _ in range(rounds):
                    for name, layers in kernels.items():
                        for m in layers:  # warm-up pass
                            m(x)
                        start = time.perf_counter()
                        for m in layers:
                            m(x)
                        times[name].append((time.perf_counter() - start) / N_LAYERS * 1e6)
            med = {k: statistics.median(v) for k, v in times.items()}
            out.append({"shape": f"{n_out}x{n_in}", "rows": rows,
                        **{f"{k}_us": round(v, 1) for k, v in med.items()},
                        "dynaseq/torch.ao": round(med["dynaseq"] / med["torch.ao"], 2)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,small,base")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layer-rows", default="1,4,32",
                   help="rows (tokens x beams) of the single-layer table; empty: skip it")
    p.add_argument("--tag", default="", help="suffix of the result files, e.g. `avx2`")
    _lib.add_results_arg(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    warning = quantized_tensor_warning()  # torch warns once per process: ask first
    results = {"command": _lib.command(), "machine": _lib.machine(processor=True),
               "sizes": {size: measure(size, args.rounds, args.repeats)
                         for size in args.sizes.split(",") if size}}
    rows_list = [int(r) for r in args.layer_rows.split(",") if r]
    results["layers"] = layer_times(rows_list, args.rounds) if rows_list else []
    results["quantized_tensor_warning"] = warning
    lines = _lib.md_head("int8 decoding latency: dynaseq int8 vs torch.ao int8 vs fp32",
                         results["command"], f"Machine: {results['machine']}")
    table = [[size, setting, r["fp32_ms"], r["torch.ao_ms"], r["dynaseq_ms"],
              r["dynaseq/torch.ao"], r["dynaseq/fp32"]]
             for size, rows in results["sizes"].items() for setting, r in rows.items()]
    lines += _lib.md_table(["size", "decode (30->30)", "fp32 ms", "torch.ao ms", "dynaseq ms",
                            "dynaseq ÷ torch.ao", "dynaseq ÷ fp32"], "llrrrrr", table)
    lines += ["", "Untrained dense models, one thread, medians of interleaved rounds."]
    if results["layers"]:
        lines += ["", f"## One linear layer (us per call; {N_LAYERS} layers of a shape in turn)",
                  ""]
        lines += _lib.md_table(
            ["shape (out x in)", "rows", "fp32", "torch.ao", "dynaseq", "torchao",
             "dynaseq ÷ torch.ao"], "lrrrrrr",
            [[r["shape"], r["rows"], r["fp32_us"], r["torch.ao_us"], r["dynaseq_us"],
              r["torchao_us"], r["dynaseq/torch.ao"]] for r in results["layers"]])
        lines += ["", "torch creating a quantized tensor (what calling fbgemm's "
                  f"`quantized::linear_prepack` directly needs) warns: "
                  f"\"{results['quantized_tensor_warning']}\""]
    _lib.write_results(args.results, "int8_latency" + (f"_{args.tag}" if args.tag else ""),
                       results, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
