"""What the branched sub-layers record per call in ``AuxOutputs.traces[ROUTE_TRACE]``.

Every DMB or MoE sub-layer appends one record per set of routed tokens: the gate's logits
(with their graph in training, so the auxiliary losses can be computed afterwards) and the
branches/experts that ran. :mod:`dynaseq.techniques.branching.losses` turns the records of one forward
pass into the auxiliary losses, excluding padding; analysis code can read the same records
for gate statistics and plots.

Records of one gating unit share ``gate_id``. A DMB attention gate routes its query tokens
(``stream="input"``) and, in cross-attention, the memory tokens that are projected to keys
and values (``stream="memory"``); both records belong to the same gating unit.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from dynaseq.nn.outputs import AuxOutputs

ROUTE_TRACE = "branching.routes"
"""``AuxOutputs.traces`` key of the :class:`RouteTrace` / :class:`ExpertTrace` records."""


@dataclass
class RouteTrace:
    """One DMB gating unit routing one set of tokens (top-1, eq. 15-16).

    layer: the sub-layer's ``name`` (``"encoder.layers.0.ffn"`` once
        :func:`~dynaseq.techniques.branching.name_branching_sublayers` has named the model).
    gate: ``"ffn"`` (g_f) or ``"attn"`` (g_a).
    stream: ``"input"`` (the sub-layer's input x) or ``"memory"`` (cross-attention memory).
    logits: ``(B, T, N)`` ``W_g x + b_g``; softmax gives ``a(x)``.
    branch: ``(B, T)`` long, the branch that ran for each token.
    gate_id: identifies the gating unit within one call (records with equal ids are one
        gate's batch of inputs).
    """

    layer: str
    gate: str
    stream: str
    logits: Tensor
    branch: Tensor
    gate_id: int


@dataclass
class ExpertTrace:
    """One noisy top-k MoE gate routing one set of tokens (Shazeer et al. 2017).

    layer, stream, gate_id: as in :class:`RouteTrace`.
    gates: ``(B, T, N)`` ``G(x)``: softmax over the kept logits, 0 elsewhere (eq. 7).
    experts: ``(B, T, k)`` long, the experts that ran for each token (distinct).
    load: ``(B, T, N)`` ``P(x, i)``, the smooth probability that expert i is among the top
        k under a fresh draw of its own noise; None at inference (no noise).
    """

    layer: str
    stream: str
    gates: Tensor
    experts: Tensor
    load: Tensor | None
    gate_id: int


def route_traces(aux: AuxOutputs) -> list[RouteTrace | ExpertTrace]:
    """The routing records of one call (both kinds, in call order)."""
    return list(aux.traces.get(ROUTE_TRACE, []))
