"""Multiply-adds (MACs) per token, counted analytically from the model's real shapes.

For one sentence pair run teacher-forced (the scoring pass), with S source tokens (eos
included) and T target positions:

* encoder layer: self-attention q/k/v/out projections (S·d² each), score and value products
  (S·S·d each), FFN (2·S·d·d_ff);
* decoder layer: self-attention as above with T (the causal mask does not skip work in a
  dense kernel, so T·T·d is what runs), cross-attention q/out projections (T·d²), k/v
  projections of the S encoder states (S·d²), products T·S·d each, FFN (2·T·d·d_ff);
* embeddings: a table look-up, 0 MACs (listed so the breakdown is complete);
* output layer: T·d·V.

Per-token figures divide the encoder by S and the decoder by T; ``total`` is their sum (the
compute behind one source and one target token). Branched sub-layers (DMB, MoE) add their
gates (``gate_*``), including, in cross-attention, the gate on each encoder state.

:func:`pair_macs` is the DMB paper's "#Mult-Adds" (Tan et al. 2021, Table I): the whole
teacher-forced pass over one 30-token source and 30-token target sentence (not per token),
embedding and output (classification) layers included; :func:`ptr` is its
performance-time ratio ``BLEU / sqrt(#MACs) · 10^4`` (eq. 32). The same counts come from
``torch.utils.flop_counter.FlopCounterMode`` (FLOPs = 2·MACs); :func:`flop_counter_macs`
measures them, adding the CPU fused-attention kernel that the counter does not know.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from dynaseq.core.arguments import check_int
from dynaseq.nn.modes import evaluating

aten = torch.ops.aten


@dataclass
class MacReport:
    """MACs of one teacher-forced pass over a (S source, T target) sentence pair."""

    src_tokens: int
    tgt_tokens: int
    encoder: dict[str, int] = field(default_factory=dict)  # by sub-layer kind
    decoder: dict[str, int] = field(default_factory=dict)
    layers: list[dict[str, object]] = field(default_factory=list)  # per layer, per sub-layer

    @property
    def encoder_total(self) -> int:
        return sum(self.encoder.values())

    @property
    def decoder_total(self) -> int:
        return sum(self.decoder.values())

    def per_token(self) -> dict[str, float]:
        enc = self.encoder_total / self.src_tokens
        dec = self.decoder_total / self.tgt_tokens
        return {"encoder": enc, "decoder": dec, "total": enc + dec}

    def breakdown_per_token(self) -> dict[str, dict[str, float]]:
        return {"encoder": {k: v / self.src_tokens for k, v in self.encoder.items()},
                "decoder": {k: v / self.tgt_tokens for k, v in self.decoder.items()}}


def _add(into: dict[str, int], prefix: str, counts: dict[str, int]) -> None:
    for k, v in counts.items():
        into[f"{prefix}.{k}"] = into.get(f"{prefix}.{k}", 0) + v


def count_macs(model: nn.Module, src_tokens: int, tgt_tokens: int) -> MacReport:
    """Analytic MACs of ``model`` (a Seq2SeqTransformer) for one S/T sentence pair.

    Every sub-layer reports its own count through its ``macs`` method, so adaptive
    sub-layers that swap in are counted by their own rule. The lengths are whole numbers
    >= 1 (a DynaseqError names the bad one).
    """
    s, t = check_int("src_tokens", src_tokens), check_int("tgt_tokens", tgt_tokens)
    rep = MacReport(s, t)
    rep.encoder["embedding"] = 0
    for i, layer in enumerate(model.encoder.layers):
        sa = layer.self_attn.macs(s, s)
        ff = layer.ffn.macs(s)
        _add(rep.encoder, "self_attn", sa)
        _add(rep.encoder, "ffn", ff)
        rep.layers.append({"stack": "encoder", "layer": i, "self_attn": sa, "ffn": ff})
    rep.decoder["embedding"] = 0
    for i, layer in enumerate(model.decoder.layers):
        sa = layer.self_attn.macs(t, t)
        ca = _cross_attention_macs(layer.cross_attn, t, s)
        ff = layer.ffn.macs(t)
        _add(rep.decoder, "self_attn", sa)
        _add(rep.decoder, "cross_attn", ca)
        _add(rep.decoder, "ffn", ff)
        rep.layers.append({"stack": "decoder", "layer": i, "self_attn": sa, "cross_attn": ca,
                           "ffn": ff})
    proj = model.decoder.output_proj
    rep.decoder["output_proj"] = t * proj.in_features * proj.out_features
    return rep


#: The sentence lengths the DMB paper's Mult-Adds are given for (Table I: 229.0M for its
#: tiny Transformer = 30 source and 30 target tokens at d=128, 6+6 layers, 37k vocabulary).
PAIR_TOKENS = 30


def pair_macs(model: nn.Module, src_tokens: int = PAIR_TOKENS,
              tgt_tokens: int = PAIR_TOKENS) -> int:
    """The DMB paper's Mult-Adds: everything :func:`count_macs` counts for one teacher-forced
    pass over a ``src_tokens`` -> ``tgt_tokens`` sentence pair, summed (not per token).

    Counted: every encoder and decoder layer (q/k/v/out projections, both attention
    products over the full S×S, T×T and T×S score matrices, FFN, and the gates of DMB/MoE
    sub-layers), the embeddings (table look-ups: 0 Mult-Adds, as torchprofile counts them)
    and the output layer (``T·d·V``). Not counted: LayerNorm, softmax, residual additions,
    positions, biases. CCT models: every gate on (the dense maximum).
    """
    rep = count_macs(model, src_tokens, tgt_tokens)
    return rep.encoder_total + rep.decoder_total


def ptr(bleu: float, macs: float) -> float:
    """Performance-time ratio ``BLEU / sqrt(#MACs) · 10^4`` (Tan et al. 2021, eq. 32); use
    :func:`pair_macs` for the paper's #MACs."""
    if macs <= 0:
        raise ValueError(f"macs must be > 0, got {macs}")
    return bleu / math.sqrt(macs) * 1e4


def _cross_attention_macs(attn: nn.Module, n_queries: int, n_keys: int) -> dict[str, int]:
    """``attn.macs`` of a cross-attention call; sub-layers that take ``cross`` (DMB and MoE
    attention: their gate also routes each memory token) are told so."""
    if "cross" in inspect.signature(attn.macs).parameters:
        return attn.macs(n_queries, n_keys, cross=True)
    return attn.macs(n_queries, n_keys)


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of the fused CPU attention kernel: the same two products as any SDPA."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _int_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of the int8 matmul ``(M, K) x (K, N)`` of ``dynaseq.nn.int8``: ``2·M·K·N`` as
    for the float ``nn.Linear`` it replaces."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of a grouped matmul ``(M, K) x (G, K, N)`` with group offsets (the DMB/MoE
    inference kernel): each row meets its own group's matrix only, ``2·M·K·N``."""
    assert len(a_shape) == 2 and len(b_shape) == 3, "only the 2-D x 3-D form is used here"
    return 2 * a_shape[0] * a_shape[1] * b_shape[2]


