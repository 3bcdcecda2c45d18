"""Int8 linear layers for CPU inference, and the table that says how each module type quantizes.

Kernel (no ``torch.ao``, no quantized tensors): weights are int8, symmetric per output channel
(``w ≈ weight_int8 · weight_scale[:, None]``); activations are quantized on the fly,
symmetric per row (per token): ``x ≈ x_int8 · x_scale[:, None]`` with
``x_scale = max|x_row| / 127``. The product runs as one int8 x int8 -> int32 matmul and is
rescaled by ``x_scale ⊗ weight_scale`` in float, plus the float bias. The matmul is
``torch._int_mm`` for one row and small products, and oneDNN's int8 matmul
(``torch.ops.onednn.qlinear_pointwise``) on a copy of the weight prepacked once per layer
for large ones (:func:`pack_int8`; built from the stored tensors, never saved). Both give
the exact int32 sums, followed by the same float operations. Per-row activation scales make a
row's output independent of the other rows of its batch (batch 1 and batch 32 give the same
numbers for the same sentence, whichever matmul each call took).

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

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from dynaseq.nn.versions import version_of

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


class Int8Packed(NamedTuple):
    """What :func:`int8_linear` derives once from a layer's stored tensors (never saved).

    ``scale127``: ``weight_scale / 127`` ``(out,)`` float32 (the per-channel scale with the
    activation scale's 1/127 folded in). ``onednn``: the weight in oneDNN's blocked int8 layout
    (``torch.ops.onednn.qlinear_prepack``, zero-point compensation precomputed) and
    ``zero_points`` ``(out,)`` int32 zeros, or None where oneDNN is not available (GPU tensors,
    a torch built without it). ``weight_t``: the ``(in, out)`` view ``torch._int_mm`` takes.
    """

    scale127: Tensor
    onednn: Tensor | None
    zero_points: Tensor | None
    weight_t: Tensor | None = None  # weight_int8.t(): a view, made once


#: ``rows · in · out`` (multiply-adds of one call) above which oneDNN's int8 matmul on the
#: prepacked weight is used whatever the layer's shape; below it oneDNN's per-call set-up
#: (~20 us: ATen builds the primitive descriptor on every call) dominates.
ONEDNN_MIN_MACS = 1 << 25


def pack_int8(weight_int8: Tensor, weight_scale: Tensor) -> Int8Packed:
    """The :class:`Int8Packed` of an ``(out, in)`` int8 weight and its ``(out,)`` scales."""
    scale127 = (weight_scale.float() / 127).contiguous()
    if weight_int8.device.type != "cpu" or not ONEDNN_AVAILABLE:
        return Int8Packed(scale127, None, None, weight_int8.t())
    try:
        packed = torch.ops.onednn.qlinear_prepack(weight_int8.contiguous(), None)
    except RuntimeError:  # a shape oneDNN does not take: torch._int_mm does
        return Int8Packed(scale127, None, None, weight_int8.t())
    zp = torch.zeros(weight_int8.size(0), dtype=torch.int32)
    return Int8Packed(scale127, packed, zp, weight_int8.t())


def int8_linear(x: Tensor, weight_int8: Tensor, weight_scale: Tensor,
                bias: Tensor | None, packed: Int8Packed | None = None) -> Tensor:
    """``x Wᵀ + b`` with ``W = weight_int8 · weight_scale[:, None]`` and ``x`` quantized per row.

    x: ``(M, in)`` float32; weight_int8: ``(out, in)`` int8; weight_scale: ``(out,)``;
    bias: ``(out,)`` or None; packed: :func:`pack_int8` of the weight (enables the oneDNN
    path; without it only ``torch._int_mm`` is used) -> ``(M, out)`` float32.

    Every path computes the exact int32 sums and then the same float operations, so a row's
    output does not depend on how many rows share its call (nor on the path taken).
    """
    if packed is None:
        packed = Int8Packed(weight_scale.float() / 127, None, None)
    # (M, 1) per-row max |x|; an all-zero row gets a tiny one and quantizes to zeros
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
    xq = torch.mul(x, torch.reciprocal(amax).mul_(127.0)).round_().to(torch.int8)  # |xq| <= 127
    path = _choose_path(xq.size(0), weight_int8.size(1), weight_int8.size(0), packed)
    y = _MATMULS[path](xq, weight_int8, packed)          # (M, out) float32: acc · scale127
    # x_scale = amax / 127, the 1/127 folded into scale127
    if bias is None:
        return y.mul_(amax)
    return torch.addcmul(bias, y, amax)


def _choose_path(rows: int, n_in: int, n_out: int, packed: Int8Packed) -> str:
    """Which int8 matmul is fastest for ``rows`` rows of an ``(n_out, n_in)`` weight (measured
    per layer shape with the weights out of cache, as in a model; one thread, AVX-512 VNNI):
    ``torch._int_mm`` for one row (its matrix-vector kernel beats oneDNN's there) and for
    small products; oneDNN on the prepacked weight (~20 us of set-up per call) from two rows
    on for weights of 1M values or more (output layers, FFN layers at ``base``:
    ``torch._int_mm`` takes 2.5-3.4x the old ``torch.ao`` time at 4 rows there, oneDNN
    1.7-2x) and for any call of more than :data:`ONEDNN_MIN_MACS` multiply-adds."""
    if packed.onednn is None or rows < 2:
        return "int_mm"
    weights = n_in * n_out
    if weights >= 1 << 20 or rows * weights > ONEDNN_MIN_MACS:
        return "onednn"
    return "int_mm"


def _int_mm(xq: Tensor, w: Tensor, packed: Int8Packed) -> Tensor:
    wt = w.t() if packed.weight_t is None else packed.weight_t
    return torch.mul(torch._int_mm(xq, wt), packed.scale127)


def _onednn(xq: Tensor, w: Tensor, packed: Int8Packed) -> Tensor:
    # uint8 with zero point 128 (oneDNN's fast int8 kernels take unsigned activations):
    # flipping the top bit adds 128
    xu = xq.view(torch.uint8).bitwise_xor_(128)
    return torch.ops.onednn.qlinear_pointwise(
        xu, 1.0, 128, packed.onednn, packed.scale127, packed.zero_points, None, 1.0, 0,
        torch.float32, "none", [], "")


_MATMULS = {"int_mm": _int_mm, "onednn": _onednn}


def _probe_onednn() -> bool:
    """Whether this torch has oneDNN's int8 matmul *and* it computes exact int32 sums on this
    CPU (probed once, at import, on a 4 x 64 x 16 product of ±127 values checked against the
    exact sums). Exactness is not a given: on CPUs without VNNI (AVX2 only, e.g. the AMD EPYC
    a session ran on) oneDNN multiplies the unsigned activations by the signed weights with an
    instruction that saturates pairs of products at int16, and its outputs came out off by up
    to 60x the quantization error; ``torch._int_mm`` is exact everywhere and then runs
    every call."""
    gen = torch.Generator().manual_seed(0)
    xq = (torch.randint(0, 2, (4, 64), generator=gen) * 254 - 127).to(torch.int8)
    w = (torch.randint(0, 2, (16, 64), generator=gen) * 254 - 127).to(torch.int8)
    try:
        packed = Int8Packed(torch.ones(16), torch.ops.onednn.qlinear_prepack(w, None),
                            torch.zeros(16, dtype=torch.int32), w.t())
        got = _onednn(xq.clone(), w, packed)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return torch.equal(got, xq.double().matmul(w.double().t()).float())  # sums < 2^24: exact


#: oneDNN's int8 matmul is available and exact here (decided at import; no call changes it).
ONEDNN_AVAILABLE = _probe_onednn()


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
        self.out_features, self.in_features = weight_int8.shape  # fixed, as nn.Linear's
        self._packed: tuple[tuple[int, ...], Int8Packed] | None = None

    def packed(self) -> Int8Packed:
        """The :class:`Int8Packed` of this layer's weight: built on first use and again
        whenever ``weight_int8`` or ``weight_scale`` changed (loaded in place, moved);
        never saved (state dict, pickling and deep copies hold only the stored tensors)."""
        bufs = self._buffers
        return self._packed_for(bufs["weight_int8"], bufs["weight_scale"])

    def _packed_for(self, w: Tensor, s: Tensor) -> Int8Packed:
        key = (w.data_ptr(), version_of(w), s.data_ptr(), version_of(s))
        if None in key:  # inference tensors: a change is not seen, so nothing is kept
            return pack_int8(w, s)
        cached = self._packed
        if cached is None or cached[0] != key:
            cached = self._packed = (key, pack_int8(w, s))
        return cached[1]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_packed"] = None  # oneDNN's blocked tensor has no storage to copy or pickle
        return state

    @classmethod
    def from_float(cls, mod: nn.Module) -> Int8Linear:
        """Quantize an ``nn.Linear`` (its weight per output channel; the bias stays float)."""
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(mod).__name__}")
        q, scale = quantize_rows(mod.weight)
        bias = None if mod.bias is None else mod.bias.detach().float().clone()
        return cls(q, scale, bias)

    @classmethod
    def stacked(cls, mods: Sequence[Int8Linear]) -> Int8Linear:
        """One layer whose outputs are those of ``mods`` (same input width, biases) one after
        another: their int8 rows, scales and biases concatenated (copies). Its product equals
        theirs exactly, as the input is quantized per row whatever the weight."""
        return cls(torch.cat([m.weight_int8 for m in mods]),
                   torch.cat([m.weight_scale for m in mods]), torch.cat([m.bias for m in mods]))

    def dequantized_weight(self) -> Tensor:
        """The float ``(out, in)`` weight these int8 values stand for."""
        return self.weight_int8.float() * self.weight_scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        # buffers read from _buffers directly: this runs once per layer per decoding step
        bufs = self._buffers
        w, s = bufs["weight_int8"], bufs["weight_scale"]
        n_in = w.shape[1]
        if x.shape[-1] != n_in:
            raise ValueError(f"x has width {x.shape[-1]}, expected {n_in}")
        packed = self._packed_for(w, s)
        if x.dim() == 2:
            return int8_linear(x, w, s, bufs["bias"], packed)
        out = int8_linear(x.reshape(-1, n_in), w, s, bufs["bias"], packed)
        return out.view(*x.shape[:-1], w.shape[0])

    def macs(self, n_tokens: int) -> int:
        """Multiply-adds of ``n_tokens`` rows (as for the float layer)."""
        return n_tokens * self.in_features * self.out_features

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype=int8")


register_int8(nn.Linear, Int8Linear.from_float)
