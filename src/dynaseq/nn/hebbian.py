"""Hebbian softmax (Rae et al. 2018, "Fast parametric learning with activation memorization").

The output embedding w_i of word i is pulled towards the hidden states that predicted i,
so that rare words get a usable vector after one or two sightings instead of after many
small gradient steps. After each optimizer step, for every word i seen in the batch:

    h̄_i = mean of the hidden states h_t with target_t = i          (n_i of them)
    c_i ← c_i + n_i                                                (running count)
    λ_i = max(1 / c_i, γ)          if c_i (before this batch) < T, else 0 (plain SGD)
    w_i ← (1 - λ_i) · w_i^{sgd} + λ_i · h̄_i

Rows of words not in the batch keep their SGD update. With λ_i = 1/c_i the row is the
running mean of all activations seen so far (the first sighting writes h̄_i outright);
the floor γ keeps a minimum pull; after the smoothing limit T the word is frequent
enough for gradient descent alone. MicroNet (appendix A.1) uses γ = 0.01, T = 500.

Note on orientation: λ_i multiplies the *activation*, as in Rae et al. and in MicroNet's
released code (``lam = clamp(1/c, min=γ) * (c < T)``; ``w ← (1-λ)·w + λ·h̄``). Writing it
the other way round (λ_i on the SGD weight) would leave a first sighting unchanged and then
overwrite the row with ~99% of the latest activation forever, the opposite of the method.

MicroNet also rescales each hidden state to the norm of its target row before averaging
(``match_norm=True`` here); Rae et al. do not (default False).

Adaptive softmax: every cluster has its own output embedding and its own input space, so
the update runs per cluster (:func:`adaptive_hebbian_update_`): head words use the rows
``head.weight[:shortlist]`` and the hidden states themselves (the cluster logits of the head
are not word vectors and are left alone); tail i uses ``tails[i][-1].weight`` (the output
embedding) and the tail-projected states ``tails[i][:-1](h)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dynaseq.core.errors import DynaseqError


class HebbianSoftmax(nn.Module):
    """Per-word counts and the Hebbian update of an output embedding matrix.

    Args:
        num_rows: V, the number of rows (words) of the matrix this state belongs to.
        gamma: smoothing floor γ in (0, 1] (MicroNet: 0.01).
        max_count: smoothing limit T >= 1: a word whose count has reached T gets plain SGD
            (MicroNet: 500).
        match_norm: rescale each hidden state to the norm of its target row before
            averaging (MicroNet's code), default False (Rae et al.).
        sync_distributed: under an initialised ``torch.distributed`` group, all-reduce the
            per-word sums and counts so every rank applies the same update (DDP).

    Buffer ``counts`` (V,) int64 — the running c_i, saved with the state dict.

    Example::

        hebb = HebbianSoftmax(V, gamma=0.01, max_count=500)
        loss.backward(); optimizer.step()
        hebb.update_(model.out.weight, hidden.detach().flatten(0, 1), targets.flatten())
    """

    counts: Tensor

    def __init__(self, num_rows: int, gamma: float = 0.01, max_count: int = 500, *,
                 match_norm: bool = False, sync_distributed: bool = True) -> None:
        super().__init__()
        if num_rows < 1:
            raise DynaseqError(f"HebbianSoftmax needs num_rows >= 1, got {num_rows}")
        if not 0.0 < gamma <= 1.0:
            raise DynaseqError(f"Hebbian gamma must lie in (0, 1], got {gamma}")
        if max_count < 1:
            raise DynaseqError(f"Hebbian max_count (T) must be >= 1, got {max_count}")
        self.num_rows, self.gamma, self.max_count = int(num_rows), float(gamma), int(max_count)
        self.match_norm, self.sync_distributed = match_norm, sync_distributed
        self.register_buffer("counts", torch.zeros(self.num_rows, dtype=torch.long))

    def extra_repr(self) -> str:
        return f"num_rows={self.num_rows}, gamma={self.gamma}, max_count={self.max_count}"

    def reset_counts(self) -> None:
        """Forget all counts (every word becomes 'never seen')."""
        self.counts.zero_()

    @torch.no_grad()
    def update_(self, weight: Tensor, hidden: Tensor, targets: Tensor) -> Tensor:
        """Apply the Hebbian update to ``weight`` in place; call right after optimizer.step().

        Args:
            weight: (V, d) output embedding (a Parameter, its ``.data``, or a row slice view
                such as ``head.weight[:shortlist]``) with ``V == num_rows``.
            hidden: (N, d) the hidden states fed to this matrix (detached or not).
            targets: (N,) long row ids in [0, V) (local ids for a slice); entries < 0 are
                ignored (padding).

        Returns:
            (V,) bool mask of the rows that received a Hebbian update.
        """
        if weight.dim() != 2 or weight.size(0) != self.num_rows:
            raise DynaseqError(f"weight must be ({self.num_rows}, d), got {tuple(weight.shape)}")
        if hidden.dim() != 2 or hidden.size(1) != weight.size(1):
            raise DynaseqError(f"hidden must be (N, {weight.size(1)}), got {tuple(hidden.shape)}")
        if targets.shape != hidden.shape[:1] or targets.dtype.is_floating_point:
            raise DynaseqError(f"targets must be integer ids of shape ({hidden.size(0)},), "
                               f"got {tuple(targets.shape)} {targets.dtype}")
        if targets.numel() and int(targets.max()) >= self.num_rows:
            raise DynaseqError(f"targets must be < {self.num_rows}, got {int(targets.max())}")
        keep = targets >= 0
        targets = targets[keep].long().to(weight.device)
        h = hidden.detach()[keep.to(hidden.device)].to(device=weight.device, dtype=torch.float32)
        if self.match_norm and targets.numel():
            row_norm = weight.index_select(0, targets).float().norm(dim=1, keepdim=True)
            h = h * row_norm / h.norm(dim=1, keepdim=True).clamp_min(1e-12)

        sums = torch.zeros(self.num_rows, weight.size(1), dtype=torch.float32,
                           device=weight.device).index_add_(0, targets, h)  # (V, d)
        n = torch.zeros(self.num_rows, dtype=torch.long, device=weight.device)
        n.index_add_(0, targets, torch.ones_like(targets))  # (V,) n_i
        if self.sync_distributed and dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(n)

        counts = self.counts.to(weight.device)
        seen = n > 0
        active = seen & (counts < self.max_count)  # T reached before this batch: SGD only
        new_counts = counts + n
        self.counts.copy_(new_counts)
        rows = active.nonzero().squeeze(1)
        if rows.numel() == 0:
            return active
        lam = (1.0 / new_counts[rows].double()).clamp(min=self.gamma)[:, None]  # (R, 1)
        mean = sums[rows].double() / n[rows, None].double()  # h̄_i, (R, d)
        old = weight.index_select(0, rows).double()
        weight.index_copy_(0, rows, ((1.0 - lam) * old + lam * mean).to(weight.dtype))
        return active


def _tail_parts(tail: nn.Module) -> tuple[nn.Module, Tensor]:
    """(projection d -> d_i, output embedding weight (|cluster|, d_i)) of one tail."""
    if isinstance(tail, nn.Sequential) and len(tail) >= 1:
        out = tail[-1]
        proj = tail[:-1] if len(tail) > 1 else nn.Identity()
    elif isinstance(tail, nn.Linear):
        out, proj = tail, nn.Identity()
    else:
        raise DynaseqError(f"adaptive softmax tail must be nn.Sequential(projection..., "
                           f"nn.Linear) or nn.Linear, got {type(tail).__name__}")
    weight = getattr(out, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise DynaseqError("the last module of an adaptive softmax tail must hold a 2-D weight")
    return proj, weight


def _cluster_bounds(adaptive_softmax: nn.Module) -> tuple[int, list[tuple[int, int]]]:
    cutoffs = list(adaptive_softmax.cutoffs)
    tails = adaptive_softmax.tails
    if not cutoffs:
        raise DynaseqError("adaptive softmax has no cutoffs")
    shortlist = cutoffs[0]
    n_clusters = len(tails)
    if adaptive_softmax.head.weight.size(0) != shortlist + n_clusters:
        raise DynaseqError(
            f"adaptive softmax head has {adaptive_softmax.head.weight.size(0)} rows, expected "
            f"shortlist {shortlist} + {n_clusters} cluster logits")
    bounds = []
    for i, tail in enumerate(tails):
        lo = cutoffs[i]
        size = _tail_parts(tail)[1].size(0)
        if i + 1 < len(cutoffs) and cutoffs[i + 1] != lo + size:
            raise DynaseqError(f"tail {i} has {size} rows but cutoffs say "
                               f"{cutoffs[i + 1] - lo}")
        bounds.append((lo, lo + size))
    return shortlist, bounds


def make_adaptive_hebbian(adaptive_softmax: nn.Module, gamma: float = 0.01,
                          max_count: int = 500, **kwargs) -> nn.ModuleList:
    """One :class:`HebbianSoftmax` per cluster of ``adaptive_softmax``: [head, tail 0, ...].

    The head's state covers the ``shortlist = cutoffs[0]`` word rows only; extra keyword
    arguments (``match_norm``, ``sync_distributed``) go to every state.
    """
    shortlist, bounds = _cluster_bounds(adaptive_softmax)
    states = [HebbianSoftmax(shortlist, gamma, max_count, **kwargs)]
    states += [HebbianSoftmax(hi - lo, gamma, max_count, **kwargs) for lo, hi in bounds]
    return nn.ModuleList(states)


@torch.no_grad()
def adaptive_hebbian_update_(adaptive_softmax: nn.Module, hidden: Tensor, targets: Tensor,
                             states: Sequence[HebbianSoftmax]) -> None:
    """Hebbian update of an adaptive softmax, cluster by cluster; call after optimizer.step().

    Uses only ``adaptive_softmax.head`` (Linear d -> shortlist + n_clusters, word rows
    first), ``.tails`` (tail i: ``nn.Sequential(projection..., Linear(d_i, |cluster i|))``)
    and ``.cutoffs`` (``[c_1, ..., c_k]``, with or without V at the end).

    - head words (id < c_1): rows ``head.weight[:c_1]`` move towards the hidden states;
    - tail i words (c_{i+1} <= id < c_{i+1} + |cluster i|): rows of the tail's output
      embedding move towards ``tails[i][:-1](h)``, the projected states (computed with the
      current, post-step projection).

    Args:
        adaptive_softmax: the module (e.g. :class:`dynaseq.nn.adaptive_io.AdaptiveSoftmax`).
        hidden: (N, d) hidden states fed to the softmax (e.g. ``out.hidden.flatten(0, 1)``).
        targets: (N,) global word ids; < 0 ignored.
        states: from :func:`make_adaptive_hebbian` (one per cluster, head first).
    """
    shortlist, bounds = _cluster_bounds(adaptive_softmax)
    if len(states) != 1 + len(bounds):
        raise DynaseqError(f"need {1 + len(bounds)} Hebbian states (head + tails), "
                           f"got {len(states)}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise DynaseqError(f"hidden must be (N, d) and targets (N,), got "
                           f"{tuple(hidden.shape)} and {tuple(targets.shape)}")
    hidden = hidden.detach()
    head_w = adaptive_softmax.head.weight
    in_head = (targets >= 0) & (targets < shortlist)
    states[0].update_(head_w[:shortlist], hidden[in_head], targets[in_head])
    for i, (tail, (lo, hi)) in enumerate(zip(adaptive_softmax.tails, bounds, strict=True)):
        proj, out_w = _tail_parts(tail)
        # no early exit on empty clusters: under DDP every rank must join the all-reduce
        rows = ((targets >= lo) & (targets < hi)).nonzero().squeeze(1)
        projected = proj(hidden.index_select(0, rows).to(out_w.dtype))
        states[i + 1].update_(out_w, projected, targets.index_select(0, rows) - lo)
