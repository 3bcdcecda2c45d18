"""Per-call auxiliary outputs that sub-layers may fill (losses, gate traces).

One :class:`AuxOutputs` is created per forward call and passed down explicitly, so
adaptive sub-layers can report auxiliary losses and what ran for which token without any
module-level state. Dense sub-layers accept it and ignore it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

RowCounter = Callable[[Tensor | None, Tensor | None, bool], Tensor]
"""``rows(q_valid, k_valid, all_on) -> (B,)`` long: a call's MACs per row counting only the
positions where ``q_valid`` ``(B, T)`` (the call's own tokens) and ``k_valid`` ``(B, S)`` (its
keys' tokens) are True (None: every position); ``all_on``: with every gate open."""

MACS_TRACE = "macs"
"""``AuxOutputs.traces`` key of the :class:`MacsRecord` entries (inference only)."""


@dataclass
class MacsRecord:
    """MACs one call of an adaptive sub-layer (CCT's gated sub-layers, DMB/MoE branches)
    actually executed at inference: a compute record.

    macs: per matrix, over the whole batch (the packed attention layout's padding slots
        included: they run).
    per_row: ``(B,)`` long, the MACs each row's own tokens ran (all matrices): what the row
        costs run alone (batch 1) with the same padded input, whatever else shares its
        batch. ``None`` where a sub-layer does not count per row.
    per_row_full: ``(B,)`` long, what ``per_row`` would be with every gate of the call open
        (the same input; the denominator of a realized fraction, so no second call with
        every gate on is needed). ``None`` where the sub-layer cannot tell (keys read
        from a cache).
    rows: the same per-row counts restricted to the positions a caller says are a row's
        own (:data:`RowCounter`): what the row costs run alone, without the padding its
        batch gave it. ``None`` where the sub-layer does not count per row.
    keys_from_memory: the call's keys are the other stack's tokens (cross-attention), so
        ``rows`` takes that stack's validity as ``k_valid``.
    """

    layer: str
    macs: dict[str, int]
    per_row: Tensor | None = None
    per_row_full: Tensor | None = None
    rows: RowCounter | None = None
    keys_from_memory: bool = False


@dataclass
class AuxOutputs:
    """Auxiliary losses (summed per name) and traces (appended per name) of one call."""

    losses: dict[str, Tensor] = field(default_factory=dict)
    traces: dict[str, list[Any]] = field(default_factory=dict)

    def add_loss(self, name: str, value: Tensor) -> None:
        self.losses[name] = self.losses[name] + value if name in self.losses else value

    def add_trace(self, name: str, value: Any) -> None:
        self.traces.setdefault(name, []).append(value)
