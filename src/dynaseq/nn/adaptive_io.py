"""Adaptive input embeddings and adaptive softmax (Baevski & Auli 2018; Grave et al. 2017).

The vocabulary is sorted by training frequency (id 0 = most frequent) and cut at
``cutoffs = [c_1, ..., c_k]`` into a head ``[0, c_1)`` and k tail clusters
``[c_i, c_{i+1})`` (``c_{k+1} = V``). Cluster i gets vectors of width ``dims[i]``, shrinking
for rarer words: MicroNet (appendix A.1) uses bins [3500, 25000] of WikiText-103's 267,735
words with widths [256, 64, 4]; :func:`default_dims` gives ``d, d/4, d/64`` (the same
pattern at any width).

Default cutoffs for WikiText-2 (33,278 types, 2.09M training tokens): ``[3500, 20000]``.
There the head covers 83.2% of training tokens (words seen >= 62 times), the first tail
14.3% (seen 6-61 times) and the last tail 2.4% (the 13,278 words seen <= 6 times) — about
the shares the paper's bins give on WikiText-103, so the rare-word widths see comparable
amounts of data per vector.

Adaptive softmax: the head is ``nn.Linear(d, c_1 + k)``: one logit per head word plus one
per tail cluster; tail i is ``nn.Sequential(Linear(d, dims[i+1]), Linear(dims[i+1], |i|))``
(a down projection then the output embedding, no biases). Then
``log p(w) = log p_head(w)`` for head words and ``log p_head(cluster i) + log p_i(w)`` for
a word of tail i. :meth:`AdaptiveSoftmax.forward` runs tail i only on the rows whose target
lies in it. Log-softmaxes are taken in float32, so bf16 / fp16 activations are safe.

Tying (:meth:`AdaptiveInput.tied_to`): the input uses the softmax's output embeddings as its
lookup tables (the head's first c_1 rows for the head, the tail output embeddings for the
tails) and, with ``tie_projections``, the transposes of the tail down-projections as its
up-projections, as in Baevski & Auli's tied adaptive model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.core.errors import ConfigError


def default_dims(d_model: int, n_clusters: int, factor: int = 4) -> list[int]:
    """``[d, d/4, d/64, ...]``-like widths: the head is full width, then ``d / factor^(2i-1)``
    (at least 1), MicroNet's [256, 64, 4] for d = 256 and two tails."""
    dims = [d_model]
    for i in range(1, n_clusters + 1):
        dims.append(max(1, d_model // factor ** (2 * i - 1)))
    return dims


def check_cutoffs(cutoffs: list[int], vocab_size: int, dims: list[int] | None = None,
                  d_model: int | None = None) -> None:
    """Raise ConfigError unless ``0 < c_1 < ... < c_k < vocab_size`` (and dims fit)."""
    pairs = zip(cutoffs, cutoffs[1:], strict=False)
    if any(c <= 0 for c in cutoffs) or any(a >= b for a, b in pairs):
        raise ConfigError(f"adaptive cutoffs must be increasing and > 0, got {cutoffs}")
    if cutoffs and cutoffs[-1] >= vocab_size:
        raise ConfigError(f"adaptive softmax bin {cutoffs[-1]} is not below the vocabulary "
                          f"size {vocab_size}: every cutoff must be < {vocab_size}")
    if dims is not None:
        if len(dims) != len(cutoffs) + 1:
            raise ConfigError(f"adaptive dims need {len(cutoffs) + 1} widths (one per bin), "
                              f"got {dims}")
        if d_model is not None and dims[0] != d_model:
            raise ConfigError(f"adaptive dims[0] must equal d_model={d_model} (the head is "
                              f"full width), got {dims[0]}")
        if any(x <= 0 for x in dims):
            raise ConfigError(f"adaptive dims must be > 0, got {dims}")


class AdaptiveSoftmax(nn.Module):
    """Adaptive softmax over a frequency-sorted vocabulary.

    Args:
        d_model: width d of the hidden states.
        vocab_size: V.
        cutoffs: ``[c_1, ..., c_k]``, increasing, all < V.
        dims: widths per bin, ``dims[0] == d_model`` (default :func:`default_dims`).

    Attributes: ``head`` (``nn.Linear(d, c_1 + k)``), ``tails`` (``nn.ModuleList`` of
    ``nn.Sequential(proj: Linear(d, dims[i+1]), out: Linear(dims[i+1], |cluster i|))``),
    ``cutoffs`` (``[c_1, ..., c_k]``), ``bounds`` (``[0, c_1, ..., c_k, V]``).

    Example::

        sm = AdaptiveSoftmax(256, 33278, [3500, 20000])
        logp = sm(h, target)          # h (N, 256), target (N,) -> (N,)
        full = sm.log_prob(h)         # (N, 33278), rows logsumexp to 0
    """

    def __init__(self, d_model: int, vocab_size: int, cutoffs: list[int],
                 dims: list[int] | None = None) -> None:
        super().__init__()
        cutoffs = list(cutoffs)
        dims = list(dims) if dims is not None else default_dims(d_model, len(cutoffs))
        check_cutoffs(cutoffs, vocab_size, dims, d_model)
        self.d_model, self.vocab_size = d_model, vocab_size
        self.cutoffs, self.dims = cutoffs, dims
        self.bounds = [0, *cutoffs, vocab_size]
        self.shortlist = cutoffs[0] if cutoffs else vocab_size
        self.n_clusters = len(cutoffs)
        self.head = nn.Linear(d_model, self.shortlist + self.n_clusters, bias=False)
        nn.init.normal_(self.head.weight, std=d_model ** -0.5)
        self.tails = nn.ModuleList()
        for i in range(self.n_clusters):
            size = self.bounds[i + 2] - self.bounds[i + 1]
            proj = nn.Linear(d_model, dims[i + 1], bias=False)
            out = nn.Linear(dims[i + 1], size, bias=False)
            nn.init.normal_(proj.weight, std=d_model ** -0.5)
            nn.init.normal_(out.weight, std=dims[i + 1] ** -0.5)
            self.tails.append(nn.Sequential(proj, out))

    def cluster_of(self, target: Tensor) -> Tensor:
        """(N,) ids -> (N,) bin index: 0 = head, i = tail i-1."""
        edges = torch.tensor(self.cutoffs, device=target.device, dtype=target.dtype)
        return torch.bucketize(target, edges, right=True)

    def forward(self, h: Tensor, target: Tensor) -> Tensor:
        """h (N, d), target (N,) long -> (N,) float32 log p(target | h).

        Tail i runs only on the rows whose target falls in it.
        """
        if target.min() < 0 or target.max() >= self.vocab_size:
            raise ValueError(f"target ids must be in [0, {self.vocab_size})")
        head_lp = F.log_softmax(self.head(h).float(), dim=-1)  # (N, c_1 + k)
        cluster = self.cluster_of(target)
        head_index = torch.where(cluster == 0, target, self.shortlist + cluster - 1)
        out = head_lp.gather(1, head_index[:, None]).squeeze(1)  # (N,)
        for i, tail in enumerate(self.tails):
            rows = (cluster == i + 1).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            tail_lp = F.log_softmax(tail(h.index_select(0, rows)).float(), dim=-1)
            local = (target.index_select(0, rows) - self.bounds[i + 1])[:, None]
            out = out.index_add(0, rows, tail_lp.gather(1, local).squeeze(1))
        return out

    def log_prob_at(self, h: Tensor, ids: Tensor) -> Tensor:
        """h (N, d), ids (N, m) long -> (N, m) float32 log p(ids[n, j] | h[n]).

        Tail i runs only on the rows with at least one id in it (the cheap path of token
        distillation: the target plus a teacher's top-k). Column values equal
        :meth:`forward` / :meth:`log_prob` at those ids.
        """
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"ids must be in [0, {self.vocab_size})")
        ids = ids.contiguous()
        head_lp = F.log_softmax(self.head(h).float(), dim=-1)  # (N, c_1 + k)
        cluster = self.cluster_of(ids)  # (N, m)
        out = head_lp.gather(1, torch.where(cluster == 0, ids, self.shortlist + cluster - 1))
        for i, tail in enumerate(self.tails):
            hit = cluster == i + 1  # (N, m)
            rows = hit.any(1).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            tail_lp = F.log_softmax(tail(h.index_select(0, rows)).float(), dim=-1)  # (R, |i|)
            local = (ids.index_select(0, rows) - self.bounds[i + 1]).clamp(0, tail_lp.size(1) - 1)
            picked = tail_lp.gather(1, local) * hit.index_select(0, rows)  # 0 off-cluster
            out = out.index_add(0, rows, picked)
        return out

    def log_prob(self, h: Tensor) -> Tensor:
        """h (N, d) -> (N, V) float32 log-probabilities of every word (all tails run)."""
        head_lp = F.log_softmax(self.head(h).float(), dim=-1)
        parts = [head_lp[:, : self.shortlist]]
        for i, tail in enumerate(self.tails):
            cluster_lp = head_lp[:, self.shortlist + i: self.shortlist + i + 1]
            parts.append(cluster_lp + F.log_softmax(tail(h).float(), dim=-1))
        return torch.cat(parts, dim=-1)

    def macs(self, n_tokens: int, full: bool = True) -> dict[str, int]:
        """Multiply-adds for ``n_tokens`` rows with every tail run (``full``: a full
        distribution, as in generation), else the head only."""
        result = {"softmax_head": n_tokens * self.d_model * self.head.out_features}
        if full:
            for i, tail in enumerate(self.tails):
                proj, out = tail[0], tail[1]
                result[f"softmax_tail{i}"] = n_tokens * (proj.in_features * proj.out_features
                                                         + out.in_features * out.out_features)
        return result


class AdaptiveInput(nn.Module):
    """Adaptive input embeddings: word w of bin i -> ``P_i E_i[w - c_i] · sqrt(d)``.

    Args:
        d_model: output width d.
        vocab_size: V.
        cutoffs, dims: as :class:`AdaptiveSoftmax` (``dims[0] == d_model``: the head needs no
            projection).

    ``forward(tokens)``: (...,) long -> (..., d). Build a tied input with :meth:`tied_to`.
    """

    def __init__(self, d_model: int, vocab_size: int, cutoffs: list[int],
                 dims: list[int] | None = None, *, tables: list[nn.Module] | None = None,
                 projections: list[nn.Module] | None = None,
                 transposed: bool = False) -> None:
        super().__init__()
        cutoffs = list(cutoffs)
        dims = list(dims) if dims is not None else default_dims(d_model, len(cutoffs))
        check_cutoffs(cutoffs, vocab_size, dims, d_model)
        self.d_model, self.vocab_size, self.cutoffs, self.dims = d_model, vocab_size, cutoffs, dims
        self.bounds = [0, *cutoffs, vocab_size]
        self.scale = math.sqrt(d_model)
        if tables is None:
            tables = []
            for i, dim in enumerate(dims):
                emb = nn.Embedding(self.bounds[i + 1] - self.bounds[i], dim)
                nn.init.normal_(emb.weight, std=dim ** -0.5)
                tables.append(emb)
        if projections is None:
            projections = [nn.Identity()]
            for dim in dims[1:]:
                proj = nn.Linear(dim, d_model, bias=False)
                nn.init.normal_(proj.weight, std=d_model ** -0.5)
                projections.append(proj)
        # tables[i].weight: (>= |bin i|, dims[i]); projections[i].weight: (d, dims[i]), or
        # (dims[i], d) when ``transposed`` (a tied softmax down-projection)
        self.tables = nn.ModuleList(tables)
        self.projections = nn.ModuleList(projections)
        self.transposed = transposed

    @classmethod
    def tied_to(cls, softmax: AdaptiveSoftmax, tie_projections: bool = True) -> AdaptiveInput:
        """An input sharing the output embeddings (and projections) of ``softmax``."""
        tables = [softmax.head] + [tail[1] for tail in softmax.tails]
        projections = None
        if tie_projections:
            projections = [nn.Identity()] + [tail[0] for tail in softmax.tails]
        return cls(softmax.d_model, softmax.vocab_size, softmax.cutoffs, softmax.dims,
                   tables=tables, projections=projections,
                   transposed=tie_projections)

    def _project(self, i: int, e: Tensor) -> Tensor:
        proj = self.projections[i]
        if isinstance(proj, nn.Identity):
            return e
        weight = proj.weight.t() if self.transposed else proj.weight
        return F.linear(e, weight)

    def forward(self, tokens: Tensor) -> Tensor:
        flat = tokens.reshape(-1)
        if flat.numel() and (flat.min() < 0 or flat.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        out = None
        for i, table in enumerate(self.tables):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            rows = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            e = self._project(i, F.embedding(flat.index_select(0, rows) - lo, table.weight))
            if out is None:
                out = e.new_zeros(flat.numel(), self.d_model)
            out = out.index_copy(0, rows, e)
        if out is None:  # no tokens at all
            out = self.tables[0].weight.new_zeros(flat.numel(), self.d_model)
        return (out * self.scale).view(*tokens.shape, self.d_model)
