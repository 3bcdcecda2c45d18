"""Building blocks: attention with a key/value cache, feed-forward, positions, layers."""

from dynaseq.nn.attention import KVCache, MultiHeadAttention, dense_attention, padding_to_attn_mask
from dynaseq.nn.feedforward import FeedForward
from dynaseq.nn.layers import DecoderLayer, EncoderLayer, Sublayers
from dynaseq.nn.outputs import AuxOutputs
from dynaseq.nn.positional import SinusoidalPositions

__all__ = [
    "AuxOutputs",
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "KVCache",
    "MultiHeadAttention",
    "SinusoidalPositions",
    "Sublayers",
    "dense_attention",
    "padding_to_attn_mask",
]
