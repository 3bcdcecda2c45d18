"""Quantization-aware training with symmetric linear fake quantization (MicroNet §4.3).

What is quantized (b bits, b ∈ 2..16, q_max = 2^(b−1) − 1, zero point 0):

* **weights** of every ``nn.Linear`` that is not an embedding: w_q = clamp(round(w/s), −q_max,
  q_max)·s with s = max|w| / q_max per output channel (row of the (out, in) weight; or one s
  per tensor with ``per_channel=False``). s is rounded *up* to 24 − b significant mantissa
  bits, so that every k·s with |k| ≤ q_max is exact in float32 (the paper makes the last w
  mantissa bits of the inverse scale zero for the same reason: the model stays expressible
  in integer arithmetic). The rounding uses ``torch.fake_quantize_per_channel_affine`` /
  ``torch.fake_quantize_per_tensor_affine``, whose backward is the straight-through estimator
  (gradient passed unchanged inside the clamp range — all of it here, as s covers max|w|).
  It is applied as a ``torch.nn.utils.parametrize`` parametrization (:class:`FakeQuantWeight`)
  so every read of ``module.weight`` — also a direct one, as the tied adaptive input does —
  sees the quantized weight.
* **activations**: the input of each of those Linear layers, through a
  ``torch.ao.quantization.FakeQuantize`` with a ``MovingAverageMinMaxObserver`` (moving
  average of the batch min/max; symmetric, so s = max(|min|, |max|) / q_max). Statistics are
  updated in training mode only (and on the first call, if still uncalibrated). Inputs that
  are the output of a LayerNorm / RMSNorm / GroupNorm / Softmax module are *not* quantized
  (the paper) — found by one probe forward pass when ``example_inputs`` are given to
  :func:`prepare_qat_`, or excluded by ``QATConfig.skip_activation(name, module)``.

What counts as an embedding (never quantized): ``nn.Embedding``/``nn.EmbeddingBag`` tables,
any Linear whose weight is the same Parameter as an embedding table (tied), and any module
whose qualified name contains ``"emb"``. Replace the rule with ``QATConfig.is_embedding``,
e.g. ``lambda name, m: name.startswith("softmax.")`` to also keep the adaptive-softmax output
layers at full precision.

Pruning and QAT together (prune first, then quantize): a live pruning mask
(:class:`dynaseq.compress.prune.WeightMask`, e.g. from a running ``GradualPruner``) is kept
in front of the quantizer; a finalized (baked-in) pruning is protected with
``keep_zeros=True``, which masks the weight's current exact zeros. The forward pass then
uses fq(w_orig · mask): a pruned zero stays exactly 0 (zero point 0) and gets no gradient.

Usage::

    report = prepare_qat_(model, QATConfig(bits=9), example_inputs=(tokens,))
    ...train a few steps as usual...
    convert_qat_(model)                       # weights now exactly k·scale, scales stored
    check_representable(model, bits=9).ok     # True

After :func:`convert_qat_` each quantized Linear has buffers ``weight_scale`` ((out,) or
(1,)) and ``weight_qbits`` (scalar), its ``input_fake_quant`` is frozen, and the weight is a
plain Parameter (no parametrizations). To reload such a state dict, run ``prepare_qat_`` and ``convert_qat_`` on
a fresh model of the same architecture first, then ``load_state_dict``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver
from torch.nn.utils import parametrize

from dynaseq.compress.prune import add_mask, get_mask, remove_parametrization
from dynaseq.core.errors import DynaseqError
from dynaseq.nn.modes import evaluating

__all__ = [
    "FakeQuantWeight", "QATConfig", "QATReport", "RepresentabilityReport", "check_representable", "convert_qat_",
    "default_is_embedding", "fake_quantize_weight", "in_quantization_conversion", "prepare_qat_",
    "qat_bit_widths", "qmax", "quantization_conversion", "weight_scale",
]

_NORM_TYPES: tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm, nn.Softmax, nn.LogSoftmax,
                                 *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


def check_bits(bits: int) -> int:
    """Validate a bit width (an int in 2..16)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
        raise DynaseqError(f"quantization bit width must be an integer in 2..16, got {bits!r}")
    return bits


def qmax(bits: int) -> int:
    """Largest integer level of symmetric b-bit quantization: 2^(b−1) − 1."""
    return 2 ** (check_bits(bits) - 1) - 1


