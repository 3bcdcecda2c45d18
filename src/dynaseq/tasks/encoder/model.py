"""The encoder model from its config: an :class:`~dynaseq.models.encoder.EncoderModel` whose
sub-layers are dense or a technique's (:data:`TECHNIQUE_SUBLAYERS`: the CCT's gated ones),
with the MLM head (pre-training) or a classification head (fine-tuning).

Example::

    model = build_encoder_model(EncoderModelConfig(size="tiny", layers=2), 8000, head=MLM)
    model = build_encoder_model(cfg, 8000, head=2)     # a 2-way classifier
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from dynaseq.core.errors import ConfigError
from dynaseq.models.encoder import (
    ClassificationHead,
    EncoderEmbeddings,
    EncoderModel,
    MLMHead,
    TransformerEncoder,
)
from dynaseq.models.multi_exit import MultiExitEncoderModel
from dynaseq.nn import EncoderLayer, FeedForward, Sublayers, dense_attention
from dynaseq.nn.layers import TransformerDims
from dynaseq.nn.relative_scores import RelativeScores
from dynaseq.tasks.encoder.config import EncoderModelConfig
from dynaseq.techniques.cct.builder import cct_sublayers
from dynaseq.techniques.depth.predictor import StructurePredictor

#: ``head`` value of :func:`build_encoder_model` for the MLM head.
MLM = "mlm"


def dense_sublayers(cfg: EncoderModelConfig) -> Sublayers:
    """Plain multi-head attention (with ALBERTa's relative scores when
    ``cfg.relative_positions``; ``cfg.layer_heads[i]`` heads in the i-th distinct layer of a
    head-pruned model) and FFN sub-layers."""
    d_head = cfg.d_model // cfg.n_heads
    pruned = iter(cfg.layer_heads) if cfg.layer_heads is not None else None

    def attention() -> nn.Module:
        scores = (RelativeScores(d_head, cfg.relative_positions, cfg.max_positions)
                  if cfg.relative_positions else None)
        if pruned is not None:  # called once per distinct layer, in order
            return dense_attention(cfg.d_model, next(pruned), cfg.attention_dropout, scores,
                                   d_head=d_head)
        return dense_attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, scores)

    return Sublayers(attention,
                     lambda: FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation_dropout))


#: ``EncoderModelConfig`` section -> the technique's sub-layer builder (none set: dense).
TECHNIQUE_SUBLAYERS: dict[str, Callable[[Any, TransformerDims], Sublayers]] = {
    "cct": cct_sublayers,
}


def build_encoder_model(cfg: EncoderModelConfig, vocab_size: int, head: str | int = MLM,
                        pad_id: int = 0) -> EncoderModel:
    """Wire an encoder from ``cfg`` with the MLM head (``head="mlm"``) or a classification
    head with ``head`` outputs (1: a regression). Shared layers (``cfg.share_layers``) are
    built once and applied along ``cfg.plan``. ``cfg.exits``: a
    :class:`~dynaseq.models.multi_exit.MultiExitEncoderModel` (a classifier per layer)."""
    chosen = [(make, getattr(cfg, name)) for name, make in TECHNIQUE_SUBLAYERS.items()
              if getattr(cfg, name) is not None]
    parts = chosen[0][0](chosen[0][1], cfg) if chosen else dense_sublayers(cfg)
    d = cfg.d_model
    embeddings = EncoderEmbeddings(vocab_size, cfg.embedding_dim, d, cfg.max_positions,
                                   cfg.n_segments, pad_id, cfg.absolute_positions)
    plan = cfg.plan
    layers = [EncoderLayer(d, parts.attention(), parts.ffn(), cfg.dropout)
              for _ in range(max(plan) + 1)]
    dc = cfg.depth
    predictor = None if dc is None else StructurePredictor(
        d, dc.predictor_hidden, cfg.layers - dc.first_group, dc.first_group, dc.revpc)
    encoder = TransformerEncoder(embeddings, layers, d, plan, cfg.dropout, predictor)
    if head == MLM:
        out: nn.Module = MLMHead(d, embeddings.tokens)
    elif isinstance(head, int) and head >= 1:
        out = ClassificationHead(d, head, cfg.classifier_dropout)
    else:
        raise ValueError(f"head must be 'mlm' or a number of outputs >= 1, got {head!r}")
    if cfg.exits is not None:  # BranchyNet / Shallow-Deep / PABEE: a classifier per layer
        if head == MLM:
            raise ConfigError("model.exits (internal classifiers) is for classification runs")
        model: EncoderModel = MultiExitEncoderModel(
            encoder, out, [ClassificationHead(d, head, cfg.classifier_dropout)
                           for _ in range(len(plan) - 1)], parts.control)
    else:
        model = EncoderModel(encoder, out, parts.control)
    if parts.finish is not None:
        parts.finish(model)  # CCT: gate traces named "encoder.layers.0.ffn", ...
    return model
