"""Int8 linear layers for CPU inference, and the table that says how each module type quantizes.

Kernel (hand-written on ``torch._int_mm``, no ``torch.ao``): weights are int8, symmetric per
output channel (``w ≈ weight_int8 · weight_scale[:, None]``); activations are quantized on
the fly, symmetric per row (per token): ``x ≈ x_int8 · x_scale[:, None]`` with
``x_scale = max|x_row| / 127``. The product runs as one int8 x int8 -> int32 matmul and is
rescaled by ``x_scale ⊗ weight_scale`` in float, plus the float bias. Per-row activation
scales make a row's output independent of the other rows of its batch (batch 1 and batch 32
give the same numbers for the same sentence).

:data:`INT8_HANDLERS` maps a module *type* (exact type, not subclasses) to a function that
returns its int8 replacement, or to :data:`KEEP_FLOAT` for modules whose whole subtree stays
in float (gates and routers: their argmax / threshold decides which computation runs, and
int8 rounding could flip it). Each module type registers itself beside its definition with
:func:`register_int8`; ``dynaseq.compress.int8.quantize_int8`` walks a model and applies the
table, so it never names a technique's classes.

Example::

    lin = nn.Linear(16, 32)
    q = Int8Linear.from_float(lin)
    y = q(torch.randn(2, 5, 16))          # (2, 5, 32), close to lin(x)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

#: Handler value: keep this module and everything inside it in float.
KEEP_FLOAT = "keep-float"

Int8Handler = Callable[[nn.Module], nn.Module]

#: module type -> handler (returns the int8 module) or :data:`KEEP_FLOAT`
INT8_HANDLERS: dict[type[nn.Module], Int8Handler | str] = {}


def register_int8(module_type: type[nn.Module], handler: Int8Handler | str) -> None:
    """Say how modules of exactly ``module_type`` quantize: ``handler(module)`` returns the
    int8 replacement, or ``handler`` is :data:`KEEP_FLOAT`.

    Raises:
        TypeError: ``module_type`` is not an ``nn.Module`` subclass, or ``handler`` is neither
            callable nor :data:`KEEP_FLOAT`.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_int8 takes an nn.Module type, got {module_type!r}")
    if handler != KEEP_FLOAT and not callable(handler):
        raise TypeError(f"handler for {module_type.__name__} must be callable or KEEP_FLOAT")
    INT8_HANDLERS[module_type] = handler


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: ``(R, C)`` float -> ``(R, C)`` int8 and ``(R,)`` float32 scales.

    ``weight ≈ q · scale[:, None]``, ``scale = max|row| / 127`` (an all-zero row gets scale 1
    and zeros), values in ``[-127, 127]``.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_rows takes a 2-D float tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def int8_linear(x: Tensor, weight_int8: Tensor, weight_scale: Tensor,
                bias: Tensor | None) -> Tensor:
    """``x Wᵀ + b`` with ``W = weight_int8 · weight_scale[:, None]`` and ``x`` quantized per row.

    x: ``(M, in)`` float32; weight_int8: ``(out, in)`` int8; weight_scale: ``(out,)``;
    bias: ``(out,)`` or None -> ``(M, out)`` float32.
    """
    # (M, 1) per-row max |x|; an all-zero row gets a tiny one and quantizes to zeros
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
    xq = (x * (127 / amax)).round_().to(torch.int8)          # (M, in), |xq| <= 127
    acc = torch._int_mm(xq, weight_int8.t())                 # (M, out) int32, exact
    out = torch.mul(acc, weight_scale)                       # (M, out) float32
    # x_scale = amax / 127: out · x_scale + bias in one pass
    if bias is None:
        return out.mul_(amax).div_(127)
    return torch.addcmul(bias, out, amax, value=1 / 127)


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights (per output channel) and int8 per-token activations.

    Buffers: ``weight_int8`` ``(out, in)`` int8, ``weight_scale`` ``(out,)`` float32,
    ``bias`` ``(out,)`` float32 or None. ``forward``: ``(..., in)`` float32 ->
    ``(..., out)`` float32. Inference only (no gradient flows through the int8 matmul).
    Build it with :meth:`from_float`, or hand in tensors shared with another module (an
    output layer tied to an int8 embedding).
    """

    def __init__(self, weight_int8: Tensor, weight_scale: Tensor,
                 bias: Tensor | None = None) -> None:
        super().__init__()
        if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
            raise ValueError(f"weight_int8 must be an (out, in) int8 tensor, got "
                             f"{tuple(weight_int8.shape)} {weight_int8.dtype}")
        if weight_scale.shape != weight_int8.shape[:1]:
            raise ValueError(f"weight_scale must have shape {tuple(weight_int8.shape[:1])}, "
                             f"got {tuple(weight_scale.shape)}")
        if bias is not None and bias.shape != weight_int8.shape[:1]:
            raise ValueError(f"bias must have shape {tuple(weight_int8.shape[:1])}, got "
                             f"{tuple(bias.shape)}")
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, mod: nn.Module) -> Int8Linear:
        """Quantize an ``nn.Linear`` (its weight per output channel; the bias stays float)."""
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(mod).__name__}")
        q, scale = quantize_rows(mod.weight)
        bias = None if mod.bias is None else mod.bias.detach().float().clone()
        return cls(q, scale, bias)

    @property
    def in_features(self) -> int:
        return self.weight_int8.size(1)

    @property
    def out_features(self) -> int:
        return self.weight_int8.size(0)

    def dequantized_weight(self) -> Tensor:
        """The float ``(out, in)`` weight these int8 values stand for."""
        return self.weight_int8.float() * self.weight_scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if x.size(-1) != self.in_features:
            raise ValueError(f"x has width {x.size(-1)}, expected {self.in_features}")
        flat = x.reshape(-1, self.in_features)
        out = int8_linear(flat, self.weight_int8, self.weight_scale, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def macs(self, n_tokens: int) -> int:
        """Multiply-adds of ``n_tokens`` rows (as for the float layer)."""
        return n_tokens * self.in_features * self.out_features

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype=int8")


register_int8(nn.Linear, Int8Linear.from_float)
