"""MicroNet score (NeurIPS 2019 MicroNet Challenge, language-modeling track; MicroNet §2.1).

    score = parameter storage / 159M + math operations per token / 318M

(159M parameters and 318M operations: the Rae et al. (2018) LSTM baseline of the challenge,
both in 32-bit units.)

**Parameter storage** (:func:`parameter_storage`), in 32-bit parameters: a b-bit value
counts b/32. A tensor with pruned (exactly zero) entries may be stored sparse: its non-zeros
at b/32 each plus a 1-bit-per-element bitmask (the challenge's reference counter,
google-research ``micronet_challenge/counting.py``, ``get_sparse_size``: n·b·(1 − s) + n
bits). We take, per tensor, the cheaper of dense and sparse (a submitter would not store a
barely sparse tensor sparse). Bit widths come from :func:`dynaseq.compress.qat.qat_bit_widths`
(quantized Linear weights) and default to 32; QAT ``weight_scale`` buffers count as 32-bit
parameters. Weights still under a ``torch.nn.utils.prune`` mask are counted as their
effective weight (read through the parametrization).

**Math operations** (:class:`MicroNetOpCounter`): a ``TorchDispatchMode`` that sees every
aten op a forward pass runs and counts multiplies and additions separately, with the
rules below (per call; "n" = elements of the output unless stated). Conversions to and from
reduced precision (``fake_quantize_*`` and their observers, run inside
:func:`dynaseq.compress.qat.quantization_conversion`) are free, as are views, copies, indexing, embedding
look-ups and comparisons (listed in ``OpCount.ignored``).

========================================  =============================  ==================
op                                        multiplies                     adds
========================================  =============================  ==================
mm (M,K)·(K,N); bmm with batch B          B·M·K·N                        B·M·(K−1)·N
addmm / baddbmm (bias)                    as mm                          as mm + B·M·N
mv (M,K)·(K); dot (K)                     M·K ; K                        M·(K−1) ; K−1
... with a known sparse weight operand    M·nnz(W)                       M·Σ_j max(nnz_j − 1, 0)
add, sub, rsub (+ alpha≠1: +n mults)      —                              n
mul, div, reciprocal, square, sqrt,       n                              —
rsqrt, exp, log, erf (1 "op" each)
relu                                      n (reference counter: 1 mult)  —
sigmoid = exp(x)/(1+exp(x))               2n                             n
silu = x·sigmoid(x)                       3n                             n
tanh = (e^{2x}−1)/(e^{2x}+1)              3n                             2n
gelu = ½x(1+erf(x/√2))                    4n                             n
softmax over rows of length L (R rows)    2·R·L (exp, divide)            R·(L−1)
log_softmax                               R·(L+1) (exp, log)             R·(2L−1)
layer_norm, D features, R rows            R·(2D+3) (+R·D with weight)    R·(3D−1) (+R·D bias)
sum / mean over groups of L (G outputs)   — / +G                         G·(L−1)
logsumexp over groups of L                G·(L+1) (exp, log)             G·(L−1)
cumsum along L (R rows)                   —                              R·(L−1)
index_add / scatter_add / index_put(acc)  —                              elements added
softplus = log(1+eˣ); expm1; log1p        2n; n; n                       n; —; —
sdpa (fused kernel; 4-D q, k, v)          scores + B·H·L·S (scale)     2 matmuls (+mask)
  q (B,H,L,E), k (B,H,S,E), v (B,H,S,Ev)  + softmax + probs·v           + softmax + probs·v
========================================  =============================  ==================

(For 3-D inputs PyTorch runs sdpa's math decomposition instead, whose ops are counted one
by one: it scales q and k by √scale separately, so the count differs slightly.)

Per the challenge, multiplications by pruned zeros may be skipped: with ``sparse=True`` a
matmul operand that *is* one of the model's parameters (matched by storage pointer, also
through ``.t()`` views) is counted by its non-zeros, column by column of the (K, N) operand
(the adds of an output j are nnz_j − 1). Activation zeros (after a ReLU) are never skipped.
Quantized matmuls count their multiplies at b/32 (b from :func:`qat_bit_widths`: the wider
of weight and input width, so a Linear fed by an unquantized LayerNorm output multiplies at
32 bits); all additions count as 32-bit (MicroNet §4.3: "we assume that all addition
operations take place as 32-bit operations"), as do all non-matmul ops.

Feed tokens one at a time (incremental decoding with the model's cache) inside the counter
and divide by the number of tokens::

    counter = MicroNetOpCounter(model)
    with counter:
        state = None
        for t in range(T):
            out = model(tokens[:, t : t + 1], state=state); state = out.state
            model.softmax.log_prob(out.hidden[:, -1])      # the prediction is part of the cost
    ops = counter.counts.per_token(T)                       # 32-bit-equivalent ops / token
    score = micronet_score(parameter_storage(model).total, ops)
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import TorchDispatchMode

from dynaseq.core.errors import DynaseqError
from dynaseq.nn.versions import version_of

__all__ = [
    "BASELINE_OPS", "BASELINE_PARAMS", "MicroNetOpCounter", "MicroNetScore", "OpCount",
    "StorageReport", "count_ops", "micronet_score", "parameter_storage",
]

BASELINE_PARAMS = 159e6  # 32-bit parameters of the challenge's LM baseline (Rae et al. 2018)
BASELINE_OPS = 318e6  # 32-bit math operations per token of that baseline

aten = torch.ops.aten


def _in_conversion() -> bool:
    from dynaseq.compress.qat import in_quantization_conversion

    return in_quantization_conversion()


def _bit_widths(model: nn.Module) -> dict[str, tuple[int, int]]:
    from dynaseq.compress.qat import qat_bit_widths

    return qat_bit_widths(model)


def _named_effective_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every distinct parameter (tied ones once) as the model uses it:
    a parametrized weight (pruning mask, QAT) is read through its parametrization."""
    out = []
    for name, p in model.named_parameters():  # de-duplicated: tied parameters once
        prefix, sep, rest = name.rpartition(".parametrizations.")
        if sep and rest.endswith(".original"):
            attr = rest[: -len(".original")]
            mod = model.get_submodule(prefix) if prefix else model
            out.append((f"{prefix}.{attr}" if prefix else attr, getattr(mod, attr).detach()))
        elif name.startswith("parametrizations.") and name.endswith(".original"):
            attr = name[len("parametrizations."): -len(".original")]
            out.append((attr, getattr(model, attr).detach()))
        else:
            out.append((name, p))
    return out


