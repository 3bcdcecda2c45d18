"""Benchmark `encoder_speed`: dynaseq's dense encoder classifier against Hugging Face
`transformers`' `BertForSequenceClassification` of the same dimensions (built from a
`BertConfig`, no download), eager, no grad, same threads; batch 1 and 32 at 32 and 128
tokens. Issue 24's target: >= 1.0x its throughput. dynaseq runs twice: the model's own
forward pass ("general") and the lean pass classification runs
(:class:`dynaseq.models.lean_encoder.LeanEncoder`); the three take turns in each round
(interleaved), and the medians compare.

The two are not the same function (BERT: post-LN, GELU, token-type embeddings; dynaseq:
pre-LN, ReLU FFN), but the same shapes: embeddings V x d, 4 layers of d=256 with 4 heads and
FFN 1024, a pooler and a 2-way classifier. Both attend with padding masks absent (full-length
inputs).

    python benchmarks/encoder_speed.py [--layers 4] [--rounds 20]

Needs the benchmark-only extra (`pip install transformers`). Writes
benchmarks/results/encoder_speed.{json,md}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import time

import torch

import _lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=20)
    _lib.add_results_arg(p)
    args = p.parse_args()
    from transformers import BertConfig, BertForSequenceClassification

    from dynaseq.models.lean_encoder import LeanEncoder
    from dynaseq.tasks.encoder.config import EncoderModelConfig
    from dynaseq.tasks.encoder.model import build_encoder_model

    torch.manual_seed(0)
    ours = build_encoder_model(EncoderModelConfig(size="small", layers=args.layers,
                                                  max_positions=128), args.vocab, 2).eval()
    lean = LeanEncoder.prepare(ours)
    hf_cfg = BertConfig(vocab_size=args.vocab, hidden_size=256, num_hidden_layers=args.layers,
                        num_attention_heads=4, intermediate_size=1024,
                        max_position_embeddings=128, num_labels=2)
    theirs = BertForSequenceClassification(hf_cfg).eval()
    rows = []
    with torch.no_grad():
        for s in (32, 128):
            for b in (1, 32):
                x = torch.randint(7, args.vocab, (b, s))
                seg = torch.zeros_like(x)
                mask = torch.ones_like(x)
                sec = _lib.interleaved_seconds({
                    "general": lambda x=x, seg=seg: ours(x, seg),
                    "lean": lambda x=x, seg=seg: lean(x, seg),
                    "hf": lambda x=x, seg=seg, mask=mask: theirs(
                        input_ids=x, token_type_ids=seg, attention_mask=mask)}, args.rounds)
                ms = {k: 1000 * v for k, v in sec.items()}
                rows.append({"tokens": s, "batch": b, "lean_ms": round(ms["lean"], 3),
                             "general_ms": round(ms["general"], 3),
                             "hf_ms": round(ms["hf"], 3),
                             "lean_sent_per_s": round(b / ms["lean"] * 1000, 1),
                             "hf_sent_per_s": round(b / ms["hf"] * 1000, 1),
                             "throughput_ratio": round(ms["hf"] / ms["lean"], 3),
                             "general_throughput_ratio": round(ms["hf"] / ms["general"], 3)})
    import transformers

    out = {"benchmark": "encoder_speed", "command": _lib.command(),
           "date": time.strftime("%Y-%m-%d"),
           "machine": _lib.machine(processor=True, transformers=transformers.__version__),
           "params": {"dynaseq": sum(p.numel() for p in ours.parameters()),
                      "hf": sum(p.numel() for p in theirs.parameters())},
           "rows": rows}
    lines = _lib.md_head("Encoder speed: dynaseq vs transformers BertForSequenceClassification",
                         out["command"], f"Machine: {out['machine']}. Date {out['date']}.",
                         f"Params: {out['params']}. Eager, no grad; the three take turns "
                         f"in each of {args.rounds} rounds after a warm-up, medians. "
                         "dynaseq lean: the pass classification runs; general: the "
                         "model's forward. Target: ratio >= 1.0.")
    lines += _lib.md_table(["tokens", "batch", "dynaseq lean ms", "dynaseq general ms",
                            "HF ms", "lean sent/s", "HF sent/s", "ratio (HF / lean)",
                            "ratio (HF / general)"], "rrrrrrrrr",
                           [list(r.values()) for r in rows])
    _lib.write_results(args.results, "encoder_speed", out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
