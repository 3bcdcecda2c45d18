"""Dynamic multi-branch layers (DMB; Tan et al. 2021) and the top-k MoE baseline.

A DMB layer holds N branches and a gate; exactly one branch runs per token, in training and
at inference, so a DMB model costs what a dense model with one branch costs (plus the gate)
while holding N times the parameters. The pieces, one concept per module:

* :mod:`~dynaseq.techniques.branching.routing` — the gate ``a(x) = softmax(W_g x + b_g)`` with top-1
  decision (eq. 15-16), and token grouping by branch;
* :mod:`~dynaseq.techniques.branching.branched_linear` — N linear maps routed per row (eq. 25) with
  shared-private reparameterization ``θ_k = θ_S + θ_Pk`` (eq. 21-23) and its merge;
* :mod:`~dynaseq.techniques.branching.routed` — the branched FFN and attention whatever the
  gate (one forward pass, trace and MAC count for DMB and MoE alike), each gate handing its
  decision over as a :class:`~dynaseq.techniques.branching.routing.Dispatch`;
* :mod:`~dynaseq.techniques.branching.dmb_ffn` — DMB feed-forward (eq. 24);
* :mod:`~dynaseq.techniques.branching.dmb_attention` — DMB attention with branched q/k/v/out
  projections (eq. 25-30), with the plain key/value cache;
* :mod:`~dynaseq.techniques.branching.moe` — noisy top-k mixture of experts (eq. 6-9, Shazeer 2017) for
  the FFN and the attention projections;
* :mod:`~dynaseq.techniques.branching.lean_step` — the DMB sub-layers' parts of the lean
  decoding step (:mod:`dynaseq.models.lean`);
* :mod:`~dynaseq.techniques.branching.traces` / :mod:`~dynaseq.techniques.branching.losses` — per-call route
  records and the auxiliary losses built from them (eq. 17-20, 31; importance and load),
  with padding excluded.

``build_seq2seq`` wires these from ``ModelConfig.dmb`` / ``ModelConfig.moe``, the training
loop adds :func:`seq2seq_routing_loss` (weighted by ``aux_weight``) and ``Translator.load``
merges the shared parts. By hand (sketch)::

    layer = EncoderLayer(d, dmb_attention(d, heads), dmb_feedforward(d, ffn_dim))
    name_branching_sublayers(model)               # trace names "encoder.layers.0.ffn", ...
    out = model(src, tgt_in)                      # out.aux holds the route records
    aux = routing_losses(out.aux, seq2seq_valid(src, tgt_in, pad_id), alpha=0.1)
    loss = ce_mean + aux.total                    # eq. 31
    merge_shared_(model)                          # after training: θ_k = θ_S + θ_Pk
"""

from __future__ import annotations

from torch import nn

from dynaseq.techniques.branching import lean_step  # noqa: F401, E402  (registers the lean parts)
from dynaseq.techniques.branching.branched_linear import BranchedLinear, merge_shared_
from dynaseq.techniques.branching.dmb_attention import BranchedAttention, dmb_attention
from dynaseq.techniques.branching.dmb_ffn import BranchedFeedForward, dmb_feedforward
from dynaseq.techniques.branching.losses import (
    GateLosses,
    RoutingLosses,
    add_routing_losses,
    cv_squared,
    diversity_loss,
    entropy_loss,
    routing_losses,
    seq2seq_routing_loss,
    seq2seq_valid,
)
from dynaseq.techniques.branching.moe import (
    ExpertPairs,
    MoEAttention,
    MoEFeedForward,
    NoisyTopKGate,
    TopKRoute,
    load_probability,
    moe_attention,
    moe_feedforward,
)
from dynaseq.techniques.branching.routed import RoutedAttention, RoutedFeedForward
from dynaseq.techniques.branching.routing import BranchGroups, Dispatch, GatingUnit, Route, Router
from dynaseq.techniques.branching.traces import ROUTE_TRACE, ExpertTrace, RouteTrace, route_traces

__all__ = [
    "ROUTE_TRACE",
    "BranchGroups",
    "BranchedAttention",
    "BranchedFeedForward",
    "BranchedLinear",
    "Dispatch",
    "ExpertPairs",
    "ExpertTrace",
    "GateLosses",
    "GatingUnit",
    "MoEAttention",
    "MoEFeedForward",
    "NoisyTopKGate",
    "Route",
    "RouteTrace",
    "RoutedAttention",
    "RoutedFeedForward",
    "Router",
    "RoutingLosses",
    "TopKRoute",
    "add_routing_losses",
    "cv_squared",
    "diversity_loss",
    "dmb_attention",
    "dmb_feedforward",
    "entropy_loss",
    "load_probability",
    "merge_shared_",
    "moe_attention",
    "moe_feedforward",
    "name_branching_sublayers",
    "route_traces",
    "routing_losses",
    "seq2seq_routing_loss",
    "seq2seq_valid",
]


def name_branching_sublayers(model: nn.Module) -> int:
    """Name every DMB / MoE sub-layer after its path in ``model``
    (``"decoder.layers.1.cross_attn"``).

    Route records carry that name; :func:`routing_losses` reads the stream's padding mask
    from its first component. Returns how many sub-layers were named.
    """
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, (RoutedAttention, RoutedFeedForward)):  # DMB and MoE
            m.name = name
            n += 1
    return n
