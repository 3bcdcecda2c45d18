"""Top-1 routing of tokens to branches (Tan et al. 2021, DMB eq. 15-16) and token grouping.

A :class:`Router` is the DMB "gating unit"::

    a(x) = softmax(W_g x + b_g)                      (eq. 15)   W_g (N, d), b_g (N,)
    g(x, i) = 1 if a_i(x) is the top element else 0   (eq. 16)

so exactly one branch ``argmax_i a_i(x)`` runs for each token, in training and at
inference alike. The branch output is **not** multiplied by ``a(x)`` (g is binary), so the
task loss sends no gradient to ``W_g, b_g``: the paper trains the gate only through its
auxiliary diversity and entropy losses (eq. 17-20, see :mod:`dynaseq.techniques.branching.losses`):
"binary outputs of the gating units are not differentiable [...] To enable the end-to-end
training of gating units, we introduce two auxiliary losses [...] the gating units can
receive gradients directly from the loss functions". The router's *input* does receive the
auxiliary losses' gradient (the paper does not detach it, neither does this module).

:class:`BranchGroups` turns per-token branch ids into a grouping: tokens are sorted by
branch (stable), each branch runs one matmul on its contiguous group, and the results are
put back in token order. Nothing is computed for a (token, branch) pair that was not chosen.

:class:`GatingUnit` and :class:`Dispatch` are what the branched sub-layers
(:mod:`~dynaseq.techniques.branching.routed`) see of a gate, whatever its kind: the DMB
:class:`Router` dispatches each token to one branch (:class:`Top1Dispatch`), the MoE
``NoisyTopKGate`` to k experts (``ExpertDispatch``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.int8 import KEEP_FLOAT, register_int8
from dynaseq.techniques.branching.traces import ExpertTrace, RouteTrace


@dataclass
class Route:
    """A router's decision for a set of tokens.

    logits: ``(..., N)`` ``W_g x + b_g`` (with their graph in training).
    branch: ``(...)`` long, ``argmax`` over the N branches (ties: the lowest index).
    """

    logits: Tensor
    branch: Tensor

    @property
    def probs(self) -> Tensor:
        """``(..., N)`` the gate distribution ``a(x)`` of eq. 15."""
        return self.logits.softmax(-1)


class Projection(Protocol):
    """What a :class:`Dispatch` runs: a branched linear map over rows grouped by branch
    (``BranchedLinear`` or its int8 version)."""

    def grouped(self, xs: Tensor, groups: BranchGroups) -> Tensor: ...


class Dispatch(ABC):
    """One gate's decision for M tokens, laid out for grouped matmuls.

    The branched sub-layers run every projection through it, whatever the gate: token rows
    go into the grouped layout (:meth:`input_rows`, :meth:`gather`: R rows, M for top-1, M·k
    for top-k), each projection runs once per group over them (:meth:`run`, rows stay in
    that layout), and :meth:`combine` brings R output rows back to the M tokens.
    """

    @property
    @abstractmethod
    def n_tokens(self) -> int:
        """M, the tokens routed."""

    @abstractmethod
    def input_rows(self) -> Tensor:
        """``(R, d)`` the routed tokens' own rows (the gate's input) in the grouped layout."""

    @abstractmethod
    def gather(self, flat: Tensor) -> Tensor:
        """``(M, d)`` rows in token order -> ``(R, d)`` in the grouped layout."""

    @abstractmethod
    def run(self, proj: Projection, rows: Tensor) -> Tensor:
        """``(R, in)`` rows in the grouped layout -> ``(R, out)``, each group through its
        own branch of ``proj``."""

    @abstractmethod
    def combine(self, ys: Tensor) -> Tensor:
        """``(R, out)`` rows in the grouped layout -> ``(M, out)`` in token order."""

    @abstractmethod
    def trace(self, layer: str, gate: str, stream: str,
              gate_id: int) -> RouteTrace | ExpertTrace:
        """The route record of this decision (``gate``: ``"ffn"`` or ``"attn"``)."""

    def project(self, proj: Projection, rows: Tensor) -> Tensor:
        """``(R, in)`` grouped rows -> ``(M, out)`` in token order: :meth:`run`, then
        :meth:`combine`."""
        return self.combine(self.run(proj, rows))


class GatingUnit(nn.Module, ABC):
    """A gate scoring N branches per token with one ``d_model -> N`` linear map
    (:attr:`scorer`) and dispatching tokens to them (:meth:`dispatch`).

    MACs per token: ``d_model · N`` (the scores).
    """

    @property
    @abstractmethod
    def scorer(self) -> nn.Linear:
        """The ``d_model -> N`` map whose outputs decide the branches."""

    @property
    def n_branches(self) -> int:
        """N, the branches the gate scores."""
        return self.scorer.out_features

    @property
    def d_model(self) -> int:
        """Width of the tokens the gate reads."""
        return self.scorer.in_features

    @property
    def runs_per_token(self) -> int:
        """How many branches each token runs (1 for top-1 routing)."""
        return 1

    @abstractmethod
    def dispatch(self, x: Tensor) -> Dispatch:
        """Route ``x`` ``(..., d_model)`` and lay its rows out for the branched projections."""

    def macs(self, n_tokens: int) -> int:
        """Multiply-adds of gating ``n_tokens`` tokens (the scores, at inference)."""
        return n_tokens * self.d_model * self.n_branches


class Router(GatingUnit):
    """DMB gating unit: ``(..., d_model)`` -> :class:`Route` over ``n_branches`` (eq. 15-16).

    Args:
        d_model: input width d.
        n_branches: N (the paper uses 4).
        fast_paths: when every token of a call picks one branch (always, for a one-token
            decoding step), lay them out as they are, so each projection runs that branch's
            plain matmul (no sort, gather or grouped matmul); False forces the general grouped
            layout (:meth:`BranchGroups.of`), for tests and benchmarks. Same outputs.

    ``W_g`` is Xavier-initialised and ``b_g`` zero. (A zero ``W_g`` would be a fixed point:
    every token ties, goes to branch 0, and both auxiliary losses have zero gradient at the
    uniform distribution.) MACs per token: ``d_model · n_branches``.

    Example::

        router = Router(16, n_branches=4)
        route = router(torch.randn(2, 5, 16))   # route.branch (2, 5), route.logits (2, 5, 4)
    """

    def __init__(self, d_model: int, n_branches: int = 4, *, fast_paths: bool = True) -> None:
        super().__init__()
        if d_model < 1:
            raise ValueError(f"Router d_model must be >= 1, got {d_model}")
        if n_branches < 1:
            raise ValueError(f"Router n_branches must be >= 1, got {n_branches}")
        self.proj = nn.Linear(d_model, n_branches)
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.fast_paths = fast_paths

    @property
    def scorer(self) -> nn.Linear:
        return self.proj

    def forward(self, x: Tensor) -> Route:
        # F.linear, not self.proj(x): routing runs at every sub-layer of every decoding
        # step, and a second module call costs as much as the (d x N) matmul itself
        logits = F.linear(x, self.proj.weight, self.proj.bias)  # (..., N)
        return Route(logits, logits.argmax(-1))

    def dispatch(self, x: Tensor) -> Top1Dispatch:
        return Top1Dispatch.of(self(x), x, self.n_branches, fast_paths=self.fast_paths)


@dataclass
class BranchGroups:
    """Tokens grouped by branch: sort once, run one matmul per group, put back.

    order: ``(M,)`` token indices sorted by branch (stable: token order within a branch).
    inverse: ``(M,)`` the inverse permutation (row ``j`` of the sorted layout is token
        ``order[j]``; token ``m`` sits at row ``inverse[m]``).
    sizes: the N group sizes (a Python list: splitting needs them on the host).
    in_order: the tokens are already sorted by branch (one branch took them all, e.g. the
        single token of a greedy decoding step), so :meth:`gather` and :meth:`scatter`
        return their input as it is.
    only: the branch that holds every token, if one does (and there are tokens), else None.
    ends: ``(N,)`` int32 cumulative group sizes (where each group ends in the sorted layout),
        the ``offs`` of ``torch.nn.functional.grouped_mm``; None when ``in_order``.
    branch_sorted: ``(M,)`` the branch of each sorted row; None when ``in_order``.
    """

    order: Tensor
    inverse: Tensor
    sizes: list[int]
    in_order: bool = False
    only: int | None = None
    ends: Tensor | None = None
    branch_sorted: Tensor | None = None

    @classmethod
    def of(cls, branch: Tensor, n_branches: int, *, validate: bool = True,
           fast_paths: bool = True,
           counts: tuple[Tensor, list[int]] | None = None) -> BranchGroups:
        """Group the tokens of ``branch`` ``(M,)`` long, ids in ``[0, n_branches)``.

        ``validate=False`` skips the range check of the ids (one reduction and one host
        sync); for ids that hold by construction, such as a router's argmax.
        ``fast_paths``: tokens that all chose one branch (one token: a single host sync)
        stay as they are (``in_order``, ``only``); False sorts them into the general grouped
        layout (``ends``, ``branch_sorted``) whatever they chose. ``counts``: the tokens per
        branch, ``torch.bincount(branch, minlength=n_branches)`` and its values read on the
        host, when the caller has them (no second count or host read).
        """
        if branch.dim() != 1 or branch.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"branch must be an (M,) integer tensor, got shape "
                             f"{tuple(branch.shape)} {branch.dtype}")
        m = branch.numel()
        if m == 1 and fast_paths:  # one token (a decoding step at batch 1): one host sync
            k = int(branch)
            if not 0 <= k < n_branches:
                raise ValueError(f"branch ids must lie in [0, {n_branches}), got id {k}")
            sizes = [0] * n_branches
            sizes[k] = 1
            identity = branch.new_zeros(1)
            return cls(identity, identity, sizes, in_order=True, only=k)
        if validate and m and int(branch.min()) < 0:
            raise ValueError(f"branch ids must lie in [0, {n_branches}), got id "
                             f"{int(branch.min())}")
        if counts is None:
            count = torch.bincount(branch, minlength=n_branches)
            sizes = count.tolist()  # one host sync
        else:
            count, sizes = counts
        if len(sizes) > n_branches:
            raise ValueError(f"branch ids must lie in [0, {n_branches}), got id "
                             f"{len(sizes) - 1}")
        if m == 0 or (fast_paths and max(sizes) == m):  # one branch takes every token
            identity = torch.arange(m, device=branch.device)
            return cls(identity, identity, sizes, in_order=True,
                       only=sizes.index(m) if m else None)
        branch_sorted, order = torch.sort(branch, stable=True)
        return cls(order, order.argsort(), sizes, ends=count.cumsum(0, dtype=torch.int32),
                   branch_sorted=branch_sorted)

    @property
    def n_tokens(self) -> int:
        return self.order.numel()

    def gather(self, x: Tensor) -> Tensor:
        """``(M, d)`` rows in token order -> ``(M, d)`` rows sorted by branch."""
        return x if self.in_order else x.index_select(0, self.order)

    def scatter(self, y: Tensor) -> Tensor:
        """``(M, d)`` rows sorted by branch -> ``(M, d)`` rows in token order."""
        return y if self.in_order else y.index_select(0, self.inverse)


def run_used_groups(xs: Tensor, groups: BranchGroups, apply: Callable[[int, Tensor], Tensor],
                    out_features: int) -> Tensor:
    """Inference over rows sorted by branch as ``groups`` lays them out: ``apply(k, rows)`` on
    each non-empty group only; a single group runs on ``xs`` directly (no split, no
    concatenation). ``(M, out)``."""
    if groups.only is not None:
        return apply(groups.only, xs)
    parts = xs.split(groups.sizes)
    outs = [apply(k, parts[k]) for k, n in enumerate(groups.sizes) if n]
    return torch.cat(outs) if outs else xs.new_zeros(0, out_features)


@dataclass
class Top1Dispatch(Dispatch):
    """A :class:`Router`'s decision laid out for grouped matmuls: each token is one row,
    rows sorted by branch (R = M).

    route: the decision; groups: the tokens grouped by branch; sorted_rows: ``(M, d)`` the
    input rows in that order, gathered once and shared by every projection that reads them.
    """

    route: Route
    groups: BranchGroups
    sorted_rows: Tensor

    @classmethod
    def of(cls, route: Route, x: Tensor, n_branches: int, *, fast_paths: bool = True,
           counts: tuple[Tensor, list[int]] | None = None) -> Top1Dispatch:
        """Group the rows of ``x`` ``(..., d)`` by ``route.branch`` ``(...)`` (``fast_paths``,
        ``counts``: see :meth:`BranchGroups.of`)."""
        groups = BranchGroups.of(route.branch.reshape(-1), n_branches, validate=False,
                                 fast_paths=fast_paths, counts=counts)
        return cls(route, groups, groups.gather(x.reshape(-1, x.size(-1))))

    @property
    def n_tokens(self) -> int:
        return self.groups.n_tokens

    def input_rows(self) -> Tensor:
        return self.sorted_rows

    def gather(self, flat: Tensor) -> Tensor:
        return self.groups.gather(flat)

    def run(self, proj: Projection, rows: Tensor) -> Tensor:
        return proj.grouped(rows, self.groups)

    def combine(self, ys: Tensor) -> Tensor:
        return self.groups.scatter(ys)

    def trace(self, layer: str, gate: str, stream: str, gate_id: int) -> RouteTrace:
        return RouteTrace(layer, gate, stream, self.route.logits, self.route.branch, gate_id)

# the router's argmax decides which branch runs: int8 rounding could flip it
register_int8(Router, KEEP_FLOAT)