def default_is_embedding(name: str, module: nn.Module) -> bool:
    """Embedding tables and modules named like one (``"emb"`` in the qualified name)."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or "emb" in name.lower()


@dataclass
class QATConfig:
    """Quantization-aware training settings (validated on construction)."""

    bits: int = 9
    per_channel: bool = True  # one scale per output row of each weight (else per tensor)
    quantize_activations: bool = True
    averaging_constant: float = 0.01  # moving-average rate of the activation observers
    keep_zeros: bool = True  # weights that are exactly 0 at prepare time stay 0 (pruned)
    is_embedding: Callable[[str, nn.Module], bool] = default_is_embedding
    skip_activation: Callable[[str, nn.Module], bool] | None = None

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if not 0.0 < self.averaging_constant <= 1.0:
            raise DynaseqError(
                f"averaging_constant must be in (0, 1], got {self.averaging_constant}")


@dataclass
class QATReport:
    """Which modules :func:`prepare_qat_` / :func:`convert_qat_` acted on."""

    bits: int
    weights: list[str] = field(default_factory=list)  # Linear modules with quantized weights
    activations: list[str] = field(default_factory=list)  # ... whose input is quantized too
    skipped_activations: list[str] = field(default_factory=list)  # norm/softmax outputs etc.


@dataclass
class _QATState:
    bits: int
    per_channel: bool
    handle: object = None
    converted: bool = False


# --------------------------------------------------------------------------- conversions

_CONVERSION = threading.local()


@contextmanager
def quantization_conversion() -> Iterator[None]:
    """Marks the ops run inside as precision conversions (fake quantize/dequantize and their
    observers): the MicroNet op counter does not count them (challenge rule: conversions to
    and from reduced precision are free)."""
    depth = getattr(_CONVERSION, "depth", 0)
    _CONVERSION.depth = depth + 1
    try:
        yield
    finally:
        _CONVERSION.depth = depth


def in_quantization_conversion() -> bool:
    """True inside :func:`quantization_conversion` (on this thread)."""
    return getattr(_CONVERSION, "depth", 0) > 0


# --------------------------------------------------------------------------- weights

def weight_scale(w: torch.Tensor, bits: int, per_channel: bool = True) -> torch.Tensor:
    """Symmetric scale s = max|w| / q_max, rounded up to 24 − b significant bits.

    Returns shape (out,) per channel (max over all but dim 0) or (1,) per tensor. All-zero
    rows get s = 1 (every level is then 0).
    """
    q = qmax(bits)
    w = w.detach().float()
    amax = w.abs().flatten(1).amax(dim=1) if per_channel and w.dim() > 1 else w.abs().max().view(1)
    s = amax / q
    s = torch.where(s > 0, s, torch.ones_like(s))
    mant, expo = torch.frexp(s)  # s = mant · 2^expo, mant ∈ [0.5, 1)
    p = 2.0 ** (24 - bits)
    return torch.ldexp(torch.ceil(mant * p) / p, expo)


def fake_quantize_weight(w: torch.Tensor, bits: int, per_channel: bool = True,
                         scale: torch.Tensor | None = None) -> torch.Tensor:
    """clamp(round(w/s), −q_max, q_max)·s with a straight-through gradient to ``w``."""
    q = qmax(bits)
    s = weight_scale(w, bits, per_channel) if scale is None else scale.detach().float()
    zp = torch.zeros(s.shape, dtype=torch.int32, device=w.device)
    if s.numel() > 1 or (per_channel and w.dim() > 1 and s.numel() == w.shape[0]):
        out = torch.fake_quantize_per_channel_affine(w.float(), s, zp, 0, -q, q)
    else:
        out = torch.fake_quantize_per_tensor_affine(w.float(), s.reshape(()), zp.reshape(()),
                                                    -q, q)
    return out.to(w.dtype)


# --------------------------------------------------------------------------- prepare

def _observer_ready(fq: FakeQuantize) -> bool:
    obs = fq.activation_post_process
    return bool(torch.isfinite(obs.min_val).all() and torch.isfinite(obs.max_val).all())


class FakeQuantWeight(nn.Module):
    """Parametrization w ↦ fake_quantize_weight(w, bits, per_channel) (STE gradient)."""

    def __init__(self, bits: int, per_channel: bool = True) -> None:
        super().__init__()
        self.bits, self.per_channel = check_bits(bits), per_channel

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        with quantization_conversion():
            return fake_quantize_weight(w, self.bits, self.per_channel)


def _source(mod: nn.Module) -> torch.Tensor:
    if parametrize.is_parametrized(mod, "weight"):
        return mod.parametrizations.weight.original
    return mod.weight


def _pre_quant_weight(mod: nn.Module) -> torch.Tensor:
    """original → every parametrization except the quantizer (e.g. the pruning mask)."""
    w = mod.parametrizations.weight.original
    for p in mod.parametrizations.weight:
        if not isinstance(p, FakeQuantWeight):
            w = p(w)
    return w


def _qat_pre_hook(mod: nn.Module, args: tuple) -> tuple | None:
    st: _QATState = mod._dynaseq_qat
    fq = getattr(mod, "input_fake_quant", None)
    if fq is None or not args:
        return None
    with quantization_conversion():
        observe = (mod.training and not st.converted) or not _observer_ready(fq)
        fq.observer_enabled.fill_(1 if observe else 0)
        x = args[0]
        xq = fq(x.float()).to(x.dtype) if x.dtype != torch.float32 else fq(x)  # bf16 inputs
        return (xq, *args[1:])


def _make_act_fq(bits: int, averaging_constant: float) -> FakeQuantize:
    q = qmax(bits)
    return FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=-q, quant_max=q,
                        dtype=torch.qint32, qscheme=torch.per_tensor_symmetric,
                        averaging_constant=averaging_constant)


def _norm_fed_linears(model: nn.Module, targets: dict[str, nn.Module],
                      example_inputs: Sequence) -> set[str]:
    """Names of target Linears whose input is (the very tensor) a norm/softmax output."""
    produced: list[torch.Tensor] = []
    hit: set[str] = set()
    hooks = [m.register_forward_hook(lambda _m, _a, out: produced.append(out))
             for m in model.modules() if isinstance(m, _NORM_TYPES)]

    def probe(name: str) -> Callable:
        def hook(_m: nn.Module, args: tuple) -> None:
            if args and any(args[0] is t for t in produced):
                hit.add(name)
        return hook

    hooks += [m.register_forward_pre_hook(probe(n)) for n, m in targets.items()]
    try:
        with evaluating(model), torch.no_grad():
            model(*example_inputs)
    finally:
        for h in hooks:
            h.remove()
    return hit


def prepare_qat_(model: nn.Module, config: QATConfig | int = 9, *,
                 example_inputs: Sequence | None = None) -> QATReport:
    """Insert weight and activation fake quantization into ``model`` in place.

    Args:
        model: any module; every non-embedding ``nn.Linear`` is quantized.
        config: a :class:`QATConfig` or just the bit width.
        example_inputs: positional args for one ``model(*example_inputs)`` probe pass that
            finds Linear layers fed directly by a LayerNorm/Softmax (their inputs stay
            float, as in the paper). Without it, only ``config.skip_activation`` excludes.

    Returns:
        :class:`QATReport`. Train as usual afterwards; then :func:`convert_qat_`.
    """
    cfg = config if isinstance(config, QATConfig) else QATConfig(bits=check_bits(config))
    emb_weights = {id(_source(m)) for m in model.modules()
                   if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    targets: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or cfg.is_embedding(name, mod):
            continue
        if id(_source(mod)) in emb_weights:
            continue
        if getattr(mod, "_dynaseq_qat", None) is not None:
            raise DynaseqError(f"module {name!r} is already prepared for QAT")
        targets[name] = mod
    if not targets:
        raise DynaseqError("no non-embedding nn.Linear layers to quantize in the model")
    skip_norm = (_norm_fed_linears(model, targets, example_inputs)
                 if example_inputs is not None and cfg.quantize_activations else set())
    report = QATReport(bits=cfg.bits)
    for name, mod in targets.items():
        if get_mask(mod, "weight") is None and cfg.keep_zeros:
            w = _source(mod).detach()
            if bool((w == 0).any()):
                add_mask(mod, "weight", (w != 0).to(w.dtype))
        st = _QATState(bits=cfg.bits, per_channel=cfg.per_channel)
        if cfg.quantize_activations:
            if name in skip_norm or (cfg.skip_activation is not None
                                     and cfg.skip_activation(name, mod)):
                report.skipped_activations.append(name)
            else:
                dev = _source(mod).device
                mod.input_fake_quant = _make_act_fq(cfg.bits, cfg.averaging_constant).to(dev)
                report.activations.append(name)
        mod._dynaseq_qat = st
        parametrize.register_parametrization(mod, "weight",
                                             FakeQuantWeight(cfg.bits, cfg.per_channel))
        st.handle = mod.register_forward_pre_hook(_qat_pre_hook)
        report.weights.append(name)
    return report


# --------------------------------------------------------------------------- convert

def _prepared(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules()
            if getattr(m, "_dynaseq_qat", None) is not None}


@torch.no_grad()
def convert_qat_(model: nn.Module) -> QATReport:
    """Write the final quantized-then-dequantized weights back, in place.

    Each prepared Linear gets ``weight = k·scale`` (|k| ≤ q_max, pruned entries 0) as a
    plain Parameter (pruning masks are baked in, parametrizations removed), buffers
    ``weight_scale`` and ``weight_qbits``, and a frozen input fake-quantizer (activations
    stay quantized at inference with the trained scale).
    """
    mods = {n: m for n, m in _prepared(model).items() if not m._dynaseq_qat.converted}
    if not mods:
        raise DynaseqError("no QAT-prepared layers to convert (run prepare_qat_ first)")
    report = QATReport(bits=next(iter(mods.values()))._dynaseq_qat.bits)
    for name, mod in mods.items():
        st: _QATState = mod._dynaseq_qat
        w = _pre_quant_weight(mod)
        s = weight_scale(w, st.bits, st.per_channel)
        wq = fake_quantize_weight(w, st.bits, st.per_channel, scale=s)
        st.handle.remove()
        remove_parametrization(mod, "weight", leave_parametrized=False)
        mod.weight.copy_(wq)
        mod.register_buffer("weight_scale", s)
        mod.register_buffer("weight_qbits", torch.tensor(st.bits, dtype=torch.int32))
        st.converted = True
        fq = getattr(mod, "input_fake_quant", None)
        if fq is not None:
            fq.disable_observer()
            report.activations.append(name)
        st.handle = mod.register_forward_pre_hook(_qat_pre_hook)  # inputs only from now on
        report.weights.append(name)
    return report


# --------------------------------------------------------------------------- check

@dataclass
class RepresentabilityReport:
    """Result of :func:`check_representable`, one entry per quantized Linear."""

    bits: int
    modules: dict[str, dict[str, object]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and bool(self.modules)


@torch.no_grad()
def check_representable(model: nn.Module, bits: int) -> RepresentabilityReport:
    """Verify every converted weight is exactly k·scale with integer |k| ≤ 2^(b−1) − 1.

    Per module: ``max_abs_k``, ``max_distinct_per_scale`` (≤ 2^b − 1 levels used per
    scale), ``inexact`` (entries not equal to k·scale) and ``stored_bits``. Any violation —
    or a module converted at another width — is listed in ``failures``; ``ok`` is False
    also when the model has no converted layers.
    """
    q = qmax(bits)
    rep = RepresentabilityReport(bits=bits)
    for name, mod in model.named_modules():
        scale = getattr(mod, "weight_scale", None)
        if not isinstance(scale, torch.Tensor) or not isinstance(mod, nn.Linear):
            continue
        w = mod.weight.detach().float()
        s = scale.float().view(-1, *([1] * (w.dim() - 1))) if scale.numel() > 1 else scale.float()
        k = torch.round(w / s)
        inexact = int((k * s != w).sum())
        max_k = int(k.abs().max()) if k.numel() else 0
        rows = k.flatten(1) if scale.numel() > 1 else k.reshape(1, -1)
        distinct = max(int(torch.unique(r).numel()) for r in rows) if k.numel() else 0
        stored = int(getattr(mod, "weight_qbits", torch.tensor(bits)))
        rep.modules[name] = {"max_abs_k": max_k, "max_distinct_per_scale": distinct,
                             "inexact": inexact, "stored_bits": stored}
        if inexact:
            rep.failures.append(f"{name}: {inexact} weights are not integer multiples of scale")
        if max_k > q:
            rep.failures.append(f"{name}: |k| up to {max_k} > {q} for {bits} bits")
        if distinct > 2 ** bits:
            rep.failures.append(f"{name}: {distinct} distinct values per scale > 2^{bits}")
        if stored != bits:
            rep.failures.append(f"{name}: converted at {stored} bits, checked at {bits}")
    if not rep.modules:
        rep.failures.append("no quantized (converted) layers found; run convert_qat_ first")
    return rep


def qat_bit_widths(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{weight param name: (weight bits, multiply bits)}`` for quantized Linear layers.

    The multiply width is the wider operand's: b when the layer's input is fake-quantized
    too, 32 otherwise (e.g. a Linear fed by a LayerNorm). Used by
    :mod:`dynaseq.metrics.micronet`; works on prepared, converted and reloaded models.
    """
    out = {}
    for name, mod in model.named_modules():
        st = getattr(mod, "_dynaseq_qat", None)
        if st is not None:
            bits = st.bits
        elif isinstance(getattr(mod, "weight_qbits", None), torch.Tensor):
            bits = int(mod.weight_qbits)
        else:
            continue
        mult = bits if getattr(mod, "input_fake_quant", None) is not None else 32
        out[f"{name}.weight" if name else "weight"] = (bits, mult)
    return out