# --------------------------------------------------------------------------- storage

@dataclass
class StorageReport:
    """Parameter storage in 32-bit units, per tensor and in total."""

    per_tensor: dict[str, float] = field(default_factory=dict)
    dense_total: float = 0.0  # same tensors stored dense at their widths (no sparsity)
    n_params: int = 0  # plain element count
    n_nonzero: int = 0

    @property
    def total(self) -> float:
        return sum(self.per_tensor.values())


def tensor_storage(numel: int, nnz: int, bits: int, sparse: bool = True) -> float:
    """32-bit-equivalent storage of one tensor: dense n·b/32, or sparse nnz·b/32 + n/32."""
    dense = numel * bits / 32
    if not sparse or nnz == numel:
        return dense
    return min(dense, (nnz * bits + numel) / 32)


@torch.no_grad()
def parameter_storage(model: nn.Module, bits: Mapping[str, int] | int | None = None, *,
                      sparse: bool = True) -> StorageReport:
    """MicroNet parameter storage of ``model`` (see the module docstring).

    Args:
        bits: per-parameter bit widths ``{qualified name: b}`` (missing names: 32), one width
            for every parameter, or None to take them from QAT (:func:`qat_bit_widths`).
        sparse: allow the sparse (non-zeros + bitmask) representation.
    """
    if bits is None:
        width = {n: b for n, (b, _) in _bit_widths(model).items()}
    elif isinstance(bits, int):
        width = None
    else:
        width = dict(bits)
    rep = StorageReport()
    for name, p in _named_effective_params(model):
        b = bits if isinstance(bits, int) else width.get(name, 32)
        n, nnz = p.numel(), int(torch.count_nonzero(p))
        rep.per_tensor[name] = tensor_storage(n, nnz, b, sparse)
        rep.dense_total += n * b / 32
        rep.n_params += n
        rep.n_nonzero += nnz
    for mod_name, mod in model.named_modules():  # QAT scales are needed for inference
        s = getattr(mod, "weight_scale", None)
        if isinstance(s, torch.Tensor) and "weight_scale" in mod._buffers:
            name = f"{mod_name}.weight_scale" if mod_name else "weight_scale"
            rep.per_tensor[name] = float(s.numel())
            rep.dense_total += s.numel()
    return rep


