"""CCT computational budget loss (Bapna, Arivazhagan, Firat 2020, section 2.2, eq. 5-9).

Every sequence b of the batch is assigned a control task ``i = group[b]`` (its control
symbol); task i has a budget ``p_ij`` in (0, 1] for each sub-network j (e.g. encoder,
decoder: ``budgets`` is the ``(N, J)`` table P_M of eq. 9). Gates g with per-token cost C
(MACs of the work the gate controls) give, for task i and sub-network j, summing over the
sequences of task i, their non-padding tokens t, and the gates of sub-network j::

    C_total_ij  = Σ_{b: group[b]=i} Σ_t Σ_{gates of j} C                 (full computation)
    C_budget_ij = p_ij · C_total_ij                                            (eq. 5)
    C_util_ij   = Σ_{b: group[b]=i} Σ_t Σ_{gates of j} g · C                  (eq. 6)
    L_ij        = |C_budget_ij − C_util_ij| / C_budget_ij                      (eq. 7)
    loss        = λ · Σ_{i,j} L_ij     over the (i, j) present in the batch   (eq. 8-9)

The loss is two-sided (it also penalizes using less than the budget, as the paper does)
and batch-level per task (sequences of one task may trade compute among themselves). Under
DDP the batch is the rows of all ranks: ``reduce`` sums C_util and C_total over the ranks
before eq. 7, so N processes compute the loss of the one-process batch.
Padding tokens count neither in C_total nor in C_util. The attention products are charged
to the query gate at their dense size (the keys the query may attend to).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dynaseq.techniques.cct.gating import GateTrace


@dataclass
class BudgetTerm:
    """One set of gates entering the budget loss.

    gates: ``(B, T, G)`` gate values (soft in training).
    cost: MACs one open gate spends on one token, broadcastable to ``gates``.
    valid: ``(B, T)`` bool, False at padding.
    subnetwork: column j of the budget table.
    """

    gates: Tensor
    cost: Tensor
    valid: Tensor
    subnetwork: int


@dataclass
class BudgetLoss:
    """loss: λ·Σ L_ij (scalar); per_task: ``(N, J)`` L_ij (0 where absent);
    utilization: ``(N, J)`` C_util / C_total (nan where task i has no tokens of j)."""

    loss: Tensor
    per_task: Tensor
    utilization: Tensor


def budget_loss(terms: Sequence[BudgetTerm], group: Tensor, budgets: Tensor,
                weight: float = 1.0,
                reduce: Callable[[Tensor], Tensor] | None = None) -> BudgetLoss:
    """The multi-task budget loss of eq. 5-9 (see the module docstring for the formula).

    terms: the gates of the batch (see :func:`budget_terms` for gate traces).
    group: ``(B,)`` long, the control task of each sequence, in ``[0, N)``.
    budgets: ``(N, J)`` fractions in (0, 1]: budget of task i for sub-network j.
    weight: λ.
    reduce: applied to the stacked ``(2, N, J)`` C_util and C_total of this batch before
        eq. 7 (:func:`dynaseq.core.distributed.sum_over_ranks` under DDP: the whole batch's
        sums, differentiably).
    """
    if budgets.dim() != 2:
        raise ValueError(f"budgets must be an (N tasks, J sub-networks) table, got shape "
                         f"{tuple(budgets.shape)}")
    if not bool(((budgets > 0) & (budgets <= 1)).all()):
        raise ValueError(f"budgets must lie in (0, 1], got {budgets.tolist()}")
    if group.dim() != 1 or group.dtype not in (torch.int32, torch.int64):
        raise ValueError("group must be a (B,) integer tensor of control-task ids")
    n_tasks, n_sub = budgets.shape
    if group.numel() and (int(group.min()) < 0 or int(group.max()) >= n_tasks):
        raise ValueError(f"group ids must lie in [0, {n_tasks}), got {group.tolist()}")
    if not terms:
        raise ValueError("budget_loss needs at least one gate term")
    batch = group.numel()
    dtype = terms[0].gates.dtype
    util = torch.zeros(batch, n_sub, dtype=dtype, device=budgets.device)  # per sequence
    total = torch.zeros(batch, n_sub, dtype=dtype, device=budgets.device)
    for term in terms:
        g = term.gates
        if g.dim() != 3 or g.size(0) != batch:
            raise ValueError(f"gates must be (B={batch}, T, G), got {tuple(g.shape)}")
        if term.valid.shape != g.shape[:2]:
            raise ValueError(f"valid mask {tuple(term.valid.shape)} does not match gates "
                             f"{tuple(g.shape[:2])}")
        if not 0 <= term.subnetwork < n_sub:
            raise ValueError(f"subnetwork {term.subnetwork} is not a column of budgets "
                             f"(J={n_sub})")
        cost = torch.broadcast_to(term.cost.to(g), g.shape) * term.valid[..., None].to(g)
        util[:, term.subnetwork] += (g * cost).sum((1, 2))
        total[:, term.subnetwork] += cost.sum((1, 2))
    c_util = util.new_zeros(n_tasks, n_sub).index_add(0, group, util)  # (N, J)
    c_total = total.new_zeros(n_tasks, n_sub).index_add(0, group, total)
    if reduce is not None:
        c_util, c_total = reduce(torch.stack([c_util, c_total]))
    present = c_total > 0
    c_budget = budgets.to(dtype) * c_total
    per_task = torch.where(present, (c_budget - c_util).abs() / c_budget.where(present, 1.0),
                           torch.zeros_like(c_util))
    utilization = torch.where(present, c_util / c_total.where(present, 1.0),
                              torch.full_like(c_util, float("nan")))
    return BudgetLoss(weight * per_task.sum(), per_task, utilization.detach())


def budget_terms(traces: Sequence[GateTrace], valid: Mapping[str, Tensor],
                 subnetworks: Sequence[str] = ("encoder", "decoder")) -> list[BudgetTerm]:
    """Turn gate traces into budget terms.

    A trace belongs to sub-network ``layer.split(".")[0]`` (names as set by
    ``name_conditional_sublayers``: ``"encoder.layers.0.ffn"`` -> ``"encoder"``), which must
    be one of ``subnetworks`` (the columns of the budget table, in order). Its padding mask
    is ``valid[j]`` for gates over the sub-layer's own input and ``valid[j + ".memory"]``
    for gates over the cross-attention memory, e.g. for a translation model::

        valid = {"encoder": ~src_pad, "decoder": ~tgt_pad, "decoder.memory": ~src_pad}
    """
    terms = []
    for tr in traces:
        sub = tr.layer.split(".")[0]
        if sub not in subnetworks:
            raise ValueError(f"gate trace of layer {tr.layer!r} belongs to no sub-network of "
                             f"{list(subnetworks)}; name the sub-layers with "
                             "name_conditional_sublayers(model)")
        key = sub if tr.stream == "input" else f"{sub}.{tr.stream}"
        if key not in valid:
            raise ValueError(f"no padding mask {key!r} for the {tr.gate!r} gates of {tr.layer!r}")
        terms.append(BudgetTerm(tr.values, tr.cost, valid[key], list(subnetworks).index(sub)))
    return terms
