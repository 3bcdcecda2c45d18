"""``dynaseq profile`` for encoder runs (``mlm``, ``classify``): parameters, MACs per token
(analytic, and measured by ``FlopCounterMode``), classification latency at batch 1 and
throughput at batch 32 (through the lean encoder pass, as classification runs, where the
model has one: :mod:`dynaseq.models.lean_encoder`).

Analytic MACs of one S-token input (every gate on for a CCT; what ran is measured):

* embeddings: look-ups 0; ALBERT's factorized embedding adds its projection E·d per token;
* each layer application (shared layers count once per application; a model pruned to a
  fixed depth, ``layers``, only the kept ones): attention q/k/v/out 4·S·d², scores and
  values 2·S²·d (a head-pruned layer with H' heads of width d_h: d·H'·d_h and S²·H'·d_h
  instead), FFN 2·S·d·d_ff (CCT: plus its control nets);
* head: classification pooler d² + classifier d·n_out per sequence; MLM d·E + E·V per token;
* adaptive depth: the structure predictor's MLP per sequence, every layer counted (what ran
  at an exit is measured); multi-exit models: every internal classifier too (per sequence);
  relative positions: (T + S)·(2R+1)·d_head per head and layer.

Per token = the input's total / S. LayerNorm, softmax, GELU/tanh and biases are not counted
(nor does the counter count them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dynaseq.core.distributed import precision_of
from dynaseq.metrics.latency import median_ms
from dynaseq.metrics.macs import _counter
from dynaseq.metrics.profile import count_params
from dynaseq.models.lean_encoder import LeanEncoder
from dynaseq.nn.modes import evaluating


def encoder_macs(model: nn.Module, n_tokens: int,
                 layers: Sequence[int] | None = None) -> dict[str, int]:
    """Analytic MACs of one ``n_tokens`` input through ``model`` (an EncoderModel), by part
    (summed over layers; ``layers``: only those plan positions, a model pruned to a fixed
    depth)."""
    if n_tokens < 1:
        raise ValueError("n_tokens must be >= 1")
    s = n_tokens
    enc = model.encoder
    out: dict[str, int] = dict(enc.embeddings.macs(s))
    plan = enc.plan if layers is None else [enc.plan[j] for j in layers]
    for i in plan:
        layer = enc.layers[i]
        for prefix, counts in (("self_attn", layer.self_attn.macs(s, s)),
                               ("ffn", layer.ffn.macs(s))):
            for k, v in counts.items():
                out[f"{prefix}.{k}"] = out.get(f"{prefix}.{k}", 0) + v
    if enc.predictor is not None:  # adaptive depth: the structure predictor, per sequence
        out["predictor"] = enc.predictor.macs()
    out.update({f"head.{k}": v for k, v in model.head.macs(s).items()})
    for head in getattr(model, "exit_heads", ()):  # multi-exit: every internal classifier
        for k, v in head.macs(s).items():
            out[f"exit_heads.{k}"] = out.get(f"exit_heads.{k}", 0) + v
    return out


@torch.inference_mode()
def flop_counter_encoder_macs(model: nn.Module, tokens: torch.Tensor,
                              control: Any = None, exit: Any = None,
                              layers: Sequence[int] | None = None) -> float:
    """MACs FlopCounterMode measures for one eval forward pass of ``tokens`` (1, S)
    (a CCT: what ran at ``control``; adaptive depth: at ``exit``)."""
    with evaluating(model), _counter() as fc:
        model(tokens, torch.zeros_like(tokens), control, exit=exit, layers=layers)
    return fc.get_total_flops() / 2


@torch.inference_mode()
def encoder_latency_ms(model: nn.Module, n_tokens: int, batch: int, repeats: int = 5,
                       control: Any = None, seed: int = 0, exit: Any = None,
                       layers: Sequence[int] | None = None, lean: bool = True) -> float:
    """Median wall time (ms) of one eval forward pass over ``batch`` random inputs of
    ``n_tokens`` tokens each (after one warm-up): the lean encoder pass where the model has
    one and ``lean`` is on (with an ``exit`` or ``layers``, the model's pass through its lean
    layers, as classification runs them); else the model's forward."""
    device = next(model.parameters()).device
    vocab = model.encoder.embeddings.vocab_size
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(7, vocab, (batch, n_tokens), generator=gen).to(device)
    segments = torch.zeros_like(tokens)
    fast = LeanEncoder.prepare(model) if lean else None
    if fast is not None and exit is None and layers is None:
        return median_ms(model, lambda: fast(tokens, segments, control), repeats)
    run = model if fast is None else fast.output
    return median_ms(model, lambda: run(tokens, segments, control, exit=exit, layers=layers),
                     repeats)


def profile_encoder(model: nn.Module, lengths: tuple[int, ...] = (32, 128),
                    batches: tuple[int, int] = (1, 32), repeats: int = 5,
                    control: Any = None, latency: bool = True,
                    exit: Any = None, layers: Sequence[int] | None = None) -> dict[str, Any]:
    """Params; per input length: analytic MACs per token (all gates on, every layer, or the
    plan positions ``layers`` of a model pruned to a fixed depth), the flop counter's (what
    ran at ``control``, ``exit`` and ``layers``), batch-1 latency (ms) and batch-32 throughput
    (sentences/s). Random inputs: an adaptive-depth model's exits are those its predictor
    chooses for them."""
    device = next(model.parameters()).device
    vocab = model.encoder.embeddings.vocab_size
    result: dict[str, Any] = {"params": count_params(model), "device": str(device),
                              "precision": precision_of(model),
                              "threads": torch.get_num_threads(), "lengths": {}}
    gen = torch.Generator().manual_seed(0)
    for s in lengths:
        tokens = torch.randint(7, vocab, (1, s), generator=gen).to(device)
        analytic = encoder_macs(model, s, layers)
        row: dict[str, Any] = {
            "macs_per_token": sum(analytic.values()) / s,
            "macs_per_token_flop_counter": flop_counter_encoder_macs(model, tokens, control,
                                                                     exit, layers) / s,
            "macs_breakdown_per_token": {k: v / s for k, v in analytic.items()},
        }
        if latency:
            b1, bn = batches
            row[f"latency_ms_b{b1}"] = encoder_latency_ms(model, s, b1, repeats, control,
                                                          exit=exit, layers=layers)
            ms = encoder_latency_ms(model, s, bn, repeats, control, exit=exit, layers=layers)
            row[f"latency_ms_b{bn}"] = ms
            row[f"sentences_per_s_b{bn}"] = bn / (ms / 1000.0)
        result["lengths"][str(s)] = row
    return result
