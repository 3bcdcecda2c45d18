"""The translation model from its config: a :class:`~dynaseq.models.Seq2SeqTransformer`
whose sub-layers are dense, or a technique's (CCT, Transformer-DMB, MoE), chosen by the
``model`` section that is set (:data:`TECHNIQUE_SUBLAYERS`).

Example::

    model = build_seq2seq(ModelConfig(size="tiny", cct=CCTConfig()), vocab_size=8000)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from dynaseq.models.seq2seq import Decoder, Encoder, Seq2SeqTransformer, TokenEmbedding
from dynaseq.nn import (
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    SinusoidalPositions,
    Sublayers,
    dense_attention,
)
from dynaseq.nn.layers import TransformerDims
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.techniques.branching.builder import dmb_sublayers, moe_sublayers
from dynaseq.techniques.cct.builder import cct_sublayers


def dense_sublayers(cfg: TransformerDims) -> Sublayers:
    """Plain multi-head attention and FFN sub-layers."""

    def attention() -> nn.Module:
        return dense_attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)

    def ffn() -> nn.Module:
        return FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation_dropout)

    return Sublayers(attention, ffn)


#: ``ModelConfig`` section -> the technique's sub-layer builder, called with the section and
#: the model's dimensions (none set: dense). Each builder lives beside its technique; this
#: table is the only place that names them.
TECHNIQUE_SUBLAYERS: dict[str, Callable[[Any, TransformerDims], Sublayers]] = {
    "cct": cct_sublayers,
    "dmb": dmb_sublayers,
    "moe": moe_sublayers,
}


def build_seq2seq(cfg: ModelConfig, vocab_size: int, pad_id: int = 0, bos_id: int = 2,
                  eos_id: int = 3) -> Seq2SeqTransformer:
    """Pre-LN Transformer from a config: dense, CCT (``cfg.cct``), Transformer-DMB
    (``cfg.dmb``) or its mixture-of-experts baseline (``cfg.moe``), the sub-layers from the
    technique's builder (:data:`TECHNIQUE_SUBLAYERS`).

    ``share_embeddings`` ties source and target embeddings (one shared vocabulary);
    ``tie_output`` ties the output projection to the target embedding (Press & Wolf 2017).
    """
    chosen = [(make, getattr(cfg, name)) for name, make in TECHNIQUE_SUBLAYERS.items()
              if getattr(cfg, name) is not None]
    assert len(chosen) <= 1, "ModelConfig allows at most one technique"
    parts = chosen[0][0](chosen[0][1], cfg) if chosen else dense_sublayers(cfg)
    model = _assemble(cfg, vocab_size, parts.attention, parts.ffn, parts.control, pad_id,
                      bos_id, eos_id)
    if parts.finish is not None:
        parts.finish(model)
    return model


def _assemble(cfg: ModelConfig, vocab_size: int, attention, ffn,
              control: nn.Embedding | None, pad_id: int, bos_id: int,
              eos_id: int) -> Seq2SeqTransformer:
    """Wire embeddings, positions and layers whose sub-layers come from the factories."""
    d = cfg.d_model

    src_embed = TokenEmbedding(vocab_size, d, pad_id)
    tgt_embed = src_embed if cfg.share_embeddings else TokenEmbedding(vocab_size, d, pad_id)
    output_proj = nn.Linear(d, vocab_size, bias=False)
    if cfg.tie_output:
        output_proj.weight = tgt_embed.weight
    else:
        nn.init.normal_(output_proj.weight, std=d ** -0.5)
    encoder = Encoder(
        src_embed, SinusoidalPositions(d, cfg.max_positions),
        [EncoderLayer(d, attention(), ffn(), cfg.dropout) for _ in range(cfg.encoder_layers)],
        d, cfg.dropout)
    decoder = Decoder(
        tgt_embed, SinusoidalPositions(d, cfg.max_positions),
        [DecoderLayer(d, attention(), attention(), ffn(), cfg.dropout)
         for _ in range(cfg.decoder_layers)],
        d, output_proj, cfg.dropout)
    return Seq2SeqTransformer(encoder, decoder, pad_id, bos_id, eos_id, control)