# --------------------------------------------------------------------------- ops

@dataclass
class OpCount:
    """Raw multiply/add counts and their 32-bit-equivalent totals."""

    mults: float = 0.0  # raw multiplies
    adds: float = 0.0  # raw additions
    mults32: float = 0.0  # multiplies weighted by bits/32
    adds32: float = 0.0  # additions (always 32-bit)
    by_op: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0.0]))
    ignored: set[str] = field(default_factory=set)

    @property
    def total(self) -> float:
        """32-bit-equivalent math operations (the challenge's count)."""
        return self.mults32 + self.adds32

    def per_token(self, n_tokens: int) -> float:
        if n_tokens < 1:
            raise DynaseqError(f"need at least one token, got {n_tokens}")
        return self.total / n_tokens

    def add(self, op: str, mults: float, adds: float, mult_bits: int = 32) -> None:
        self.mults += mults
        self.adds += adds
        self.mults32 += mults * mult_bits / 32
        self.adds32 += adds
        rec = self.by_op[op]
        rec[0] += mults
        rec[1] += adds


def _numel(shape) -> int:
    return math.prod(shape)


class MicroNetOpCounter(TorchDispatchMode):
    """Count MicroNet math operations of everything run inside ``with counter:``.

    Args:
        model: the model whose parameters are recognised as (possibly sparse, possibly
            quantized) weights in matmuls; None counts everything dense at 32 bits.
        sparse: skip multiplications (and their additions) by zero weights.
        mult_bits: ``{weight param name: multiply width}``; default from QAT.

    The model should be plain for counting: finalize pruning and convert QAT first —
    parametrized weights (a live pruning mask, un-converted QAT) are recomputed on every
    access (those ops would be counted and the weights not recognised), so they raise.
    """

    def __init__(self, model: nn.Module | None = None, *, sparse: bool = True,
                 mult_bits: Mapping[str, int] | None = None) -> None:
        super().__init__()
        self.counts = OpCount()
        self.sparse = sparse
        self._weights: dict[tuple[int, int], tuple[str, int]] = {}
        self._nnz_cache: dict[tuple, torch.Tensor] = {}
        if model is not None:
            for name, mod in model.named_modules():
                if parametrize.is_parametrized(mod):
                    raise DynaseqError(
                        f"module {name!r} still has a pruning mask or un-converted QAT; call "
                        "GradualPruner.finalize() / convert_qat_() before counting operations")
            widths = ({n: m for n, (_, m) in _bit_widths(model).items()} if mult_bits is None
                      else dict(mult_bits))
            for name, p in model.named_parameters():
                key = (p.untyped_storage().data_ptr(), p.storage_offset())
                self._weights[key] = (name, widths.get(name, 32))

    def reset(self) -> None:
        self.counts = OpCount()

    def _weight_info(self, t: torch.Tensor) -> tuple[str, int] | None:
        if not self._weights or not isinstance(t, torch.Tensor):
            return None
        try:
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
        except (RuntimeError, NotImplementedError):
            return None
        return self._weights.get(key)

    # -- matmuls
    def _nnz(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Non-zeros of a weight operand along ``dim`` (cached while the weight is unchanged)."""
        version = version_of(t)
        if version is None:  # an inference tensor: a change is not seen, so nothing is kept
            return (t != 0).sum(dim=dim)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), version, dim)
        hit = self._nnz_cache.get(key)
        if hit is None:
            if len(self._nnz_cache) > 4096:
                self._nnz_cache.clear()
            hit = self._nnz_cache[key] = (t != 0).sum(dim=dim)
        return hit

    def _sparse_ops(self, w: torch.Tensor, dim: int, size: int, outputs: int) -> tuple[int, int]:
        """(mults, adds) of a matmul with the sparse weight ``w`` summed along ``dim``: each
        of the ``outputs`` dot products costs nnz mults and nnz - 1 adds, its nonzeros read
        from ``w``'s (batch', size) counts (repeated over the batch rows they serve)."""
        nnz = self._nnz(w, dim).reshape(-1, size)
        reps = outputs // nnz.shape[0]
        return reps * int(nnz.sum()), reps * int((nnz - 1).clamp_min(0).sum())

    def _mm(self, name: str, a: torch.Tensor, b: torch.Tensor, batch: int, bias: bool) -> None:
        """a (…, M, K) @ b (…, K, N)."""
        m_, k_ = a.shape[-2], a.shape[-1]
        n_ = b.shape[-1]
        bits = 32
        mults, adds = batch * m_ * k_ * n_, batch * m_ * (k_ - 1) * n_
        wa, wb = self._weight_info(a), self._weight_info(b)
        if wb is not None:
            bits = wb[1]
            if self.sparse:  # nonzeros per output column j: (batch', N)
                mults, adds = self._sparse_ops(b, b.dim() - 2, n_, batch * m_)
        elif wa is not None:
            bits = wa[1]
            if self.sparse:  # nonzeros per output row i: (batch', M)
                mults, adds = self._sparse_ops(a, a.dim() - 1, m_, batch * n_)
        if bias:
            adds += batch * m_ * n_
        self.counts.add(name, mults, adds, bits)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, has_mask: bool) -> None:
        *lead, l_, e_ = q.shape
        s_, ev = k.shape[-2], v.shape[-1]
        bh = _numel(lead)
        mults = bh * l_ * s_ * e_ + bh * l_ * s_  # q·kᵀ and the 1/√E scale
        adds = bh * l_ * s_ * (e_ - 1)
        if has_mask:
            adds += bh * l_ * s_
        mults += 2 * bh * l_ * s_  # softmax: exp + divide
        adds += bh * l_ * (s_ - 1)
        mults += bh * l_ * s_ * ev  # probs · v
        adds += bh * l_ * (s_ - 1) * ev
        self.counts.add("scaled_dot_product_attention", mults, adds)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self:  # a composite op (under inference mode: linear, layer_norm) as its parts,
            out = func.decompose(*args, **kwargs)  # which autograd's dispatch would show
        if out is not NotImplemented:
            return out
        out = func(*args, **kwargs)
        if _in_conversion():  # fake quantize/dequantize and observers: free
            self.counts.ignored.add(f"{func} (quantization conversion)")
            return out
        try:
            self._count(func, args, kwargs, out)
        except Exception as err:  # a counting bug must not break the forward pass silently
            raise DynaseqError(f"MicroNet op counter failed on {func}: {err}") from err
        return out

    def _count(self, func, args, kwargs, out) -> None:  # one table of rules, see above
        name = func.overloadpacket.__name__
        if name.endswith("_") and not name.endswith("__"):
            name = name[:-1]  # in-place variants (add_, mul_, ...) cost the same
        first = out[0] if isinstance(out, (tuple, list)) else out
        n = first.numel() if isinstance(first, torch.Tensor) else 0
        c = self.counts
        if name in ("mm", "bmm"):
            a, b = args[0], args[1]
            self._mm(name, a, b, a.shape[0] if name == "bmm" else 1, bias=False)
        elif name in ("addmm", "baddbmm"):
            a, b = args[1], args[2]
            self._mm(name, a, b, a.shape[0] if name == "baddbmm" else 1, bias=True)
        elif name == "mv":
            self._mm(name, args[0], args[1].unsqueeze(-1), 1, bias=False)
        elif name == "addmv":
            self._mm(name, args[1], args[2].unsqueeze(-1), 1, bias=True)
        elif name == "dot":
            k_ = args[0].numel()
            c.add(name, k_, k_ - 1)
        elif name in _SDPA:
            mask = kwargs.get("attn_mask")
            if mask is None and name == "_scaled_dot_product_efficient_attention":
                mask = args[3] if len(args) > 3 else None
            self._sdpa(args[0], args[1], args[2], mask is not None)
        elif name in ("add", "sub", "rsub"):
            alpha = kwargs.get("alpha", 1)
            c.add(name, n if alpha != 1 else 0, n)
        elif name in _ONE_MULT:
            c.add(name, n, 0)
        elif name == "pow":
            e = args[1] if len(args) > 1 else 2
            whole = isinstance(e, (int, float)) and float(e).is_integer() and e >= 2
            c.add(name, n * (int(e) - 1 if whole else 1), 0)
        elif name in _ACTIVATIONS:
            m, a = _ACTIVATIONS[name]
            c.add(name, m * n, a * n)
        elif name in ("_softmax", "_safe_softmax", "_log_softmax"):
            x, dim = args[0], args[1]
            length = x.shape[dim] if x.dim() else 1
            rows = x.numel() // max(1, length)
            if name != "_log_softmax":
                c.add("softmax", 2 * rows * length, rows * (length - 1))
            else:
                c.add("log_softmax", rows * (length + 1), rows * (2 * length - 1))
        elif name == "native_layer_norm":
            x, shape, w, b = args[0], args[1], args[2], args[3]
            d = _numel(shape)
            rows = x.numel() // max(1, d)
            mults, adds = rows * (2 * d + 3), rows * (3 * d - 1)
            if w is not None:
                mults += rows * d
            if b is not None:
                adds += rows * d
            c.add("layer_norm", mults, adds)
        elif name == "logsumexp":
            groups = max(1, n)
            length = args[0].numel() // groups
            c.add(name, groups * (length + 1), groups * (length - 1))
        elif name in ("index_add", "scatter_add", "index_put"):
            src = args[3] if name == "index_add" else args[-1] if name == "scatter_add" \
                else args[2]
            adds = src.numel() if isinstance(src, torch.Tensor) else 0
            if name == "index_put" and not (len(args) > 3 and args[3]):
                adds = 0  # plain assignment, not accumulate
            c.add(name, 0, adds)
        elif name == "cumsum":
            length = args[0].shape[args[1]] if args[0].dim() else 1
            c.add(name, 0, (n // max(1, length)) * (length - 1))
        elif name in ("sum", "mean"):
            groups = max(1, n)
            length = args[0].numel() // groups
            c.add(name, groups if name == "mean" else 0, groups * max(0, length - 1))
        else:
            c.ignored.add(str(func))


_SDPA = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
_ONE_MULT = {"mul", "div", "reciprocal", "sqrt", "rsqrt", "exp", "log", "erf", "square", "relu",
             "expm1", "log1p"}
_ACTIVATIONS = {"sigmoid": (2, 1), "silu": (3, 1), "tanh": (3, 2), "gelu": (4, 1),
                "softplus": (2, 1)}  # (mults, adds) per element


def count_ops(fn, *args, model: nn.Module | None = None, sparse: bool = True,
              **kwargs) -> tuple[object, OpCount]:
    """Run ``fn(*args, **kwargs)`` under a :class:`MicroNetOpCounter`; returns (result, counts)."""
    counter = MicroNetOpCounter(model, sparse=sparse)
    with torch.no_grad(), counter:
        result = fn(*args, **kwargs)
    return result, counter.counts


# --------------------------------------------------------------------------- score

@dataclass
class MicroNetScore:
    """The challenge score and its two parts."""

    params: float  # 32-bit-equivalent parameter storage
    ops_per_token: float  # 32-bit-equivalent math operations per token
    score: float

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "ops_per_token": self.ops_per_token, "score": self.score}


def micronet_score(params_storage: float, ops_per_token: float, *,
                   params_ref: float = BASELINE_PARAMS, ops_ref: float = BASELINE_OPS
                   ) -> MicroNetScore:
    """score = storage / 159M + ops / 318M (MicroNet §2.1; the paper's best: 1.8M params and
    8.8M ops → 0.0387)."""
    if params_storage < 0 or ops_per_token < 0:
        raise DynaseqError("parameter storage and operations must be non-negative")
    score = params_storage / params_ref + ops_per_token / ops_ref
    return MicroNetScore(params=float(params_storage), ops_per_token=float(ops_per_token),
                         score=float(score))
