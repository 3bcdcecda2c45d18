"""Attention-head pruning by importance (Michel, Levy & Neubig 2019, "Are Sixteen Heads Really
Better than One?"), a model -> model transform.

A mask ξ_h (all ones) multiplies each head's output before the output projection,

    MHA(x) = Σ_h ξ_h · Att_h(x) W_O^h,

and the importance of head h is I_h = E_x |∂L(x)/∂ξ_h| (their eq. 2), accumulated here as
the absolute gradient of each batch's summed loss, as the authors' code does; by default the
scores are normalised per layer by their l2 norm (their sec. 4.1, after Molchanov et al.
2017). :func:`select_heads` keeps the globally most important heads up to a fraction (a layer
may lose all of them), and :func:`prune_heads` removes the others *physically*: the q/k/v
rows and the out_proj columns of a dropped head are sliced away, so the smaller matmuls
really run (:class:`~dynaseq.nn.attention.MultiHeadAttention` with fewer heads of the same
width; no head left: the sub-layer's output is out_proj's bias, which is what ξ = 0 gives).

Attention sub-layers are found by a module walk (every distinct
:class:`~dynaseq.nn.attention.MultiHeadAttention`, in model order; a layer shared by several
depths counts once and its ξ is shared by them). Their projections must be ``nn.Linear``
(dense attention; gated or branched projections are refused).

Example::

    imp = head_importance(model, batches, lambda m, b: loss_of(m(b.tokens), b.targets))
    keep = select_heads(imp, 0.5)                   # [[0, 3], [1], ...] kept per layer
    small = prune_heads(model, keep)                # a new model; ``model`` is unchanged
    with masking_heads(model, head_mask(model, keep)):
        same = model(tokens)                        # = small(tokens), up to rounding
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import torch
from torch import Tensor, nn

from dynaseq.core.errors import DynaseqError
from dynaseq.nn.attention import MultiHeadAttention
from dynaseq.nn.modes import evaluating

__all__ = ["attention_layers", "check_keep", "head_importance", "head_mask", "masking_heads",
           "prune_heads", "select_heads"]

T = TypeVar("T")


def check_keep(keep: float) -> float:
    """The fraction of heads to keep as a float in (0, 1]; DynaseqError (one line) otherwise."""
    try:
        value = float(keep)
    except (TypeError, ValueError):
        raise DynaseqError(f"--keep is the fraction of heads to keep, in (0, 1], got {keep!r}"
                           ) from None
    if not 0 < value <= 1:
        raise DynaseqError(f"--keep is the fraction of heads to keep, in (0, 1], got {keep}")
    return value


def attention_layers(model: nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """The distinct multi-head attention sub-layers of ``model``, in model order, by name.

    Raises:
        DynaseqError: none, or one whose projections are not ``nn.Linear``.
    """
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise DynaseqError("the model has no multi-head attention sub-layer to prune")
    for name, m in found:
        for proj in (m.q_proj, m.k_proj, m.v_proj, m.out_proj):
            if type(proj) is not nn.Linear:
                raise DynaseqError(f"{name}: head pruning needs dense attention (nn.Linear "
                                   f"projections), got {type(proj).__name__}")
    return found


def _mask_hook(attn: MultiHeadAttention, mask: Tensor):
    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]  # (..., H · d_head): the heads' outputs, concatenated
        heads = x.unflatten(-1, (attn.n_heads, attn.d_head))  # (..., H, hd)
        return ((heads * mask.to(x.dtype)[:, None]).flatten(-2), *args[1:])
    return hook


@contextlib.contextmanager
def masking_heads(model: nn.Module, masks: Sequence[Tensor]) -> Iterator[None]:
    """Within the block, each head's output is multiplied by its ξ before the output
    projection: ``masks[i]`` (H_i,) for the i-th of :func:`attention_layers` (a forward
    pre-hook on its out_proj, removed when the block ends)."""
    layers = attention_layers(model)
    if len(masks) != len(layers) or any(
            m.shape != (a.n_heads,) for m, (_, a) in zip(masks, layers, strict=False)):
        raise ValueError("one mask per attention layer, of its heads, is needed: "
                         f"{[a.n_heads for _, a in layers]} heads")
    handles = [a.out_proj.register_forward_pre_hook(_mask_hook(a, m))
               for m, (_, a) in zip(masks, layers, strict=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def head_mask(model: nn.Module, keep: Sequence[Sequence[int]]) -> list[Tensor]:
    """ξ with ones at the kept heads (``keep[i]``: head indices of layer i) and zeros
    elsewhere."""
    layers = attention_layers(model)
    if len(keep) != len(layers):
        raise ValueError(f"{len(keep)} lists of heads for {len(layers)} attention layers")
    masks = []
    for kept, (_, a) in zip(keep, layers, strict=True):
        m = torch.zeros(a.n_heads, device=a.out_proj.weight.device)
        m[list(kept)] = 1.0
        masks.append(m)
    return masks


def head_importance(model: nn.Module, batches: Iterable[T],
                    loss: Callable[[nn.Module, T], Tensor],
                    normalize: bool = True) -> list[Tensor]:
    """I_h = Σ_batches |∂L_batch/∂ξ_h| for every head: one (H_i,) tensor per attention layer
    (:func:`attention_layers`), normalised per layer by its l2 norm when ``normalize``.

    ``loss(model, batch)``: the batch's summed loss (a scalar). The model runs in eval mode
    (no dropout) and its parameters get no gradient."""
    layers = attention_layers(model)
    device = layers[0][1].out_proj.weight.device
    masks = [torch.ones(a.n_heads, device=device, requires_grad=True) for _, a in layers]
    total = [torch.zeros(a.n_heads, device=device) for _, a in layers]
    n = 0
    with evaluating(model), masking_heads(model, masks):
        for batch in batches:
            value = loss(model, batch)
            with_heads = [m for m in masks if m.numel()]
            grads = iter(torch.autograd.grad(value, with_heads, allow_unused=True))
            for i, m in enumerate(masks):
                if m.numel():
                    g = next(grads)
                    if g is not None:
                        total[i] += g.abs()
            n += 1
    if not n:
        raise DynaseqError("no batch to measure head importance on")
    if normalize:
        total = [t / t.norm().clamp_min(1e-20) if t.numel() else t for t in total]
    return [t.cpu() for t in total]


def select_heads(importance: Sequence[Tensor], keep: float) -> list[list[int]]:
    """The heads to keep, per layer (increasing indices): the ``round(keep · total)`` most
    important over all layers (at least one; ties: the earlier layer and head)."""
    keep = check_keep(keep)
    entries = [(float(v), i, h) for i, imp in enumerate(importance)
               for h, v in enumerate(imp.tolist())]
    n_keep = min(len(entries), max(1, round(keep * len(entries))))
    chosen = sorted(entries, key=lambda e: (-e[0], e[1], e[2]))[:n_keep]
    kept: list[list[int]] = [[] for _ in importance]
    for _, i, h in chosen:
        kept[i].append(h)
    return [sorted(k) for k in kept]


def _slice_linear(lin: nn.Linear, index: Tensor, dim: int) -> nn.Linear:
    """A copy of ``lin`` keeping its output rows (dim 0) or input columns (dim 1) ``index``."""
    w = lin.weight.detach().index_select(dim, index)
    with warnings.catch_warnings():  # no head left: torch warns on a zero-element weight
        warnings.simplefilter("ignore")
        out = nn.Linear(w.size(1), w.size(0), bias=lin.bias is not None, device=w.device,
                        dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if lin.bias is not None:
            out.bias.copy_(lin.bias.detach() if dim == 1 else lin.bias.detach()[index])
    out.train(lin.training)
    return out


def prune_heads(model: nn.Module, keep: Sequence[Sequence[int]]) -> nn.Module:
    """A copy of ``model`` whose i-th attention layer (:func:`attention_layers`) has only the
    heads ``keep[i]`` (in increasing order): the q/k/v rows and out_proj columns of the others
    are removed. A layer that keeps every head is copied unchanged (bit-identical)."""
    pruned = copy.deepcopy(model)
    layers = attention_layers(pruned)
    if len(keep) != len(layers):
        raise ValueError(f"{len(keep)} lists of heads for {len(layers)} attention layers")
    for kept, (name, a) in zip(keep, layers, strict=True):
        heads = sorted(set(int(h) for h in kept))
        if heads != sorted(int(h) for h in kept) or any(not 0 <= h < a.n_heads for h in heads):
            raise ValueError(f"{name}: heads to keep must be distinct, in [0, {a.n_heads}), "
                             f"got {list(kept)}")
        if len(heads) == a.n_heads:
            continue
        device = a.out_proj.weight.device
        index = (torch.tensor(heads, dtype=torch.long, device=device)[:, None] * a.d_head
                 + torch.arange(a.d_head, device=device)).flatten()  # (H' · hd,)
        a.q_proj = _slice_linear(a.q_proj, index, 0)
        a.k_proj = _slice_linear(a.k_proj, index, 0)
        a.v_proj = _slice_linear(a.v_proj, index, 0)
        a.out_proj = _slice_linear(a.out_proj, index, 1)
        a.n_heads = len(heads)
    return pruned
