"""The language model from its config: a MicroNet-style
:class:`~dynaseq.models.lm.TransformerLM` with relative-attention layers, adaptive input and
softmax, and the optional neural cache and Hebbian softmax.

Example::

    model = build_lm(LMModelConfig(d_model=128, n_layers=2, context=32), vocab_size=33278)
"""

from __future__ import annotations

from dynaseq.models.lm import LMLayer, TransformerLM
from dynaseq.nn.adaptive_io import AdaptiveInput, AdaptiveSoftmax
from dynaseq.nn.feedforward import FeedForward
from dynaseq.nn.hebbian import make_adaptive_hebbian
from dynaseq.nn.neural_cache import NeuralCache
from dynaseq.nn.relative_attention import relative_attention
from dynaseq.tasks.lm.config import LMModelConfig


def build_lm(cfg: LMModelConfig, vocab_size: int) -> TransformerLM:
    """Wire a :class:`TransformerLM` from an ``LMModelConfig`` for ``vocab_size`` words.

    Raises ConfigError when an adaptive cutoff is not below ``vocab_size``. ``cfg.cache``
    adds a :class:`NeuralCache`, ``cfg.hebbian`` Hebbian-softmax counts (``cfg.qat_bits``
    is applied by the loader, :meth:`dynaseq.tasks.lm.predictor.LanguageModel.load`).
    """
    softmax = AdaptiveSoftmax(cfg.d_model, vocab_size, cfg.cutoffs, cfg.adaptive_dims)
    if cfg.tie_embeddings:
        embed = AdaptiveInput.tied_to(softmax, tie_projections=cfg.tie_projections)
    else:
        embed = AdaptiveInput(cfg.d_model, vocab_size, cfg.cutoffs, cfg.adaptive_dims)
    layers = [
        LMLayer(cfg.d_model,
                relative_attention(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.context,
                                   cfg.attention_dropout),
                FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation_dropout),
                cfg.dropout)
        for _ in range(cfg.n_layers)
    ]
    cache = None
    if cfg.cache is not None:
        cache = NeuralCache(cfg.cache.n_cache, cfg.cache.theta, cfg.cache.lam)
        cache.requires_grad_(cfg.cache.train)
    hebbian = None
    if cfg.hebbian is not None:
        hebbian = make_adaptive_hebbian(softmax, cfg.hebbian.gamma, cfg.hebbian.max_count,
                                        match_norm=cfg.hebbian.match_norm)
    return TransformerLM(embed, layers, softmax, cfg.context, cfg.dropout, cache, hebbian)
