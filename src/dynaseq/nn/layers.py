"""Pre-LayerNorm encoder and decoder layers that receive their sub-layers.

Each sub-layer f runs as ``x + dropout(f(LN(x)))`` (the pre-LN "nda" layout the CCT paper
uses). Sub-layers are passed in, so gated (CCT) or branched (DMB) versions swap in: a
sub-layer that skips a token must return exactly 0 there, leaving the residual untouched.

``gate_offset`` (B,): per-row inference offsets of gated sub-layers' gates (a CCT call's
calibrated budget, see :class:`~dynaseq.techniques.cct.gating.BudgetControl`), handed to every
sub-layer of the layer; None (the default, and the only value for other sub-layers) hands
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor, nn

from dynaseq.nn.attention import KVCache
from dynaseq.nn.outputs import AuxOutputs


def attach_sublayers(layer: nn.Module, d_model: int, dropout: float,
                     **sublayers: nn.Module) -> None:
    """Register each sub-layer ``NAME`` after its input LayerNorm ``NAME_norm`` (in the given
    order, which fixes the parameter order), and the residual ``dropout``."""
    for name, sub in sublayers.items():
        setattr(layer, f"{name}_norm", nn.LayerNorm(d_model))
        setattr(layer, name, sub)
    layer.dropout = nn.Dropout(dropout)


class EncoderLayer(nn.Module):
    """x: (B, S, d) -> (B, S, d). ``attn_mask``: (B, 1, 1, S) bool, True = attend."""

    def __init__(self, d_model: int, self_attn: nn.Module, ffn: nn.Module,
                 dropout: float = 0.0) -> None:
        super().__init__()
        attach_sublayers(self, d_model, dropout, self_attn=self_attn, ffn=ffn)

    def forward(self, x: Tensor, attn_mask: Tensor | None, aux: AuxOutputs | None = None,
                gate_offset: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        """``scale`` (B, 1, 1): each row's residual branches are multiplied by it (adaptive
        depth: H~ = H + p·MHA(LN(H)), H' = H~ + p·FFN(LN(H~))); None: unscaled."""
        kw = _per_call(aux, gate_offset)
        h = self.dropout(self.self_attn(self.self_attn_norm(x), attn_mask=attn_mask, **kw))
        x = x + (h if scale is None else scale * h)
        h = self.dropout(self.ffn(self.ffn_norm(x), **kw))
        return x + (h if scale is None else scale * h)


class DecoderLayer(nn.Module):
    """x: (B, T, d), memory: (B, S, d) -> (B, T, d).

    Without caches the self-attention is causal over the whole target (teacher forcing);
    with caches x holds only the new step(s) and keys/values accumulate in ``self_cache``.
    """

    def __init__(self, d_model: int, self_attn: nn.Module, cross_attn: nn.Module, ffn: nn.Module,
                 dropout: float = 0.0) -> None:
        super().__init__()
        attach_sublayers(self, d_model, dropout, self_attn=self_attn, cross_attn=cross_attn,
                         ffn=ffn)

    def forward(self, x: Tensor, memory: Tensor, memory_mask: Tensor | None, *,
                self_cache: KVCache | None = None, cross_cache: KVCache | None = None,
                aux: AuxOutputs | None = None, gate_offset: Tensor | None = None) -> Tensor:
        kw = _per_call(aux, gate_offset)
        h = self.self_attn(self.self_attn_norm(x), is_causal=True, cache=self_cache, **kw)
        x = x + self.dropout(h)
        h = self.cross_attn(self.cross_attn_norm(x), memory, attn_mask=memory_mask,
                            cache=cross_cache, **kw)
        x = x + self.dropout(h)
        return x + self.dropout(self.ffn(self.ffn_norm(x), **kw))


def _per_call(aux: AuxOutputs | None, gate_offset: Tensor | None) -> dict[str, Any]:
    """The per-call keyword arguments of a sub-layer: ``aux`` always, ``gate_offset`` only
    when given (sub-layers without gates do not take one)."""
    return {"aux": aux} if gate_offset is None else {"aux": aux, "gate_offset": gate_offset}



class TransformerDims(Protocol):
    """The dimensions a sub-layer builder reads from a model config (any object with these
    attributes; the translation task's ``ModelConfig`` is one)."""

    d_model: int
    ffn_dim: int
    n_heads: int
    attention_dropout: float
    activation_dropout: float


@dataclass
class Sublayers:
    """What a technique gives a model to compose: factories for each layer's attention and
    feed-forward sub-layers (called once per use, in layer order), an optional control-symbol
    embedding (CCT budgets) and ``finish(model)``, run on the assembled model (e.g. naming
    the sub-layers after their paths for traces and losses)."""

    attention: Callable[[], nn.Module]
    ffn: Callable[[], nn.Module]
    control: nn.Module | None = None
    finish: Callable[[nn.Module], object] | None = None
