"""Tokens laid out in equal blocks, one per branch, for one batched matmul (inference).

:class:`~dynaseq.techniques.branching.routing.BranchGroups` sorts M tokens by branch and runs
each branch over its group: a grouped matmul (``F.grouped_mm``) or one ``F.linear`` per group.
On the CPU, at the sizes a sentence gives (tens to hundreds of tokens over four branches),
that costs 2-3x one dense product of all M rows, each small group paying a kernel call of
its own. :class:`BlockDispatch` lays the tokens out instead as N blocks of P rows, block k
holding the tokens that chose branch k and padded to P, the largest group's size::

    X_b = gather(X) : (N, P, d_in),   Y_b = X_b W_kᵀ + b_k per block k   (one torch.baddbmm)

and puts the M real rows back in token order. Padding rows copy token 0 and are computed and
dropped: N·P rows run against M needed. Blocks are laid out for small calls only, of at
most :data:`SMALL_BLOCKS` rows (a sentence's tokens at batch 1, a step of a few dozen rows
whose routing is spread); larger calls, and calls whose tokens all chose one branch, take
the router's own grouped dispatch.

Why by hand: no library kernel runs a batch of small matmuls of unequal row counts well on
the CPU. Measured on this project's 2-core AVX-512 EPYC (``benchmarks/dmb_kernels.py``,
one ``d -> ffn`` projection of M rows over four equal groups, against one dense
``F.linear`` of the same rows): at M = 30 (one sentence's tokens) ``torch.baddbmm`` over
the blocks took 1.13x / 1.02x / 2.37x the dense product at ``tiny`` / ``small`` / ``base``,
``F.grouped_mm`` 2.52x / 2.01x / 3.74x; at M = 128, 0.88x / 1.01x / 1.19x against 2.04x /
1.35x / 1.95x; at M = 960 the two are closer (1.05x / 1.21x / 1.06x against 2.20x /
1.25x / 1.48x). Whole decodes of the untrained DMB (``benchmarks/batch1_latency.py``,
interleaved with the grouped layout) decided the limit: blocks also for calls of up to
twice their tokens' rows (the 960-token encoder and memory at batch 32) made batch-32
greedy decodes 1.11x / 1.09x slower (``tiny`` / ``small``); with small calls only, 1.02x
/ 0.98x. For one 30-token sentence, the encoder with blocks took 0.79x / 0.84x its time
with groups.

A top-1 decision (DMB): each token is one row, outputs not scaled. Float
:class:`~dynaseq.techniques.branching.branched_linear.BranchedLinear` projections only (their
:meth:`~dynaseq.techniques.branching.branched_linear.BranchedLinear.blocked`); int8 ones keep
the grouped layout. The lean decoding and encoding parts
(:mod:`~dynaseq.techniques.branching.lean_step`) use it; the modules' own forward passes keep
:class:`~dynaseq.techniques.branching.routing.Top1Dispatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dynaseq.techniques.branching.branched_linear import BranchedLinear
from dynaseq.techniques.branching.routing import (
    Dispatch,
    Projection,
    Route,
    Router,
    Top1Dispatch,
)
from dynaseq.techniques.branching.traces import RouteTrace

SMALL_BLOCKS = 64
"""Blocks are laid out when their ``N·P`` rows are at most this many, whatever the padding:
calls that small are bound by each product's fixed cost, not by its rows (see the module
docstring)."""


@dataclass
class BlockDispatch(Dispatch):
    """A :class:`Router`'s decision for M tokens laid out as N blocks of P rows (R = N·P).

    route: the decision; index: ``(N·P,)`` the token each row of the layout reads (block k,
    row j: the j-th token, in token order, that chose branch k; padding rows read token 0);
    slot: ``(M,)`` the row of the layout that holds each token; block_rows: P;
    sorted_rows: ``(N·P, d)`` the input rows in that layout, gathered once.
    """

    route: Route
    index: Tensor
    slot: Tensor
    block_rows: int
    sorted_rows: Tensor

    @classmethod
    def of(cls, route: Route, x: Tensor, n_branches: int, small: int = SMALL_BLOCKS,
           sizes: list[int] | None = None) -> BlockDispatch | None:
        """Lay out the rows of ``x`` ``(..., d)`` by ``route.branch`` ``(...)`` (integer ids),
        or None when the blocks would hold more than ``small`` rows, when one branch holds
        every token (its plain matmul is cheaper) or M is 0. ``sizes``: the tokens per
        branch, read on the host, when the caller has them (else one host read here)."""
        branch = route.branch.reshape(-1).long()  # (M,)
        m = branch.numel()
        if m == 0:
            return None
        if sizes is None:
            sizes = torch.bincount(branch, minlength=n_branches).tolist()
        p = max(sizes)
        if p == m or n_branches * p > small:
            return None
        one_hot = F.one_hot(branch, n_branches)  # (M, N)
        rank = one_hot.cumsum(0).gather(1, branch[:, None]).squeeze(1) - 1  # (M,) in block
        slot = branch * p + rank
        index = branch.new_zeros(n_branches * p).index_copy_(
            0, slot, torch.arange(m, device=branch.device))
        return cls(route, index, slot, p, x.reshape(m, -1).index_select(0, index))

    @property
    def n_tokens(self) -> int:
        return self.slot.numel()

    @property
    def n_branches(self) -> int:
        return self.index.numel() // self.block_rows

    def input_rows(self) -> Tensor:
        return self.sorted_rows

    def gather(self, flat: Tensor) -> Tensor:
        """``(M, d)`` rows in token order -> ``(N·P, d)`` in blocks."""
        return flat.index_select(0, self.index)

    def run(self, proj: Projection, rows: Tensor) -> Tensor:
        """``(N·P, in)`` rows in blocks -> ``(N·P, out)``, block k through branch k of
        ``proj`` (a float :class:`BranchedLinear`; an int8 one has no batched product)."""
        if not isinstance(proj, BranchedLinear):
            raise TypeError(f"blocks run float BranchedLinear projections, got "
                            f"{type(proj).__name__}")
        blocks = rows.view(self.n_branches, self.block_rows, -1)
        return proj.blocked(blocks).view(self.index.numel(), -1)

    def combine(self, ys: Tensor) -> Tensor:
        """``(N·P, out)`` rows in blocks -> ``(M, out)`` in token order (padding dropped)."""
        return ys.index_select(0, self.slot)

    def trace(self, layer: str, gate: str, stream: str, gate_id: int) -> RouteTrace:
        return RouteTrace(layer, gate, stream, self.route.logits, self.route.branch, gate_id)


def block_dispatch(router: Router, x: Tensor, blocks: bool = True) -> Dispatch:
    """``router``'s decision for ``x`` ``(..., d)``: in blocks (:class:`BlockDispatch`) when
    ``blocks``, the router takes fast paths and the call is small enough, else the router's
    grouped layout (:class:`Top1Dispatch`, with its own fast paths)."""
    route = router(x)
    n = router.n_branches
    if not (blocks and router.fast_paths):
        return Top1Dispatch.of(route, x, n, fast_paths=router.fast_paths)
    counts = torch.bincount(route.branch.reshape(-1), minlength=n)  # shared by both layouts
    sizes = counts.tolist()  # the one host read
    laid = BlockDispatch.of(route, x, n, sizes=sizes)
    return laid if laid is not None else Top1Dispatch.of(route, x, n, counts=(counts, sizes))
