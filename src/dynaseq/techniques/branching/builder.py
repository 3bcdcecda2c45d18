"""Sub-layers of a Transformer-DMB (Tan et al. 2021) and of its top-k MoE baseline: every FFN,
and with ``attention`` every self- and cross-attention, branched; the sub-layers named after
their paths for the routing losses."""

from __future__ import annotations

from torch import nn

from dynaseq.nn import dense_attention
from dynaseq.nn.layers import Sublayers, TransformerDims
from dynaseq.techniques.branching import (
    dmb_attention,
    dmb_feedforward,
    moe_attention,
    moe_feedforward,
    name_branching_sublayers,
)
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig


def _attention_or_dense(cfg: TransformerDims, branched, with_attention: bool):
    if with_attention:
        return branched
    return lambda: dense_attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)


def dmb_sublayers(dmb: DMBConfig, cfg: TransformerDims) -> Sublayers:
    """N-branch FFNs (and attention projections) of a model of dimensions ``cfg``."""
    d = cfg.d_model

    def attention() -> nn.Module:
        return dmb_attention(d, cfg.n_heads, dmb.n_branches, cfg.attention_dropout,
                             shared=dmb.shared_private, fast_paths=dmb.fast_paths)

    def ffn() -> nn.Module:
        return dmb_feedforward(d, cfg.ffn_dim, dmb.n_branches, cfg.activation_dropout,
                               shared=dmb.shared_private, fast_paths=dmb.fast_paths)

    return Sublayers(_attention_or_dense(cfg, attention, dmb.attention), ffn,
                     finish=name_branching_sublayers)


def moe_sublayers(moe: MoEConfig, cfg: TransformerDims) -> Sublayers:
    """Top-k expert FFNs (and attention projections) of a model of dimensions ``cfg``."""
    d = cfg.d_model

    def attention() -> nn.Module:
        return moe_attention(d, cfg.n_heads, moe.n_experts, moe.k, cfg.attention_dropout)

    def ffn() -> nn.Module:
        return moe_feedforward(d, cfg.ffn_dim, moe.n_experts, moe.k, cfg.activation_dropout)

    return Sublayers(_attention_or_dense(cfg, attention, moe.attention), ffn,
                     finish=name_branching_sublayers)
