"""dynaseq's dense Transformer against ``torch.nn.Transformer`` of the same dimensions.

Both models get the same embeddings, output layer, data and optimizer; only the encoder-
decoder stack differs. Timings are interleaved (A, B, A, B, ...) in one process and reported
as the ratio of medians, so machine noise hits both sides alike.

* training step: forward + backward + Adam on real Multi30k token-budget batches;
* scoring: teacher-forced forward under ``no_grad`` (nn.Transformer takes its fused
  inference fast path here);
* greedy decoding of a batch to 30 tokens: dynaseq decodes incrementally over cached
  keys/values; nn.Transformer has no cache, so its decoder reruns the prefix each step.

    python benchmarks/speed_vs_torch.py [--size small] [--layers 3] [--repeats 7]

Writes benchmarks/results/speed_vs_torch.{json,md}. Run from the repository root.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from dynaseq.core.config import from_dict
from dynaseq.data import Tokenizer, collate, make_corpus, read_parallel, token_batches
from dynaseq.models import TokenEmbedding
from dynaseq.models.search import greedy_search
from dynaseq.nn import SinusoidalPositions
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq

import _lib

DATA = _lib.MULTI30K


class TorchTransformer(nn.Module):
    """torch.nn.Transformer (pre-LN, batch_first) with dynaseq's embeddings and output."""

    def __init__(self, cfg: ModelConfig, vocab: int, pad_id: int = 0) -> None:
        super().__init__()
        d = cfg.d_model
        self.embed = TokenEmbedding(vocab, d, pad_id)
        self.positions = SinusoidalPositions(d, cfg.max_positions)
        self.core = nn.Transformer(d, cfg.n_heads, cfg.encoder_layers, cfg.decoder_layers,
                                   cfg.ffn_dim, cfg.dropout, batch_first=True, norm_first=True)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.pad_id = pad_id
        self.drop = nn.Dropout(cfg.dropout)

    def _in(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.embed(x) + self.positions(x.size(1)))

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pad = src.eq(self.pad_id)
        return self.core.encoder(self._in(src), src_key_padding_mask=pad), pad

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, pad: torch.Tensor):
        t = tgt_in.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=memory.dtype)
        h = self.core.decoder(self._in(tgt_in), memory, tgt_mask=mask, tgt_is_causal=True,
                              memory_key_padding_mask=pad)
        return self.out(h)

    def forward(self, src, tgt_in):
        memory, pad = self.encode(src)
        return self.decode(tgt_in, memory, pad)

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, steps: int, bos: int) -> torch.Tensor:
        memory, pad = self.encode(src)
        ys = torch.full((src.size(0), 1), bos, dtype=torch.long)
        for _ in range(steps):
            nxt = self.decode(ys, memory, pad)[:, -1].argmax(-1, keepdim=True)
            ys = torch.cat([ys, nxt], 1)
        return ys[:, 1:]


def logits_of(model, src, tgt_in):
    """The logits of either model (dynaseq's returns an output with ``.logits``)."""
    out = model(src, tgt_in)
    return out.logits if hasattr(out, "logits") else out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=3000)
    p.add_argument("--batches", type=int, default=4, help="training batches per timing")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--decode-batch", type=int, default=32)
    _lib.add_results_arg(p)
    args = p.parse_args()
    torch.manual_seed(0)

    src_lines, tgt_lines = read_parallel(DATA / "train.en.gz", DATA / "train.de.gz")
    tok_path = _lib.RUNS / "speed_spm.model"
    tok = (Tokenizer.load(tok_path) if tok_path.exists() else
           Tokenizer.train(src_lines + tgt_lines, tok_path, args.vocab))
    corpus, _ = make_corpus(tok.encode(src_lines), tok.encode(tgt_lines), 128)
    order = token_batches(corpus.src_lengths(), corpus.tgt_lengths(), args.max_tokens, 1, 0)
    batches = [collate(corpus, idx, 0, 2, 3) for idx in order[: args.batches]]

    cfg = from_dict(ModelConfig, {"size": args.size, "encoder_layers": args.layers,
                                  "decoder_layers": args.layers, "dropout": 0.1})
    models = {"dynaseq": build_seq2seq(cfg, tok.vocab_size),
              "torch.nn.Transformer": TorchTransformer(cfg, tok.vocab_size)}
    params = {k: sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())
              for k, m in models.items()}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-4) for k, m in models.items()}

    def train_fn(name):
        m, opt = models[name], opts[name]

        def run():
            m.train()
            for b in batches:
                logits = logits_of(m, b.src, b.tgt_in)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(),
                                                   ignore_index=0, label_smoothing=0.1)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return run

    def score_fn(name):
        m = models[name]

        def run():
            m.eval()
            with torch.no_grad():
                for b in batches:
                    logits_of(m, b.src, b.tgt_in)
        return run

    dec_src = batches[0].src[: args.decode_batch]

    def decode_fn(name):
        m = models[name]

        def run():
            m.eval()
            if name == "dynaseq":
                greedy_search(m, dec_src, max_len_a=0.0, max_len_b=31, min_len=30)
            else:
                m.greedy(dec_src, 30, 2)
        return run

    results = {}
    n_tok = sum(b.n_tgt_tokens for b in batches)
    for label, maker in (("train_step", train_fn), ("scoring", score_fn),
                         ("greedy_decode_30tok", decode_fn)):
        t = _lib.interleaved_seconds({k: maker(k) for k in models}, args.repeats)
        results[label] = {
            "dynaseq_s": round(t["dynaseq"], 4), "torch_s": round(t["torch.nn.Transformer"], 4),
            "dynaseq_speed_vs_torch": round(t["torch.nn.Transformer"] / t["dynaseq"], 3)}
        print(label, results[label], flush=True)
    out = {
        "benchmark": "speed_vs_torch",
        "command": _lib.command(),
        "machine": _lib.machine(),
        "model": {"size": args.size, "layers": args.layers, "vocab": tok.vocab_size,
                  "params": params},
        "train_batches": {"n": len(batches), "tgt_tokens": n_tok,
                          "max_tokens": args.max_tokens},
        "decode_batch": args.decode_batch, "results": results,
        "target": "dynaseq_speed_vs_torch >= 0.9 for training steps and batched inference",
    }
    _lib.write_results(args.results, "speed_vs_torch", out, markdown(out, args.repeats))
    if not math.isfinite(results["train_step"]["dynaseq_speed_vs_torch"]):
        raise RuntimeError("the training-step speed ratio is not finite")


def markdown(out: dict, repeats: int) -> list[str]:
    """The lines of speed_vs_torch.md for the results ``out``, medians of ``repeats`` runs."""
    lines = _lib.md_head("dynaseq vs torch.nn.Transformer (same dimensions, same run)",
                         out["command"], f"Machine: {out['machine']}", f"Model: {out['model']}")
    lines += _lib.md_table(
        ["measurement", "dynaseq (s)", "nn.Transformer (s)", "dynaseq speed ÷ torch"], "lrrr",
        ([k, r["dynaseq_s"], r["torch_s"], f"{r['dynaseq_speed_vs_torch']}×"]
         for k, r in out["results"].items()))
    return lines + [
        "", f"Target: {out['target']}. Medians of {repeats} interleaved runs.",
        "nn.Transformer has no key/value cache: its greedy decoding reruns the decoder over "
        "the whole prefix at every step, which is how it is used without one."]


if __name__ == "__main__":
    main()
