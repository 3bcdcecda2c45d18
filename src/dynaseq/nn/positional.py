"""Sinusoidal positions (Vaswani et al. 2017, sec. 3.5)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class SinusoidalPositions(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)).

    The table is a non-persistent buffer (recomputed, never saved in checkpoints).
    ``forward(length, offset)`` returns ``(length, d_model)`` rows ``offset .. offset+length-1``.
    """

    def __init__(self, d_model: int, max_positions: int = 1024) -> None:
        super().__init__()
        pos = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32)
                        * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_positions, d_model)
        table[:, 0::2] = torch.sin(pos * div)
        table[:, 1::2] = torch.cos(pos * div[: d_model // 2])
        self.register_buffer("table", table, persistent=False)

    @property
    def max_positions(self) -> int:
        return self.table.size(0)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        if offset + length > self.max_positions:
            raise ValueError(f"sequence of {offset + length} positions is longer than "
                             f"max_positions={self.max_positions}")
        return self.table[offset: offset + length]

    def at(self, positions: Tensor) -> Tensor:
        """One position per row: ``positions`` ``(B,)`` long -> ``(B, d_model)`` (rows of a
        decode that began at different steps)."""
        return self.table.index_select(0, positions)
