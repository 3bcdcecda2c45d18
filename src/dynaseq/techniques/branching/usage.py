"""How evenly a DMB / MoE model spreads tokens over its branches: usage and routing collapse.

DMB adds capacity only if its branches share the tokens. Without the diversity loss (or with
too small a weight) routing can collapse: one branch takes (nearly) every token of a
sub-layer and the model is a Transformer with unused parameters. :func:`branch_usage`
counts, over teacher-forced passes, which branch (DMB) or experts (MoE, each of the k
counted) ran for every non-padding token; :func:`collapsed` names the gating units where
one branch took more than a share of them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from dynaseq.nn.modes import evaluating
from dynaseq.techniques.branching.losses import valid_rows
from dynaseq.techniques.branching.traces import ExpertTrace, RouteTrace, route_traces

COLLAPSE_SHARE = 0.9
"""Default share of one branch above which :func:`collapsed` reports a gating unit."""


def unit_name(trace: RouteTrace | ExpertTrace) -> str:
    """``"decoder.layers.0.cross_attn:attn:memory"``: sub-layer, gate and routed stream."""
    gate = trace.gate if isinstance(trace, RouteTrace) else "moe"
    return f"{trace.layer}:{gate}:{trace.stream}"


def _branch_counts(trace: RouteTrace | ExpertTrace, valid: Tensor | None) -> Tensor:
    """``(N,)`` long: how many valid tokens ran each branch in one record."""
    if isinstance(trace, RouteTrace):
        n, ran = trace.logits.size(-1), trace.branch[..., None]  # (B, T, 1)
    else:
        n, ran = trace.gates.size(-1), trace.experts  # (B, T, k)
    if valid is not None:
        ran = ran[valid]
    return torch.bincount(ran.reshape(-1), minlength=n)


@torch.no_grad()
def branch_usage(model: nn.Module, pairs: Iterable[tuple[Tensor, Tensor]],
                 pad_id: int) -> dict[str, list[float]]:
    """Share of the routed tokens each branch ran, per gating unit (:func:`unit_name`).

    pairs: ``(src (B, S), tgt_in (B, T))`` batches, padded with ``pad_id``, run teacher
    forced in eval mode (hard routing, as at inference). Padding tokens are not counted.
    DMB: one branch per token, shares sum to 1. MoE: k experts per token, each counted, so
    the shares sum to 1 over the k·tokens pairs.
    """
    counts: dict[str, Tensor] = {}
    with evaluating(model):
        for src, tgt_in in pairs:
            out = model(src, tgt_in)
            valid = {"encoder": src.ne(pad_id), "decoder": tgt_in.ne(pad_id),
                     "decoder.memory": src.ne(pad_id)}
            for tr in route_traces(out.aux):
                shape = tr.branch.shape if isinstance(tr, RouteTrace) else tr.experts.shape[:2]
                c = _branch_counts(tr, valid_rows(tr, valid, shape))
                name = unit_name(tr)
                counts[name] = counts[name] + c if name in counts else c
    return {name: (c / c.sum().clamp_min(1)).tolist() for name, c in counts.items()}


def collapsed(usage: dict[str, list[float]], share: float = COLLAPSE_SHARE) -> list[str]:
    """The gating units of ``usage`` where one branch ran more than ``share`` of the tokens."""
    if not 0 < share < 1:
        raise ValueError(f"share must lie in (0, 1), got {share}")
    return [name for name, shares in usage.items() if max(shares) > share]
