"""``dynaseq profile``: parameters, MACs per token (analytic and measured), latency."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dynaseq.core.distributed import precision_of
from dynaseq.metrics.latency import decode_latency_ms
from dynaseq.metrics.macs import count_macs, flop_counter_macs, pair_macs


def count_params(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once), int8 weights included."""
    from dynaseq.compress.int8 import int8_param_count  # int8 modules hold no nn.Parameter

    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return n + int8_param_count(model)


def profile_model(model: nn.Module, src_len: int = 30, tgt_len: int = 30, repeats: int = 5,
                  batch: int = 1, latency: bool = True,
                  control: int | None = None) -> dict[str, Any]:
    """The profile of a Seq2SeqTransformer for an S=src_len, T=tgt_len sentence pair.

    ``control``: the control-symbol id (budget) a CCT model runs at; its MACs here are the
    dense maximum (what runs with every gate on). ``macs_pair`` is the DMB paper's Mult-Adds
    (see :func:`~dynaseq.metrics.macs.pair_macs`): the whole src_len -> tgt_len pass, output
    layer included (the paper's figures are for 30 -> 30, the default).
    """
    rep = count_macs(model, src_len, tgt_len)
    vocab = model.decoder.output_proj.out_features
    low = max(model.pad_id, model.bos_id, model.eos_id) + 1
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    src = torch.randint(low, vocab, (1, src_len), generator=gen).to(device)
    tgt = torch.randint(low, vocab, (1, tgt_len), generator=gen).to(device)
    measured = flop_counter_macs(model, src, tgt, control)
    result: dict[str, Any] = {
        "params": count_params(model),
        "src_tokens": src_len,
        "tgt_tokens": tgt_len,
        "macs_per_token": rep.per_token(),
        "macs_per_token_flop_counter": {k: measured[k] for k in ("encoder", "decoder", "total")},
        "macs_breakdown_per_token": rep.breakdown_per_token(),
        "macs_pair": {"src_tokens": src_len, "tgt_tokens": tgt_len,
                      "total": pair_macs(model, src_len, tgt_len)},
        "device": str(device),
        "precision": precision_of(model),
        "threads": torch.get_num_threads(),
    }
    if latency:
        result["latency_ms"] = {
            "greedy": decode_latency_ms(model, src_len, tgt_len, 1, batch, repeats,
                                        control=control),
            "beam4": decode_latency_ms(model, src_len, tgt_len, 4, batch, repeats,
                                       control=control),
            "batch": batch,
        }
    return result
