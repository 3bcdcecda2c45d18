"""Adaptive-computation techniques built from :mod:`dynaseq.nn` blocks.

CCT (conditional computation, Bapna et al. 2020): :mod:`dynaseq.adaptive.cct`.
"""

from dynaseq.adaptive.cct import (
    GATE_TRACE,
    MACS_TRACE,
    BudgetLoss,
    BudgetTerm,
    ConditionalAttention,
    ConditionalFeedForward,
    ControlNet,
    FeedForwardPiece,
    Gate,
    GatedKVCache,
    GateTrace,
    MacsRecord,
    NoiseSchedule,
    budget_loss,
    budget_terms,
    conditional_attention,
    conditional_feedforward,
    force_gates,
    gate_traces,
    name_conditional_sublayers,
    realized_macs_by_layer,
    set_gate_step,
)

__all__ = [
    "GATE_TRACE",
    "MACS_TRACE",
    "BudgetLoss",
    "BudgetTerm",
    "ConditionalAttention",
    "ConditionalFeedForward",
    "ControlNet",
    "FeedForwardPiece",
    "Gate",
    "GateTrace",
    "GatedKVCache",
    "MacsRecord",
    "NoiseSchedule",
    "budget_loss",
    "budget_terms",
    "conditional_attention",
    "conditional_feedforward",
    "force_gates",
    "gate_traces",
    "name_conditional_sublayers",
    "realized_macs_by_layer",
    "set_gate_step",
]