def _counter() -> FlopCounterMode:
    # FlopCounterMode knows the CUDA fused-attention kernels but not the CPU one; without this
    # it reports 0 for attention products that really run. Nor does it know int8 matmuls or
    # grouped matmuls.
    return FlopCounterMode(display=False,
                           custom_mapping={aten._scaled_dot_product_flash_attention_for_cpu:
                                           _cpu_sdpa_flops,
                                           aten._int_mm: _int_mm_flops,
                                           aten._grouped_mm: _grouped_mm_flops})


@torch.no_grad()
def flop_counter_macs(model: nn.Module, src: torch.Tensor, tgt_in: torch.Tensor,
                      control: int | None = None) -> dict[str, float]:
    """MACs measured by FlopCounterMode for one teacher-forced pass, per token.

    src (1, S), tgt_in (1, T) without padding. Returns ``encoder``/``decoder``/``total`` per
    token like :meth:`MacReport.per_token` plus the per-operator counts under ``ops``.
    """
    with evaluating(model):
        with _counter() as fc:
            enc = model.encode(src, control=control)
        enc_macs = fc.get_total_flops() / 2
        enc_ops = _ops(fc)
        with _counter() as fc:
            model.decoder(tgt_in, enc)
        dec_macs = fc.get_total_flops() / 2
        dec_ops = _ops(fc)
    enc_tok = enc_macs / src.numel()
    dec_tok = dec_macs / tgt_in.numel()
    return {"encoder": enc_tok, "decoder": dec_tok, "total": enc_tok + dec_tok,
            "ops": {"encoder": enc_ops, "decoder": dec_ops}}


def _ops(fc: FlopCounterMode) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for op, flops in fc.get_flop_counts().get("Global", {}).items():
        counts[str(op)] += flops // 2
    return dict(counts)
